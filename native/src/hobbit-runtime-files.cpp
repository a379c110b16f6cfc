// hobbit-runtime-files.cpp - The runtime and the model's files: read-ahead advice on the mappings, every part
// opened and guarded against SIGBUS, checks that a file was not cut or replaced while running, read-ahead of
// experts run in place.

#include "hobbit-runtime.h"

#include "hobbit-error.h"
#include "hobbit-neuron-reads.h"
#include "hobbit-substitution.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cfloat>
#include <chrono>
#include <climits>
#include <cstdint>
#include <cmath>
#include <cstring>
#include <map>
#include <numeric>

void hobbit_runtime::advise_mapping_random() {
    // The loader maps the offloaded experts with MADV_RANDOM, the resident weights with the
    // kernel's default readahead. A fault in a resident tensor then reads read_ahead_kb
    // around it (8 MB on this VM's disk), and the file's readahead runs on past the tensor
    // into the experts beside it: measured, 23 MB of a tiny model's first expert layer in
    // the page cache after one token, outside every budget (a capped soak reached its cap
    // thousands of times). The resident weights were read ahead at load (MADV_WILLNEED);
    // from here a fault reads its page only, and in place reads exactly its slices ahead
    // (read_ahead_in_place). Each part's mapping covers its whole file from offset 0: its start
    // is any of its expert tensors' address less that tensor's file offset.
    std::vector<uintptr_t> base(index.parts.size(), 0);
    part_base.assign(index.parts.size(), 0);
    for (int il : moe_layers) {
        for (int p = 0; p < LLAMA_MOE_PROJ_COUNT; ++p) {
            const ggml_tensor * t = llama_model_get_expert_tensor(model, il, (llama_moe_proj) p);
            const expert_proj_layout & pl = index.layers[il].proj[p];
            if (t == nullptr || t->data == nullptr || !pl.present) {
                continue;
            }
            const uintptr_t b = (uintptr_t) t->data - (uintptr_t) pl.offset;
            if ((base[pl.part] != 0 && b != base[pl.part]) || b % (uintptr_t) sysconf(_SC_PAGESIZE) != 0) {
                return; // not one mapping of the file (not mapped at all): nothing to advise, no base known
            }
            base[pl.part] = b;
        }
    }
    part_base = base;
    for (size_t part = 0; part < index.parts.size(); ++part) {
        struct stat st;
        if (base[part] != 0 && stat(index.parts[part].c_str(), &st) == 0) {
            map_advise_random((const void *) base[part], (size_t) st.st_size);
        }
    }
}

void hobbit_runtime::open_and_guard_parts() {
    // The model's files stay open for the run: their size and identity are asked of what this
    // process maps, not of the paths (a model renamed over or removed is intact here). Every
    // part's whole mapping is guarded, the resident weights too: a file cut while running is
    // this run's error, never a SIGBUS in the compute threads.
    part_files.resize(index.parts.size());
    for (size_t part = 0; part < index.parts.size(); ++part) {
        part_file & f = part_files[part];
        f.fd = open(index.parts[part].c_str(), O_RDONLY | O_CLOEXEC);
        struct stat st;
        if (f.fd < 0 || fstat(f.fd, &st) != 0) {
            throw hobbit_error(HOBBIT_STATUS_ERROR_IO, index.parts[part] + ": cannot open model file: " + strerror(errno));
        }
        f.size  = st.st_size;
        f.mtime = st.st_mtim;
        if (part < part_base.size() && part_base[part] != 0) {
            f.guard = std::make_unique<mapping_guard>((const void *) part_base[part], (size_t) st.st_size);
        }
    }
    loaded_fingerprint = index.fingerprint();
}

