#include "hobbit-executor-choice.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <functional>
#include <thread>
#include <vector>

static double seconds_since(std::chrono::steady_clock::time_point t0) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// in place wins a wide ubatch unless faulting the file in is this much slower than loading
// (measured here: both near 1 GB/s, and in place took a 16-token prefill in 0.9-1.1 s where
// loading took 1.6 s: one pass over the layer instead of waiting slot by slot)
static constexpr double WIDE_UBATCH_MAP_FACTOR = 0.5;

bool executor_choice::in_place(int n_tokens, double resident, int64_t layer_bytes, int64_t room) const {
    if (!available || mode == HOBBIT_MODE_GPU_CENTRIC) {
        return false;
    }
    if (mode == HOBBIT_MODE_COOPERATIVE) {
        return true;
    }
    // auto: under a tight memory cap the pools took the page cache's room (measured: a
    // prefill 6x slower than loading, a decode 1.2x)
    if (!page_cache_holds_two_layers(layer_bytes, room)) {
        return false;
    }
    // weights already in the page cache cost no read at all in place
    if (resident >= 0.9) {
        return true;
    }
    // balanced: a wave's misses are split by balance_misses; asked of one expert alone (a
    // prediction: is it worth a prefetch?), only what the page cache holds runs in place
    if (mode == HOBBIT_MODE_BALANCED) {
        return false;
    }
    // a single token keeps what it loads for the next ones (reuse); a wide ubatch uses each
    // expert for many tokens at once, and in place every expert of the layer runs in one
    // pass instead of waiting for its loads slot by slot, which is worth some bandwidth
    return n_tokens > 1 && map_bytes_per_s >= WIDE_UBATCH_MAP_FACTOR * load_bytes_per_s;
}

miss_cost executor_choice::cost(int n_tokens, int64_t n_bytes, double resident) const {
    miss_cost c;
    c.n_tokens   = n_tokens;
    // an unmeasured bandwidth (the probe failed) makes that side as slow as the other
    const double load_bw = load_bytes_per_s > 0 ? load_bytes_per_s : map_bytes_per_s;
    const double map_bw  = map_bytes_per_s > 0 ? map_bytes_per_s : load_bw;
    c.load_s     = load_bw > 0 ? n_bytes / load_bw : 1.0;
    c.in_place_s = map_bw > 0 ? std::max(0.0, 1.0 - resident) * n_bytes / map_bw : 1.0;
    return c;
}

// an expert the page cache holds: at most this long (seconds) left to read in place
static constexpr double RESIDENT_IN_PLACE_S = 1e-6;

std::vector<bool> balance_misses(const std::vector<miss_cost> & misses) {
    std::vector<bool> in_place(misses.size(), false);
    std::vector<size_t> order;
    for (size_t i = 0; i < misses.size(); ++i) {
        if (misses[i].in_place_s <= RESIDENT_IN_PLACE_S) {
            in_place[i] = true; // nothing to read: in place is free
        } else {
            order.push_back(i);
        }
    }
    // widest batch first; ties keep the given order (the router's)
    std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return misses[a].n_tokens > misses[b].n_tokens; });
    double c_load = 0.0, c_in_place = 0.0;
    size_t l = 0, r = order.size();
    while (l < r) {
        if (c_load <= c_in_place) {
            c_load += misses[order[l++]].load_s;
        } else {
            const size_t i = order[--r];
            c_in_place += misses[i].in_place_s;
            in_place[i] = true;
        }
    }
    return in_place;
}

bool page_cache_holds_two_layers(int64_t layer_bytes, int64_t room) {
    return room < 0 || room >= 2 * layer_bytes;
}

executor_choice executor_choice_make(const expert_index & index, enum hobbit_mode mode, bool available, bool direct_io) {
    executor_choice c;
    c.mode = mode;
    c.available = available;
    if (!available || (mode != HOBBIT_MODE_AUTO && mode != HOBBIT_MODE_BALANCED)) {
        return c; // only auto and balanced decide by the bandwidths
    }
    // the largest projection of expert 0 of the first MoE layer
    const expert_proj_layout * probe = nullptr;
    int probe_layer = -1, probe_proj = -1;
    for (int il = 0; il < (int) index.layers.size() && probe == nullptr; ++il) {
        for (int p = 0; p < LLAMA_MOE_PROJ_COUNT; ++p) {
            const expert_proj_layout & pl = index.layers[il].proj[p];
            if (index.layers[il].has_experts() && pl.present && (probe == nullptr || pl.n_bytes > probe->n_bytes)) {
                probe = &pl;
                probe_layer = il;
                probe_proj = p;
            }
        }
    }
    const int fd = probe == nullptr ? -1 : open(index.parts[probe->part].c_str(), O_RDONLY | O_CLOEXEC);
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

    // both paths with two threads on halves of the same bytes, as they run: two I/O
    // threads reading pieces of a load, two compute threads faulting in the mapped weights
    const auto timed_halves = [](const std::function<void(uint64_t, uint64_t)> & read_range, uint64_t n) {
        const auto t0 = std::chrono::steady_clock::now();
        std::thread other([&] { read_range(n / 2, n); });
        read_range(0, n / 2);
        other.join();
        return seconds_since(t0);
    };

    // a load: pread (O_DIRECT when in use) into a buffer
    try {
        posix_fadvise(fd, begin, span, POSIX_FADV_DONTNEED);
        expert_store store_a(index, direct_io);
        expert_store store_b(index, direct_io);
        std::vector<uint8_t> dst(probe->n_bytes);
        const double s = timed_halves([&](uint64_t b, uint64_t e) {
            (b == 0 ? store_a : store_b).read_piece(probe_layer, 0, probe_proj, b, e, dst.data() + b);
        }, probe->n_bytes);
        c.load_bytes_per_s = s > 0 ? probe->n_bytes / s : 0.0;
    } catch (const std::exception &) {
        c.load_bytes_per_s = 0.0;
    }

    // in place: page faults on a mapping of the same bytes
    posix_fadvise(fd, begin, span, POSIX_FADV_DONTNEED);
    void * map = mmap(nullptr, span, PROT_READ, MAP_SHARED, fd, (off_t) begin);
    if (map != MAP_FAILED) {
        const double s = timed_halves([&](uint64_t b, uint64_t e) {
            volatile uint8_t sink = 0;
            for (uint64_t off = b / page * page; off < e; off += page) {
                sink ^= ((const uint8_t *) map)[off];
            }
            (void) sink;
        }, span);
        c.map_bytes_per_s = s > 0 ? span / s : 0.0;
        munmap(map, span);
    }
    close(fd);
    return c;
}

void map_advise_random(const void * addr, size_t n_bytes) {
    const uintptr_t page = (uintptr_t) sysconf(_SC_PAGESIZE);
    const uintptr_t begin = (uintptr_t) addr / page * page;
    posix_madvise((void *) begin, (uintptr_t) addr + n_bytes - begin, POSIX_MADV_RANDOM);
}

void map_advise_willneed(const void * addr, size_t n_bytes) {
    const uintptr_t page = (uintptr_t) sysconf(_SC_PAGESIZE);
    const uintptr_t begin = (uintptr_t) addr / page * page;
    posix_madvise((void *) begin, (uintptr_t) addr + n_bytes - begin, POSIX_MADV_WILLNEED);
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
