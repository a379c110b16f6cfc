#include "hobbit-executor-choice.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <vector>

static double seconds_since(std::chrono::steady_clock::time_point t0) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

bool executor_choice::in_place(int n_tokens, double resident) const {
    if (!available || mode == HOBBIT_MODE_GPU_CENTRIC) {
        return false;
    }
    if (mode == HOBBIT_MODE_COOPERATIVE) {
        return true;
    }
    // auto: weights already in the page cache cost no read at all in place
    if (resident >= 0.9) {
        return true;
    }
    // a single token keeps what it loads for the next ones (reuse); a wide ubatch uses each
    // expert for many tokens at once, and in place every expert of the layer runs in one
    // pass, with the file's readahead, instead of waiting for loads slot by slot
    return n_tokens > 1 && map_bytes_per_s >= load_bytes_per_s;
}

executor_choice executor_choice_make(const expert_index & index, enum hobbit_mode mode, bool available, bool direct_io) {
    executor_choice c;
    c.mode = mode;
    c.available = available;
    if (!available || mode != HOBBIT_MODE_AUTO) {
        return c; // only auto decides by the bandwidths
    }
    const expert_proj_layout * probe = nullptr;
    for (const expert_layer_layout & layer : index.layers) {
        for (const expert_proj_layout & p : layer.proj) {
            if (p.present && (probe == nullptr || p.n_bytes > probe->n_bytes)) {
                probe = &p;
            }
        }
        if (probe != nullptr) {
            break;
        }
    }
    const int fd = open(index.path.c_str(), O_RDONLY | O_CLOEXEC);
    if (probe == nullptr || fd < 0) {
        if (fd >= 0) {
            close(fd);
        }
        return c;
    }
    const long page = sysconf(_SC_PAGESIZE);
    const uint64_t begin = probe->offset / page * page;
    const uint64_t end = probe->offset + probe->n_bytes;
    const size_t span = end - begin;

    // a load: what the I/O threads do (one reader here, as a lower bound)
    try {
        posix_fadvise(fd, begin, span, POSIX_FADV_DONTNEED);
        expert_store store(index, direct_io);
        const auto t0 = std::chrono::steady_clock::now();
        for (int il = 0; il < (int) index.layers.size(); ++il) {
            if (index.layers[il].has_experts()) {
                for (int p = 0; p < LLAMA_MOE_PROJ_COUNT; ++p) {
                    if (&index.layers[il].proj[p] == probe) {
                        store.read_slice(il, 0, p);
                    }
                }
                break;
            }
        }
        const double s = seconds_since(t0);
        c.load_bytes_per_s = s > 0 ? probe->n_bytes / s : 0.0;
    } catch (const std::exception &) {
        c.load_bytes_per_s = 0.0;
    }

    // in place: page faults on a mapping of the same bytes
    posix_fadvise(fd, begin, span, POSIX_FADV_DONTNEED);
    void * map = mmap(nullptr, span, PROT_READ, MAP_SHARED, fd, (off_t) begin);
    if (map != MAP_FAILED) {
        const auto t0 = std::chrono::steady_clock::now();
        volatile uint8_t sink = 0;
        for (size_t off = 0; off < span; off += page) {
            sink ^= ((const uint8_t *) map)[off];
        }
        (void) sink;
        const double s = seconds_since(t0);
        c.map_bytes_per_s = s > 0 ? span / s : 0.0;
        munmap(map, span);
    }
    close(fd);
    return c;
}

double resident_share(const void * addr, size_t n_bytes) {
    if (addr == nullptr || n_bytes == 0) {
        return 0.0;
    }
    const uintptr_t page = (uintptr_t) sysconf(_SC_PAGESIZE);
    const uintptr_t begin = (uintptr_t) addr / page * page;
    const uintptr_t end = (uintptr_t) addr + n_bytes;
    const size_t n_page = (end - begin + page - 1) / page;
    std::vector<unsigned char> vec(n_page);
    if (mincore((void *) begin, end - begin, vec.data()) != 0) {
        return 0.0;
    }
    size_t n_resident = 0;
    for (unsigned char v : vec) {
        n_resident += v & 1;
    }
    return (double) n_resident / n_page;
}
