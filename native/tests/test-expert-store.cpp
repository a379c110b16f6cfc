// test-expert-store.cpp - native unit tests: the GGUF index of every expert slice and the reads (pread, O_DIRECT, staged), a cut file, a companion's check.
#include "test-common.h"

#include "hobbit-expert-store.h"
#include "hobbit-error.h"
#include "hobbit-expert-pool.h"

#include <algorithm>
#include <cstdint>
#include <functional>

void test_index(const std::string & path) {
    expert_index idx = expert_index::from_file(path);
    CHECK(idx.info.n_layer == N_LAYER);
    CHECK(idx.info.n_layer_moe == 2);
    CHECK(idx.info.n_expert == N_EXPERT);
    CHECK(idx.info.uniform);
    CHECK(!idx.layers[1].has_experts());
    const int64_t expert_bytes = 3 * (int64_t) N_EMBD * N_FF * 4;
    CHECK(idx.info.expert_bytes == expert_bytes);
    CHECK(idx.info.min_budget_bytes == N_USED * expert_bytes);
    CHECK(idx.info.expert_bytes_total == 2 * N_EXPERT * expert_bytes);
    printf("ok index\n");
}

// staged: read_slice's buffers from a buffer type, as for pools in a GPU's memory (there the
// device's page-locked host memory; here the CPU's, the same code path)
void test_store(const std::string & path, bool direct, bool staged) {
    expert_index idx = expert_index::from_file(path);
    expert_store store(idx, direct, staged ? ggml_backend_dev_buffer_type(expert_pool_device()) : nullptr);
    for (int il : {0, 2}) {
        for (int e = 0; e < N_EXPERT; ++e) {
            std::vector<std::vector<uint8_t>> buf(3), slice(3);
            void * dst[LLAMA_MOE_PROJ_COUNT] = {};
            for (int p = 0; p < 3; ++p) {
                buf[p].resize(idx.layers[il].proj[p].n_bytes);
                dst[p] = buf[p].data();
            }
            store.read_expert(il, e, dst);
            check_expert_bytes(buf, il, e);
            for (int p = 0; p < 3; ++p) {
                const uint8_t * src = (const uint8_t *) store.read_slice(il, e, p);
                slice[p].assign(src, src + idx.layers[il].proj[p].n_bytes);
            }
            check_expert_bytes(slice, il, e);
        }
    }
    printf("ok store (direct_io requested=%d, in use=%d, staged=%d)\n", direct, store.direct_io(), staged);
}

// what this process has read from block devices so far (/proc/self/io: every thread's bios)
static uint64_t disk_read_bytes() {
    FILE * f = fopen("/proc/self/io", "r");
    unsigned long long n = 0;
    char line[128];
    while (f != nullptr && fgets(line, sizeof line, f) != nullptr) {
        if (sscanf(line, "read_bytes: %llu", &n) == 1) {
            break;
        }
    }
    if (f != nullptr) {
        fclose(f);
    }
    return n;
}

// the fewest bytes a read moved from the disk in three tries: /proc/self/io counts every read of the
// process, and under qemu-user the emulator's own page-ins land in the same window (seen once in a CI
// run); an O_DIRECT read moves its bytes every time, so noise only adds and the least is the read's
static uint64_t least_disk_bytes_moved(const std::function<void()> & read) {
    uint64_t least = UINT64_MAX;
    for (int i = 0; i < 3; ++i) {
        const uint64_t before = disk_read_bytes();
        read();
        least = std::min(least, disk_read_bytes() - before);
    }
    return least;
}

