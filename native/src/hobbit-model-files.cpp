// hobbit-model-files.cpp - the model's files for a run: mapping advice, parts opened and guarded, checks that a
// file was not cut or replaced while running, read-ahead of experts run in place.

#include "hobbit-model-files.h"

#include "hobbit-error.h"
#include "hobbit-executor-choice.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>

void model_files::open(const expert_index & index, const std::vector<int> & moe_layers) {
    this->index = &index;
    const std::vector<uintptr_t> base = advise_random(moe_layers);
    // The model's files stay open for the run: their size and identity are asked of what this
    // process maps, not of the paths (a model renamed over or removed is intact here). Every
    // part's whole mapping is guarded, the resident weights too: a file cut while running is
    // this run's error, never a SIGBUS in the compute threads.
    parts.resize(index.parts.size());
    for (size_t part = 0; part < index.parts.size(); ++part) {
        part_file & f = parts[part];
        f.fd = ::open(index.parts[part].c_str(), O_RDONLY | O_CLOEXEC);
        struct stat st;
        if (f.fd < 0 || fstat(f.fd, &st) != 0) {
            const std::string why = strerror(errno);
            close_all();
            throw hobbit_error(HOBBIT_STATUS_ERROR_IO, index.parts[part] + ": cannot open model file: " + why);
        }
        f.size  = st.st_size;
        f.mtime = st.st_mtim;
        if (base[part] != 0) {
            f.guard = std::make_unique<mapping_guard>((const void *) base[part], (size_t) st.st_size);
        }
    }
    loaded_fingerprint = index.fingerprint();
}

model_files::~model_files() {
    close_all();
}

void model_files::close_all() {
    for (const part_file & f : parts) {
        if (f.fd >= 0) {
            close(f.fd);
        }
    }
    parts.clear();
}

std::vector<uintptr_t> model_files::advise_random(const std::vector<int> & moe_layers) const {
    // The loader maps the offloaded experts with MADV_RANDOM, the resident weights with the
    // kernel's default readahead. A fault in a resident tensor then reads read_ahead_kb
    // around it (8 MB on this VM's disk), and the file's readahead runs on past the tensor
    // into the experts beside it: measured, 23 MB of a tiny model's first expert layer in
    // the page cache after one token, outside every budget (a capped soak reached its cap
    // thousands of times). The resident weights were read ahead at load (MADV_WILLNEED);
    // from here a fault reads its page only, and in place reads exactly its slices ahead
    // (read_ahead_expert). Each part's mapping covers its whole file from offset 0: its start
    // is any of its expert tensors' address less that tensor's file offset.
    std::vector<uintptr_t> base(index->parts.size(), 0);
    for (int il : moe_layers) {
        for (int p = 0; p < LLAMA_MOE_PROJ_COUNT; ++p) {
            const ggml_tensor * t = llama_model_get_expert_tensor(model_, il, (llama_moe_proj) p);
            const expert_proj_layout & pl = index->layers[il].proj[p];
            if (t == nullptr || t->data == nullptr || !pl.present) {
                continue;
            }
            const uintptr_t b = (uintptr_t) t->data - (uintptr_t) pl.offset;
            if ((base[pl.part] != 0 && b != base[pl.part]) || b % (uintptr_t) sysconf(_SC_PAGESIZE) != 0) {
                // not one mapping of the file (not mapped at all): nothing to advise, no base known
                return std::vector<uintptr_t>(index->parts.size(), 0);
            }
            base[pl.part] = b;
        }
    }
    for (size_t part = 0; part < index->parts.size(); ++part) {
        struct stat st;
        if (base[part] != 0 && stat(index->parts[part].c_str(), &st) == 0) {
            map_advise_random((const void *) base[part], (size_t) st.st_size);
        }
    }
    return base;
}

std::string model_files::changed() const {
    for (size_t part = 0; part < parts.size(); ++part) {
        const part_file & f = parts[part];
        const std::string & path = index->parts[part];
        struct stat st;
        if (fstat(f.fd, &st) != 0) {
            return path + ": cannot stat the model file while running: " + strerror(errno);
        }
        if (st.st_size == f.size && st.st_mtim.tv_sec == f.mtime.tv_sec && st.st_mtim.tv_nsec == f.mtime.tv_nsec) {
            continue;
        }
        if (st.st_size < f.size) {
            return path + ": truncated while running: the file now has " + std::to_string((int64_t) st.st_size) +
                   " bytes, it had " + std::to_string((int64_t) f.size) + " when loaded";
        }
        // written to. The sampled fingerprint names the case where other experts are in it; when
        // it matches, the write may still have changed bytes between its samples, which only
        // reading every expert could rule out: either way the loaded model is gone
        std::vector<int> fds;
        for (const part_file & pf : parts) {
            fds.push_back(pf.fd);
        }
        std::string now;
        try {
            now = index->fingerprint_of(fds);
        } catch (const hobbit_error & e) {
            return e.what();
        }
        if (now != loaded_fingerprint) {
            return path + ": overwritten while running: its experts are not those loaded (fingerprint " + now +
                   ", loaded " + loaded_fingerprint + "); load the model again to run the new file";
        }
        return path + ": written to while running (its size or modification time changed): its experts may no "
               "longer be those loaded; load the model again";
    }
    return "";
}

std::string model_files::expert_missing(int il, int e) const {
    if (index == nullptr) {
        return ""; // no model mapped: nothing runs in place
    }
    for (const expert_proj_layout & p : index->layers[il].proj) {
        if (!p.present) {
            continue;
        }
        const std::string & path = index->parts[p.part];
        struct stat st;
        if (p.part >= (int) parts.size() || fstat(parts[p.part].fd, &st) != 0) {
            return path + ": cannot stat the model file while running: " + strerror(p.part < (int) parts.size() ? errno : EBADF);
        }
        const uint64_t end = p.offset + (uint64_t) (e + 1) * p.n_bytes;
        if (end > (uint64_t) st.st_size) {
            return path + ": truncated while running: expert " + std::to_string(e) + " of layer " + std::to_string(il) +
                   " ends at byte " + std::to_string(end) + ", the file now has " + std::to_string((int64_t) st.st_size);
        }
    }
    return "";
}

bool model_files::faulted() const {
    for (const part_file & f : parts) {
        if (f.guard && f.guard->faulted()) {
            return true;
        }
    }
    return false;
}

std::string model_files::fault() const {
    for (size_t part = 0; part < parts.size(); ++part) {
        if (parts[part].guard && parts[part].guard->faulted()) {
            return index->parts[part] + ": truncated while running: a read of its mapped weights past the file's new end";
        }
    }
    return "";
}

void model_files::restore() {
    for (part_file & f : parts) {
        if (f.guard) {
            f.guard->restore(f.fd, 0, MADV_RANDOM);
        }
    }
}

void model_files::read_ahead_expert(int il, int e) const {
    for (int p = 0; p < LLAMA_MOE_PROJ_COUNT; ++p) {
        const ggml_tensor * t = llama_model_get_expert_tensor(model_, il, (llama_moe_proj) p);
        if (t != nullptr && t->data != nullptr) {
            map_advise_willneed((const char *) t->data + (size_t) e * t->nb[2], t->nb[2]);
        }
    }
}

void model_files::read_ahead_layer(int il) const {
    for (int p = 0; p < LLAMA_MOE_PROJ_COUNT; ++p) {
        const ggml_tensor * t = llama_model_get_expert_tensor(model_, il, (llama_moe_proj) p);
        if (t != nullptr && t->data != nullptr) {
            map_advise_willneed(t->data, ggml_nbytes(t));
        }
    }
}