void hobbit_runtime::check_files_unchanged() {
    for (size_t part = 0; part < part_files.size(); ++part) {
        const part_file & f = part_files[part];
        const std::string & path = index.parts[part];
        struct stat st;
        if (fstat(f.fd, &st) != 0) {
            fail(path + ": cannot stat the model file while running: " + strerror(errno));
            return;
        }
        if (st.st_size == f.size && st.st_mtim.tv_sec == f.mtime.tv_sec && st.st_mtim.tv_nsec == f.mtime.tv_nsec) {
            continue;
        }
        if (st.st_size < f.size) {
            fail(path + ": truncated while running: the file now has " + std::to_string((int64_t) st.st_size) +
                 " bytes, it had " + std::to_string((int64_t) f.size) + " when loaded");
            return;
        }
        // written to. The sampled fingerprint names the case where other experts are in it; when
        // it matches, the write may still have changed bytes between its samples, which only
        // reading every expert could rule out: either way the loaded model is gone
        std::vector<int> fds;
        for (const part_file & pf : part_files) {
            fds.push_back(pf.fd);
        }
        std::string now;
        try {
            now = index.fingerprint_of(fds);
        } catch (const hobbit_error & e) {
            fail(e.what());
            return;
        }
        if (now != loaded_fingerprint) {
            fail(path + ": overwritten while running: its experts are not those loaded (fingerprint " + now +
                 ", loaded " + loaded_fingerprint + "); load the model again to run the new file");
        } else {
            fail(path + ": written to while running (its size or modification time changed): its experts may no "
                 "longer be those loaded; load the model again");
        }
        return;
    }
}

void hobbit_runtime::read_ahead_in_place(int il, int e) {
    for (int p = 0; p < LLAMA_MOE_PROJ_COUNT; ++p) {
        const ggml_tensor * t = llama_model_get_expert_tensor(model, il, (llama_moe_proj) p);
        if (t != nullptr && t->data != nullptr) {
            map_advise_willneed((const char *) t->data + (size_t) e * t->nb[2], t->nb[2]);
        }
    }
}

void hobbit_runtime::read_ahead_next_layer(int il) {
    const auto it = std::find(moe_layers.begin(), moe_layers.end(), il);
    if (it == moe_layers.end() || it + 1 == moe_layers.end()) {
        return;
    }
    const int next = *(it + 1);
    // the page cache holds this layer's experts while they compute: only with room for both
    const int64_t layer_bytes = (int64_t) index.layers[next].n_bytes() * index.info.n_expert;
    const int64_t room = page_cache_room();
    if (room >= 0 && (int64_t) index.layers[il].n_bytes() * index.info.n_expert + layer_bytes > room) {
        return;
    }
    for (int p = 0; p < LLAMA_MOE_PROJ_COUNT; ++p) {
        const ggml_tensor * t = llama_model_get_expert_tensor(model, next, (llama_moe_proj) p);
        if (t != nullptr && t->data != nullptr) {
            map_advise_willneed(t->data, ggml_nbytes(t));
        }
    }
}

bool hobbit_runtime::mapped_expert_present(int il, int e) {
    for (const expert_proj_layout & p : index.layers[il].proj) {
        if (!p.present) {
            continue;
        }
        const std::string & path = index.parts[p.part];
        struct stat st;
        if (p.part >= (int) part_files.size() || fstat(part_files[p.part].fd, &st) != 0) {
            fail(path + ": cannot stat the model file while running: " + strerror(p.part < (int) part_files.size() ? errno : EBADF));
            return false;
        }
        const uint64_t end = p.offset + (uint64_t) (e + 1) * p.n_bytes;
        if (end > (uint64_t) st.st_size) {
            fail(path + ": truncated while running: expert " + std::to_string(e) + " of layer " + std::to_string(il) +
                 " ends at byte " + std::to_string(end) + ", the file now has " + std::to_string((int64_t) st.st_size));
            return false;
        }
    }
    return true;
}

bool hobbit_runtime::mapping_faulted() const {
    for (const part_file & f : part_files) {
        if (f.guard && f.guard->faulted()) {
            return true;
        }
    }
    return false;
}