// an O_DIRECT piece read moves the whole granules around it from the disk and no more: at the
// file system's granule (statx: 512 bytes on this disk), not at pages, the span a neuron read pays
void test_direct_granule(const std::string & path) {
    expert_index idx = expert_index::from_file(path);
    expert_store store(idx, /*direct_io*/ true);
    if (!store.direct_io()) {
        printf("ok direct granule (no O_DIRECT on this file system: nothing to check)\n");
        return;
    }
    const uint64_t g = store.direct_io_granule();
    CHECK(g >= 512 && g <= 4096 && (g & (g - 1)) == 0);
#if defined(__GLIBC__) && defined(STATX_DIOALIGN)
#if __GLIBC_PREREQ(2, 28)
    struct statx st;
    if (statx(AT_FDCWD, path.c_str(), 0, STATX_DIOALIGN, &st) == 0 && (st.stx_mask & STATX_DIOALIGN) != 0) {
        // the file system's granule when it names one a page holds (qemu-user passes none: 0), not a page
        const uint64_t fs = st.stx_dio_offset_align, mem = st.stx_dio_mem_align;
        const bool named = fs > 0 && (fs & (fs - 1)) == 0 && fs <= 4096 && mem > 0 && (mem & (mem - 1)) == 0 && mem <= 4096;
        CHECK(g == (named ? fs : 4096));
    }
#endif
#endif
    const expert_proj_layout & pl = idx.layers[0].proj[LLAMA_MOE_PROJ_UP];
    const uint64_t base = pl.offset + pl.n_bytes; // expert 1's slice
    const uint64_t pieces[][2] = { { 0, 1 }, { 100, 1000 }, { 513, 1700 }, { 4000, 4200 } };
    for (const auto & piece : pieces) {
        const uint64_t begin = piece[0], end = std::min<uint64_t>(piece[1], pl.n_bytes);
        if (begin >= end) {
            continue;
        }
        std::vector<uint8_t> got(end - begin), want(end - begin);
        const uint64_t moved = least_disk_bytes_moved([&] { store.read_piece(0, 1, LLAMA_MOE_PROJ_UP, begin, end, got.data()); });
        const uint64_t span  = ((base + end + g - 1) / g - (base + begin) / g) * g;
        CHECK(moved == span);
        FILE * f = fopen(path.c_str(), "rb");
        CHECK(f != nullptr && fseek(f, (long) (base + begin), SEEK_SET) == 0 && fread(want.data(), 1, want.size(), f) == want.size());
        fclose(f);
        CHECK(got == want);
    }
    // whole granules into page-aligned memory (a neuron layout's run into the row cache's pages):
    // the read goes straight there, and still moves just those granules
    const uint64_t begin = (g - base % g) % g;
    if (begin + 2 * g <= pl.n_bytes) {
        uint8_t * got = (uint8_t *) std::aligned_alloc(4096, (2 * g + 4095) / 4096 * 4096); // a multiple of the alignment, as C asks
        CHECK(got != nullptr);
        CHECK(least_disk_bytes_moved([&] { store.read_piece(0, 1, LLAMA_MOE_PROJ_UP, begin, begin + 2 * g, got); }) == 2 * g);
        std::vector<uint8_t> want(2 * g);
        FILE * f = fopen(path.c_str(), "rb");
        CHECK(f != nullptr && fseek(f, (long) (base + begin), SEEK_SET) == 0 && fread(want.data(), 1, want.size(), f) == want.size());
        fclose(f);
        CHECK(memcmp(got, want.data(), want.size()) == 0);
        std::free(got);
    }
    printf("ok direct granule (%llu bytes)\n", (unsigned long long) g);
}

void test_truncated(const std::string & path) {
    const std::string cut = path + ".cut";
    CHECK(system(("head -c 20000 '" + path + "' > '" + cut + "'").c_str()) == 0);
    bool threw = false;
    try {
        expert_index::from_file(cut);
    } catch (const hobbit_error & e) {
        threw = true;
        CHECK(e.status == HOBBIT_STATUS_ERROR_FORMAT);
        CHECK(std::string(e.what()).find("truncated") != std::string::npos);
        CHECK(std::string(e.what()).find(cut) != std::string::npos);
    }
    CHECK(threw);
    unlink(cut.c_str());
    printf("ok truncated\n");
}

// a companion must hold the same experts: a file of another shape is refused, naming both
void test_companion_check(const std::string & path, const std::string & dir) {
    const expert_index idx = expert_index::from_file(path);
    idx.check_companion(idx); // a file is its own companion
    const std::string other = write_model(dir + "/hobbit-native-test-other-" + std::to_string(getpid()) + ".gguf", /*n_ff*/ 24);
    bool refused = false;
    try {
        idx.check_companion(expert_index::from_file(other));
    } catch (const hobbit_error & e) {
        const std::string msg = e.what();
        refused = msg.find(path) != std::string::npos && msg.find(other) != std::string::npos && msg.find("shape") != std::string::npos;
    }
    unlink(other.c_str());
    CHECK(refused);
    printf("ok companion check\n");
}
