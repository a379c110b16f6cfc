// test-native.cpp - unit tests of the runtime's parts on a GGUF written here.
// Exits non-zero on the first failure; prints one line per test.
#include "hobbit-cache-policy.h"
#include "hobbit-cache-sim.h"
#include "hobbit-error.h"
#include "hobbit-expert-pool.h"
#include "hobbit-executor-choice.h"
#include "hobbit-expert-store.h"
#include "hobbit-io-scheduler.h"
#include "hobbit-mapping-guard.h"
#include "hobbit-neuron-sim-cache.h"
#include "hobbit-neuron-reads.h"
#include "hobbit-neuron-rows.h"
#include "hobbit-pool-plan.h"
#include "hobbit-precision-scorer.h"
#include "hobbit-slot-table.h"
#include "hobbit-predictor.h"
#include "hobbit-substitution.h"

#include "ggml.h"
#include "gguf.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <mutex>
#include <string>
#include <vector>

#define CHECK(cond) do { if (!(cond)) { fprintf(stderr, "FAIL %s:%d: %s\n", __FILE__, __LINE__, #cond); exit(1); } } while (0)

static const int N_LAYER = 3, N_EXPERT = 4, N_USED = 2, N_EMBD = 64, N_FF = 96;

// byte b of expert e, layer il, projection p: distinct everywhere, so a read from the
// wrong offset is caught
static uint8_t pattern(int il, int p, int e, size_t b) {
    return (uint8_t) (il*131 + p*37 + e*17 + b*7 + (b >> 8));
}

// a MoE-shaped GGUF: layer 1 is dense, layers 0 and 2 have F32 experts of n_ff neurons
static std::string write_model(const std::string & path, int n_ff = N_FF) {
    ggml_init_params ip = { 64*ggml_tensor_overhead(), nullptr, true };
    ggml_context * ctx = ggml_init(ip);
    gguf_context * g = gguf_init_empty();
    gguf_set_val_str(g, "general.architecture", "llama");
    gguf_set_val_u32(g, "llama.block_count", N_LAYER);
    gguf_set_val_u32(g, "llama.expert_count", N_EXPERT);
    gguf_set_val_u32(g, "llama.expert_used_count", N_USED);
    std::vector<std::vector<uint8_t>> data;
    data.reserve(16);
    for (int il = 0; il < N_LAYER; il += 2) {
        const char * names[3] = { "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps" };
        for (int p = 0; p < 3; ++p) {
            const int64_t n_in = p == 2 ? n_ff : N_EMBD, n_out = p == 2 ? N_EMBD : n_ff;
            ggml_tensor * t = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, n_in, n_out, N_EXPERT);
            ggml_set_name(t, ("blk." + std::to_string(il) + "." + names[p] + ".weight").c_str());
            data.emplace_back(ggml_nbytes(t));
            const size_t per = ggml_nbytes(t) / N_EXPERT;
            for (int e = 0; e < N_EXPERT; ++e) {
                for (size_t b = 0; b < per; ++b) {
                    data.back()[e*per + b] = pattern(il, p, e, b);
                }
            }
            gguf_add_tensor(g, t);
            gguf_set_tensor_data(g, t->name, data.back().data());
        }
    }
    CHECK(gguf_write_to_file(g, path.c_str(), false));
    gguf_free(g);
    ggml_free(ctx);
    return path;
}

static void check_expert_bytes(const std::vector<std::vector<uint8_t>> & buf, int il, int e) {
    for (int p = 0; p < 3; ++p) {
        for (size_t b = 0; b < buf[p].size(); ++b) {
            CHECK(buf[p][b] == pattern(il, p, e, b));
        }
    }
}

static void test_index(const std::string & path) {
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
static void test_store(const std::string & path, bool direct, bool staged) {
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

// an O_DIRECT piece read moves the whole granules around it from the disk and no more: at the
// file system's granule (statx: 512 bytes on this disk), not at pages, the span a neuron read pays
static void test_direct_granule(const std::string & path) {
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
        const uint64_t before = disk_read_bytes();
        store.read_piece(0, 1, LLAMA_MOE_PROJ_UP, begin, end, got.data());
        const uint64_t moved = disk_read_bytes() - before;
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
        const uint64_t before = disk_read_bytes();
        store.read_piece(0, 1, LLAMA_MOE_PROJ_UP, begin, begin + 2 * g, got);
        CHECK(disk_read_bytes() - before == 2 * g);
        std::vector<uint8_t> want(2 * g);
        FILE * f = fopen(path.c_str(), "rb");
        CHECK(f != nullptr && fseek(f, (long) (base + begin), SEEK_SET) == 0 && fread(want.data(), 1, want.size(), f) == want.size());
        fclose(f);
        CHECK(memcmp(got, want.data(), want.size()) == 0);
        std::free(got);
    }
    printf("ok direct granule (%llu bytes)\n", (unsigned long long) g);
}

static void test_truncated(const std::string & path) {
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

static void test_lru() {
    auto lru = cache_policy_make(cache_policy_kind::lru, 4, 1, 4);
    for (int s = 0; s < 4; ++s) {
        lru->on_insert(s, 0, s);
    }
    lru->on_access(0, true);
    lru->on_access(2, true);
    CHECK(lru->choose_victim({0, 1, 2, 3}) == 1);
    CHECK(lru->choose_victim({0, 2, 3}) == 3);
    CHECK(lru->choose_victim({0, 2}) == 0);
    printf("ok lru\n");
}

static void test_lfu_lhu_fld() {
    // slot s holds expert s of layer s % 2; uses: slot 0 three times (once high), slot 1 twice (both high), slot 2 once
    const int n_layer = 4;
    for (cache_policy_kind k : { cache_policy_kind::lfu, cache_policy_kind::lhu, cache_policy_kind::fld }) {
        auto p = cache_policy_make(k, 3, n_layer, 4);
        for (int s = 0; s < 3; ++s) {
            p->on_insert(s, s % 2, s);
        }
        p->on_access(0, true);  p->on_access(0, false); p->on_access(0, false);
        p->on_access(1, true);  p->on_access(1, true);
        p->on_access(2, true);
        p->on_layer(1); // layer 1 runs now: layer 0 comes again last
        const int victim = p->choose_victim({0, 1, 2});
        if (k == cache_policy_kind::lfu) {
            CHECK(victim == 2);                  // fewest uses
            p->reset();                          // a new sequence: counts cleared, recency decides
            CHECK(p->choose_victim({0, 1, 2}) == 0);
        } else if (k == cache_policy_kind::lhu) {
            CHECK(victim == 0 || victim == 2);   // one high use each; the older of the two
            CHECK(victim == 0);
        } else {
            CHECK(victim == 0);                  // layer 0: farthest ahead, least recent of slots 0 and 2
            p->on_layer(0);
            CHECK(p->choose_victim({0, 1, 2}) == 1); // now layer 1 comes again last
        }
    }
    // random stays within the candidates
    auto r = cache_policy_make(cache_policy_kind::random, 8, 1, 8, {}, 42);
    for (int i = 0; i < 100; ++i) {
        const int v = r->choose_victim({3, 5, 7});
        CHECK(v == 3 || v == 5 || v == 7);
    }
    printf("ok lfu lhu fld random\n");
}

static void test_popularity() {
    // a profile: expert 2 most popular, 0 next, 1 and 3 tied last; slot s holds expert s
    const float profile[4] = { 5.0f, 1.0f, 9.0f, 1.0f };
    CHECK(cache_policy_make(cache_policy_kind::popularity, 4, 1, 4) == nullptr); // no profile, no policy
    auto pop = cache_policy_make(cache_policy_kind::popularity, 4, 1, 4, {}, 0, profile);
    for (int s = 0; s < 4; ++s) {
        pop->on_insert(s, 0, s);
    }
    pop->on_access(1, true);                       // 1 used after 3: 3 is the older of the tied pair
    CHECK(pop->choose_victim({0, 1, 2, 3}) == 3);
    CHECK(pop->choose_victim({0, 1, 2}) == 1);
    CHECK(pop->choose_victim({0, 2}) == 0);        // however recently 0 was used, 2 is more popular
    pop->on_access(0, true);
    CHECK(pop->choose_victim({0, 2}) == 0);
    pop->reset();                                  // the profile is not a sequence's record
    CHECK(pop->choose_victim({0, 2}) == 0);
    printf("ok popularity\n");
}

static void test_score_policy() {
    // two slots hold experts 0 and 1 of one layer of 4; the last two tokens' scores average
    auto sp = cache_policy_make(cache_policy_kind::score, 2, 1, 4, {}, 0, nullptr, 2);
    sp->on_insert(0, 0, 0);
    sp->on_insert(1, 0, 1);
    CHECK(sp->choose_victim({0, 1}) == 0);          // no scores yet: the least recent
    const float a[4] = { 0.6f, 0.1f, 0.2f, 0.1f };
    const float b[4] = { 0.1f, 0.3f, 0.5f, 0.1f };
    sp->on_scores(0, a);
    CHECK(sp->choose_victim({0, 1}) == 1);          // 0.6 vs 0.1
    sp->on_scores(0, b);
    CHECK(sp->choose_victim({0, 1}) == 1);          // averages 0.35 vs 0.2
    sp->on_scores(0, b);                            // the window of 2 forgets a: 0.1 vs 0.3
    CHECK(sp->choose_victim({0, 1}) == 0);
    sp->on_access(0, true);                         // recency does not outweigh the scores
    CHECK(sp->choose_victim({0, 1}) == 0);
    // the split of Algorithm 1: top-score at (1 + alpha) beta and above
    CHECK(top_score(0.65f, 0.5f, 0.3f) && !top_score(0.64f, 0.5f, 0.3f));
    printf("ok score policy\n");
}

static void test_arc() {
    // two slots; a is referenced twice (T2), b once (T1): ARC evicts b though a is older,
    // where LRU would evict a
    auto arc = cache_policy_make(cache_policy_kind::arc, 2, 1, 8);
    const int a = 0, b = 1, c = 2, d = 3;
    arc->on_insert(0, 0, a); arc->on_access(0, true); arc->on_access(0, true);
    arc->on_insert(1, 0, b); arc->on_access(1, true);
    CHECK(arc->choose_victim({0, 1}) == 1);
    arc->on_insert(1, 0, c); arc->on_access(1, true);   // b -> ghost B1
    // b again: its ghost says T1 was too small, so the target of T1 grows (p 0 -> 1) and b
    // enters T2; c goes to B1
    CHECK(arc->choose_victim({0, 1}) == 1);
    arc->on_insert(1, 0, b); arc->on_access(1, true);
    // T1 empty: the least recent of T2 (a) goes, d enters T1
    CHECK(arc->choose_victim({0, 1}) == 0);
    arc->on_insert(0, 0, d); arc->on_access(0, true);   // a -> ghost B2
    // |T1| = 1 is not above p = 1: T2's b is evicted, the new d kept (with p = 0 it would go)
    CHECK(arc->choose_victim({0, 1}) == 1);
    // a's ghost in B2: T2 was too small, p back to 0; now T1's d goes first again
    arc->on_insert(1, 0, a); arc->on_access(1, true);
    CHECK(arc->choose_victim({0, 1}) == 0);
    // a candidate list without the preferred list's slots falls back to the other list
    CHECK(arc->choose_victim({1}) == 1);
    // a prefetch (insert without a use) is referenced once at its first use: still T1
    auto pf = cache_policy_make(cache_policy_kind::arc, 2, 1, 8);
    pf->on_insert(0, 0, a); pf->on_access(0, true); pf->on_access(0, true);  // T2
    pf->on_insert(1, 0, b);                                                  // prefetched
    pf->on_access(1, true);                                                  // first reference
    CHECK(pf->choose_victim({0, 1}) == 1);

    // scan resistance: a hot pair used again and again survives a scan of once-used experts
    // through 4 slots, which LRU does not (one layer, top-1)
    std::vector<int32_t> steps;
    for (int round = 0; round < 3; ++round) {
        for (int i = 0; i < 4; ++i) {
            steps.push_back(i % 2);
        }
        for (int e = 2; e < 14; ++e) {
            steps.push_back(e + 12 * round);  // new experts each scan
        }
    }
    steps.push_back(0);
    steps.push_back(1);
    const cache_sim_trace tr = { (int) steps.size(), 1, 40, 1, steps.data(), nullptr, nullptr };
    const cache_sim_result lru = cache_simulate(tr, 4, false, cache_policy_kind::lru, {}, 0, 1.0);
    const cache_sim_result adaptive = cache_simulate(tr, 4, false, cache_policy_kind::arc, {}, 0, 1.0);
    CHECK(adaptive.hits > lru.hits);
    CHECK(adaptive.hits + adaptive.misses_high == adaptive.accesses);
    printf("ok arc (lru %lld hits, arc %lld of %lld)\n", (long long) lru.hits, (long long) adaptive.hits,
           (long long) adaptive.accesses);
}

static void test_simulator() {
    // one layer, 4 experts, top-1, 2 slots; accesses a b c a b c ...: LRU always misses,
    // Belady keeps one of them and hits every other time after warm-up
    const int n = 12;
    std::vector<int32_t> experts(n);
    for (int t = 0; t < n; ++t) {
        experts[t] = t % 3;
    }
    const cache_sim_trace tr = { n, 1, 4, 1, experts.data(), nullptr, nullptr };
    const cache_sim_result lru = cache_simulate(tr, 2, false, cache_policy_kind::lru, {}, 0, 0.25);
    const cache_sim_result opt = cache_simulate(tr, 2, true, cache_policy_kind::lru, {}, 0, 0.25);
    CHECK(lru.accesses == n && lru.hits == 0 && lru.misses_high == n);
    // Belady on a cyclic pattern of 3 over 2 slots: after 2 cold misses, one miss per 2 accesses
    CHECK(opt.hits == 5 && opt.misses_high == 7);
    CHECK(opt.miss_penalty == 7.0);

    // low-precision misses cost low_miss_cost; the experts of one token's layer are never evicted for each other
    std::vector<uint8_t> high(n, 0);
    const cache_sim_trace low = { n, 1, 4, 1, experts.data(), nullptr, high.data() };
    const cache_sim_result lru_low = cache_simulate(low, 2, false, cache_policy_kind::lru, {}, 0, 0.25);
    CHECK(lru_low.misses_low == n && lru_low.miss_penalty == n * 0.25);

    // top-2 with 2 slots: every token's pair fits, nothing of the current layer is evicted
    std::vector<int32_t> pairs = { 0, 1, 2, 3, 0, 1 };
    const cache_sim_trace tr2 = { 3, 1, 4, 2, pairs.data(), nullptr, nullptr };
    const cache_sim_result r2 = cache_simulate(tr2, 2, false, cache_policy_kind::lru, {}, 0, 1.0);
    CHECK(r2.accesses == 6 && r2.hits == 0);

    // on random traces Belady is never beaten
    uint64_t x = 12345;
    std::vector<int32_t> rnd((size_t) 400 * 3 * 2);
    for (size_t i = 0; i < rnd.size(); i += 2) {
        x = x * 6364136223846793005ULL + 1442695040888963407ULL;
        rnd[i] = (int32_t) ((x >> 33) % 8);
        rnd[i + 1] = (rnd[i] + 1 + (int32_t) ((x >> 40) % 7)) % 8;
    }
    const cache_sim_trace tr3 = { 400, 3, 8, 2, rnd.data(), nullptr, nullptr };
    const int64_t best = cache_simulate(tr3, 9, true, cache_policy_kind::lru, {}, 0, 1.0).misses_high;
    for (cache_policy_kind k : { cache_policy_kind::lru, cache_policy_kind::lfu, cache_policy_kind::lhu,
                                 cache_policy_kind::fld, cache_policy_kind::random, cache_policy_kind::arc }) {
        const cache_sim_result r = cache_simulate(tr3, 9, false, k, {}, 7, 1.0);
        CHECK(r.accesses == 400 * 3 * 2);
        CHECK(r.hits + r.misses_high == r.accesses);
        CHECK(r.misses_high >= best);
    }
    printf("ok simulator\n");
}

static void test_take_slot() {
    // the rule the runtime's pools and the simulator share: the first empty slot, else the
    // policy's victim among the evictable ones, else none
    std::unique_ptr<cache_policy_i> lru = cache_policy_make(cache_policy_kind::lru, 4, 1, 8);
    std::vector<int> scratch;
    std::vector<slot_use> use = { slot_use::busy, slot_use::evictable, slot_use::empty, slot_use::empty };
    const auto take = [&]() { return cache_take_slot(4, [&](int s) { return use[s]; }, *lru, scratch); };
    CHECK(take() == 2);
    lru->on_insert(1, 0, 5);
    lru->on_insert(2, 0, 6);
    lru->on_insert(3, 0, 7);
    use = { slot_use::busy, slot_use::evictable, slot_use::evictable, slot_use::evictable };
    lru->on_access(1, true);
    CHECK(take() == 2); // the least recently used of the evictable slots
    use = { slot_use::busy, slot_use::busy, slot_use::busy, slot_use::busy };
    CHECK(take() == -1);

    // Belady as an ordinary policy (one layer, top-1, a step per token): expert 3 needs a
    // slot at step 2; expert 1 comes again at step 3, expert 2 never: 2 goes
    const std::vector<int32_t> steps = { 1, 2, 3, 1 };
    std::unique_ptr<cache_policy_i> opt = cache_policy_make_belady(steps.data(), 4, 1, 4, 1, 2);
    opt->on_layer(0);
    opt->on_insert(0, 0, 1);
    opt->on_layer(0);
    opt->on_insert(1, 0, 2);
    opt->on_layer(0); // step 2 needs a slot for expert 3
    CHECK(opt->choose_victim({ 0, 1 }) == 1);

    // a prompt's sweep over 4 MoE layers, now at layer 1: slots hold experts of layers 0, 1,
    // 2 and 1 again; layer 1 (just computed) comes again last, so one of its two slots goes,
    // the least recently used of them (slot 3), though slot 0 is older
    std::unique_ptr<cache_policy_i> order = cache_policy_make(cache_policy_kind::lru, 4, 4, 8);
    const int slot_layer[4] = { 0, 1, 2, 1 };
    order->on_insert(0, 0, 0);
    order->on_insert(3, 1, 5);
    order->on_insert(1, 1, 4);
    order->on_insert(2, 2, 0);
    const auto ahead = [&](int s) { return (slot_layer[s] - 1 - 1 + 4) % 4; };
    CHECK(sweep_victim({ 0, 1, 2, 3 }, ahead, *order) == 3);
    CHECK(sweep_victim({ 0, 2 }, ahead, *order) == 0); // layer 0 comes after layer 2
    printf("ok take slot, belady policy, sweep order\n");
}

// whether fn aborts (a failed GGML_ASSERT) in a child process
static bool aborts(const std::function<void()> & fn) {
    fflush(stdout);
    const pid_t pid = fork();
    if (pid == 0) {
        setenv("GGML_NO_BACKTRACE", "1", 1); // (a debugger attached to print it: seconds)
        freopen("/dev/null", "w", stderr);    // the assert's message
        fn();
        _exit(0);
    }
    int status = 0;
    waitpid(pid, &status, 0);
    return WIFSIGNALED(status) && WTERMSIG(status) == SIGABRT;
}

static void test_slot_table() {
    slot_table t(N_LAYER, N_EXPERT, 3);
    CHECK(t.size() == 3 && t.find(2, 1) == -1 && t.n_used() == 0 && t.has_empty());
    t.assign(1, 2, 1);
    CHECK(t.find(2, 1) == 1 && t.n_used() == 1 && t[1].state == slot_state::loading);
    t.loaded(1);
    CHECK(t[1].state == slot_state::ready);
    t.assign(1, 0, 3); // evicts (2, 1)
    CHECK(t.find(2, 1) == -1 && t.find(0, 3) == 1 && t.n_used() == 1);
    // a dropped background read: unread, holding the expert; read again when used
    t.set_prefetched(1, true);
    t.drop_read(1);
    CHECK(t[1].state == slot_state::unread && t.find(0, 3) == 1 && t[1].prefetched);
    t.read_again(1);
    CHECK(t[1].state == slot_state::loading && !t[1].prefetched);
    // a failed load empties the slot and keeps its pins for whoever pinned it
    t.pin(1);
    t.clear(1);
    CHECK(t.find(0, 3) == -1 && t.n_used() == 0 && t[1].state == slot_state::empty && t[1].pins == 1);
    t.unpin(1);
    t.assign(0, 1, 0);
    t.assign(1, 1, 1);
    t.assign(2, 1, 2);
    CHECK(!t.has_empty() && t.n_used() == 3);
    // every transition out of order is refused
    slot_table pinned = t;
    pinned.pin(0);
    CHECK(aborts([&] { pinned.assign(0, 2, 2); }));  // a pinned slot changes owner
    CHECK(aborts([&] { pinned.unpin(1); }));          // unpinned more often than pinned
    CHECK(aborts([&] { pinned.read_again(2); }));     // loading, not unread
    pinned.loaded(2);
    CHECK(aborts([&] { pinned.loaded(2); }));         // ready, not loading
    CHECK(aborts([&] { pinned.drop_read(2); }));      // ready: no read to drop
    CHECK(aborts([&] { pinned.assign(3, 0, 0); }));   // no such slot
    printf("ok slot table\n");
}

static void test_pool(const std::string & path) {
    expert_index idx = expert_index::from_file(path);
    expert_pool pool(idx.layers[0], N_USED, 3);
    CHECK(pool.n_slot() == 3);
    CHECK(pool.weights(LLAMA_MOE_PROJ_UP)->ne[2] == 3);
    CHECK(pool.weights(LLAMA_MOE_PROJ_GATE_UP) == nullptr);
    void * dst[LLAMA_MOE_PROJ_COUNT];
    ggml_tensor * view[LLAMA_MOE_PROJ_COUNT];
    pool.slot_targets(2, dst, view);
    CHECK(!pool.repacked() && view[LLAMA_MOE_PROJ_DOWN] == nullptr); // F32 is never repacked
    CHECK((char *) dst[LLAMA_MOE_PROJ_DOWN] == (char *) pool.weights(LLAMA_MOE_PROJ_DOWN)->data + 2*pool.weights(LLAMA_MOE_PROJ_DOWN)->nb[2]);
    printf("ok pool\n");
}

// on-demand loads overtake queued prefetches, and every load lands its exact bytes
static void test_scheduler(const std::string & path) {
    expert_index idx = expert_index::from_file(path);
    std::mutex mtx;
    std::condition_variable cv;
    std::vector<int> done_order;
    std::vector<std::vector<std::vector<uint8_t>>> bufs(8, std::vector<std::vector<uint8_t>>(3));
    {
        io_scheduler io({ &idx }, /*direct_io*/ false, /*n_threads*/ 1, [&](const load_task & t, const std::string & err, uint64_t, int64_t) {
            CHECK(err.empty());
            std::lock_guard<std::mutex> lock(mtx);
            done_order.push_back(t.slot);
            cv.notify_all();
        });
        std::vector<load_task> tasks;
        for (int i = 0; i < 8; ++i) {
            load_task t = { 0, /*level*/ 0, i, i < 4 ? 0 : 2, i % N_EXPERT, /*prefetch*/ i < 7, {}, {}, {} };
            for (int p = 0; p < 3; ++p) {
                bufs[i][p].resize(idx.layers[t.layer].proj[p].n_bytes);
                t.dst[p] = bufs[i][p].data();
            }
            tasks.push_back(t);
        }
        io.submit(tasks);
        std::unique_lock<std::mutex> lock(mtx);
        cv.wait(lock, [&] { return done_order.size() == 8; });
    }
    // queued together, the on-demand load (slot 7) goes first
    int pos = -1;
    for (size_t i = 0; i < done_order.size(); ++i) {
        if (done_order[i] == 7) pos = (int) i;
    }
    CHECK(pos == 0);
    for (int i = 0; i < 8; ++i) {
        check_expert_bytes(bufs[i], i < 4 ? 0 : 2, i % N_EXPERT);
    }
    printf("ok scheduler (on-demand completed at position %d of 8)\n", pos);
}

// HOBBIT eq. 2 and the thresholds, by hand
static void test_precision_scorer() {
    float scores[4];
    const float w[4] = { 0.1f, 0.5f, -0.3f, 0.1f }; // ranks: 1, 2, then 0 and 3 in router order
    precision_scores(w, 4, scores);
    CHECK(scores[1] == 0.0f);
    CHECK(std::fabs(scores[2] - 0.5f) < 1e-6f);
    CHECK(std::fabs(scores[0] - 0.8f) < 1e-6f);
    CHECK(std::fabs(scores[3] - 0.9f) < 1e-6f);

    int levels[4];
    precision_thresholds one;  // one level: everything high, nothing skipped
    precision_levels(one, w, 4, levels);
    CHECK(levels[0] == 0 && levels[1] == 0 && levels[2] == 0 && levels[3] == 0);

    precision_thresholds two;
    two.n_level = 2; two.t1 = 0.6f; two.t2 = 0.85f;
    precision_levels(two, w, 4, levels);
    CHECK(levels[1] == 0 && levels[2] == 0 && levels[0] == 1 && levels[3] == PRECISION_SKIP);

    precision_thresholds three;
    three.n_level = 3; three.t1 = 0.4f; three.t_mid = 0.6f; three.t2 = 0.95f;
    precision_levels(three, w, 4, levels);
    CHECK(levels[1] == 0 && levels[2] == 1 && levels[0] == 2 && levels[3] == 2);

    // t1 = 0 still keeps the first expert high; t2 = 0 skips every other one
    precision_thresholds strict;
    strict.n_level = 2; strict.t1 = 0.0f; strict.t2 = 0.0f;
    precision_levels(strict, w, 4, levels);
    CHECK(levels[1] == 0 && levels[0] == PRECISION_SKIP && levels[2] == PRECISION_SKIP && levels[3] == PRECISION_SKIP);

    const float zero[2] = { 0.0f, 0.0f };
    precision_levels(two, zero, 2, levels);
    CHECK(levels[0] == 0 && levels[1] == 0);

    // skip_cached: the skip rule acts on one level too (every kept selection at level 0)
    precision_thresholds one_skipping;
    one_skipping.t2 = 0.85f; one_skipping.skip_cached = true;
    precision_levels(one_skipping, w, 4, levels);
    CHECK(levels[1] == 0 && levels[2] == 0 && levels[0] == 0 && levels[3] == PRECISION_SKIP);

    // Fate §4.5: a prompt's least popular experts, fewest tokens first, while their tokens
    // make up at most the share: 10 selections, a fifth is 2: experts 2 and 4 (one token
    // each; ties by id), not expert 3 (3 tokens), never the unselected 0
    const std::vector<int> count = { 0, 5, 1, 3, 1 };
    CHECK((least_popular_experts(count, 0.2f) == std::vector<bool>{ false, false, true, false, true }));
    CHECK((least_popular_experts(count, 0.1f) == std::vector<bool>{ false, false, true, false, false }));
    CHECK((least_popular_experts(count, 0.0f) == std::vector<bool>(5, false)));
    CHECK((least_popular_experts(count, 1.0f) == std::vector<bool>{ false, true, true, true, true }));
    printf("ok precision scorer\n");
}

// a companion must hold the same experts: a file of another shape is refused, naming both
static void test_companion_check(const std::string & path, const std::string & dir) {
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

// the budget split among precision levels, by hand
static void test_level_budgets(const std::string & path) {
    const expert_index idx = expert_index::from_file(path);
    const int64_t expert = (int64_t) idx.info.expert_bytes, total = idx.info.expert_bytes_total;
    const int64_t min = idx.info.min_budget_bytes; // one token's top-k
    const std::vector<const expert_index *> levels = { &idx, &idx };
    const float automatic[HOBBIT_MAX_LEVELS] = { 0.0f, 0.0f, 0.0f };
    // automatic: the low level gets room for every expert, the high one the rest
    std::vector<int64_t> b = pool_plan_level_budgets(levels, 1000000, automatic);
    CHECK(b[1] == total && b[0] == 1000000 - total && b[0] >= min);
    // ... but never more than HOBBIT_AUTO_LOW_SHARE of the budget
    b = pool_plan_level_budgets(levels, 3 * min, automatic);
    CHECK(b[1] <= (int64_t) (HOBBIT_AUTO_LOW_SHARE * 3 * min) + 1 && b[0] >= min && b[0] + b[1] <= 3 * min);
    // explicit shares split what is above the minima
    const float even[HOBBIT_MAX_LEVELS] = { 1.0f, 1.0f, 0.0f };
    b = pool_plan_level_budgets(levels, 2 * min + 10 * expert, even);
    CHECK(b[0] == min + 5 * expert && b[1] == min + 5 * expert);
    // a level that holds all of its experts passes the rest on to the highest precision
    const float low_heavy[HOBBIT_MAX_LEVELS] = { 0.0f, 1.0f, 0.0f };
    b = pool_plan_level_budgets(levels, 2 * total, low_heavy);
    CHECK(b[1] == total && b[0] == total);
    bool refused = false;
    try {
        pool_plan_level_budgets(levels, 2 * min - 1, automatic);
    } catch (const hobbit_error & e) {
        refused = e.status == HOBBIT_STATUS_ERROR_BUDGET && std::string(e.what()).find("each precision") != std::string::npos;
    }
    CHECK(refused);
    // Fate's prompt share: the low level holds two layers' share of a prompt's experts, twice
    // the share of them (skew). At 0.1 of 4 experts that is one a layer, two in all: the
    // minimum; the rest is the high level's
    CHECK(min == 2 * expert);
    b = pool_plan_level_budgets(levels, 9 * expert, automatic, -1, 0.1f);
    CHECK(b[1] == min && b[0] == 7 * expert);
    // at 0.3 (three a layer, six in all) HOBBIT_PROMPT_LOW_MAX_SHARE of the budget binds first
    const int64_t small = 2 * min + 5 * expert;
    b = pool_plan_level_budgets(levels, small, automatic, -1, 0.3f);
    CHECK(b[1] > min && b[1] <= min + (int64_t) (HOBBIT_PROMPT_LOW_MAX_SHARE * small) + 1 && b[1] < 4 * expert);
    // a pool per layer at the high level: its minimum is every layer's top-k, not one token's
    const int64_t per_layer = pool_plan_per_layer_min_bytes(idx);
    b = pool_plan_level_budgets(levels, per_layer + min + 2 * expert, even, per_layer);
    CHECK(b[0] == per_layer + expert && b[1] == min + expert);
    refused = false;
    try {
        pool_plan_level_budgets(levels, per_layer + min - 1, even, per_layer);
    } catch (const hobbit_error & e) {
        refused = e.status == HOBBIT_STATUS_ERROR_BUDGET;
    }
    CHECK(refused);
    printf("ok level budgets\n");
}

// Fate's shallow-favoring allocation: a pool per MoE layer (layers 0 and 2 here, 4 experts, top-2)
static void test_per_layer_plan(const std::string & path) {
    const expert_index idx = expert_index::from_file(path);
    const int64_t e = (int64_t) idx.info.expert_bytes;
    CHECK(pool_plan_per_layer_min_bytes(idx) == 2 * N_USED * e);
    auto slots = [&](int64_t budget, int n_shallow) {
        std::vector<int> n;
        for (const pool_plan_group & g : pool_plan_make_per_layer(idx, budget, n_shallow)) {
            CHECK(g.layers.size() == 1 && g.expert_bytes == e);
            n.push_back(g.n_slot);
        }
        return n;
    };
    // the shallow layer whole first, the deep one what is left
    CHECK(slots(4 * e + 3 * e, 1) == std::vector<int>({ 4, 3 }));
    CHECK(slots(4 * e + 1 * e, 1) == std::vector<int>({ 3, 2 }));
    // no shallow layer: evenly, a slot each in turn
    CHECK(slots(4 * e + 3 * e, 0) == std::vector<int>({ 4, 3 }));
    CHECK(slots(4 * e + 2 * e + e / 2, 0) == std::vector<int>({ 3, 3 }));
    // more shallow layers than there are: in order, each whole if it can be
    CHECK(slots(4 * e + 1 * e, 5) == std::vector<int>({ 3, 2 }));
    CHECK(slots(100 * e, 1) == std::vector<int>({ 4, 4 }));
    bool refused = false;
    try {
        pool_plan_make_per_layer(idx, 4 * e - 1, 1);
    } catch (const hobbit_error & err) {
        refused = err.status == HOBBIT_STATUS_ERROR_BUDGET && std::string(err.what()).find("pool per layer") != std::string::npos;
    }
    CHECK(refused);
    printf("ok per-layer plan\n");
}

// stacked gates: the next layers' routers on this layer's input, nearest first
static void test_stacked_predictor() {
    const int n_embd = 2;
    std::vector<router_weights> routers(3);
    for (int i = 0; i < 3; ++i) {
        routers[i].il = 2 * i; // MoE layers 0, 2, 4
    }
    // x = (1, 0): layer 2 ranks experts 2 > 0 > 1, layer 4 ranks 1 > 2 > 0
    routers[0].w = { 1, 0,  2, 0,  3, 0 };
    routers[1].w = { 0.5f, 0,  -1, 0,  2, 0 };
    routers[2].w = { -1, 0,  3, 0,  1, 0 };
    auto predictor = predictor_make_stacked_gates(routers, n_embd, /*n_predict*/ 2, /*max_depth*/ 2);
    const float x[2] = { 1.0f, 0.0f };
    std::vector<layer_prediction> out;
    predictor->predict(0, x, 2, out);
    CHECK(out.size() == 2 && out[0].il == 2 && out[1].il == 4);
    CHECK(out[0].experts == std::vector<int>({ 2, 0 }) && out[1].experts == std::vector<int>({ 1, 2 }));
    // softmax over the top-k: exp(2) : exp(0.5), summing to 1
    CHECK(std::fabs(out[0].weights[0] + out[0].weights[1] - 1.0f) < 1e-6f);
    CHECK(std::fabs(out[0].weights[0] / out[0].weights[1] - std::exp(1.5f)) < 1e-3f);
    out.clear();
    predictor->predict(0, x, 1, out); // a smaller depth asked for
    CHECK(out.size() == 1 && out[0].il == 2);
    out.clear();
    predictor->predict(2, x, 2, out); // only one layer left after layer 2
    CHECK(out.size() == 1 && out[0].il == 4);
    out.clear();
    predictor->predict(4, x, 2, out); // the last MoE layer predicts nothing
    CHECK(out.empty());
    printf("ok stacked predictor\n");
}

// Fate's popularity-ordered prefill: per expert of the next MoE layer, the tokens whose top-k
// the router is predicted to put it in; a widened prediction still counts each token's k only
static void test_predicted_expert_counts() {
    const int n_embd = 2;
    std::vector<router_weights> routers(2);
    routers[0].il = 0;
    routers[1].il = 1;
    routers[0].w = { 1, 0,  0, 1,  1, 1 };
    // layer 1 scores experts (x0, -x0 + x1, 2 x1): x = (1, 0) ranks 0 > 2 > 1, (0, 1) 2 > 1 > 0
    routers[1].w = { 1, 0,  -1, 1,  0, 2 };
    auto predictor = predictor_make_stacked_gates(routers, n_embd, /*n_predict (widened)*/ 3, /*max_depth*/ 1);
    // three tokens, rows 3 floats apart (a padded layout): (1, 0), (0, 1), (0, 1)
    const float x[9] = { 1, 0, -7,  0, 1, -7,  0, 1, -7 };
    const std::vector<int> top1 = predicted_expert_counts(*predictor, 0, x, 3, 3, /*k*/ 1, 3);
    CHECK(top1 == std::vector<int>({ 1, 0, 2 }));
    const std::vector<int> top2 = predicted_expert_counts(*predictor, 0, x, 3, 3, /*k*/ 2, 3);
    CHECK(top2 == std::vector<int>({ 1, 2, 3 }));
    CHECK(predicted_expert_counts(*predictor, 1, x, 3, 3, 2, 3).empty()); // the last MoE layer: nothing after it
    printf("ok predicted expert counts\n");
}

// importance-driven substitution (Algorithm 1): a low-score selection that misses is replaced
// by the best cached unselected expert within (1 - alpha) of β, the (k+1)-th score
static void test_substitution() {
    // scores of 6 experts; the router picked 0 (0.40) and 1 (0.21); β = 0.20 (expert 2)
    const std::vector<float> scores = { 0.40f, 0.21f, 0.20f, 0.15f, 0.13f, 0.11f };
    const std::vector<int> ids = { 0, 1 };
    const std::vector<float> normalized = { 0.40f / 0.61f, 0.21f / 0.61f };
    auto cached = [](std::initializer_list<int> es) {
        return [es](int e) { return std::find(es.begin(), es.end(), e) != es.end(); };
    };
    // alpha 0.3: top-score from 0.26 (expert 0 kept even though missing), expert 1 low-score;
    // alternatives in [0.14, 0.20]: 2 and 3 when cached, the best (2) taken
    substitution_plan p = plan_substitution(scores, ids, normalized, 0.3f, cached({ 2, 3 }));
    CHECK(p.n_substituted == 1 && p.ids == std::vector<int>({ 0, 2 }));
    CHECK(std::fabs(p.weights[0] - 0.40f / 0.60f) < 1e-6f && std::fabs(p.weights[1] - 0.20f / 0.60f) < 1e-6f);
    // only expert 4 cached: 0.13 is below (1 - 0.3) β = 0.14, nothing to substitute with
    p = plan_substitution(scores, ids, normalized, 0.3f, cached({ 4 }));
    CHECK(p.n_substituted == 0 && p.ids == ids && p.weights == normalized);
    // the low-score selection is cached: kept
    p = plan_substitution(scores, ids, normalized, 0.3f, cached({ 1, 2 }));
    CHECK(p.n_substituted == 0 && p.ids == ids);
    // raw scores as weights (not normalized): the substitute gets its own score, the others stay
    const std::vector<float> raw = { 0.40f, 0.21f };
    p = plan_substitution(scores, ids, raw, 0.3f, cached({ 3 }));
    CHECK(p.n_substituted == 1 && p.ids == std::vector<int>({ 0, 3 }));
    CHECK(p.weights[0] == 0.40f && std::fabs(p.weights[1] - 0.15f) < 1e-6f);
    // alpha 1.5: both are low-score (below 0.50); two misses, one alternative: the lower (1) replaced
    p = plan_substitution(scores, ids, normalized, 1.5f, cached({ 5 }));
    CHECK(p.n_substituted == 1 && p.ids == std::vector<int>({ 0, 5 }));
    // alpha 0: off
    p = plan_substitution(scores, ids, normalized, 0.0f, cached({ 2, 3 }));
    CHECK(p.n_substituted == 0 && p.ids == ids);
    // the simulator replays it against its cache: token 1's low-score pick (expert 1, 0.50 <
    // 1.3 x 0.45) misses, and expert 0 (0.45, cached) serves it instead
    const int32_t experts[2] = { 0, 1 };
    const float trace_scores[8] = { 0.5f, 0.3f, 0.1f, 0.1f,  0.45f, 0.5f, 0.03f, 0.02f };
    cache_sim_trace tr = { 2, 1, 4, 1, experts, nullptr, nullptr, trace_scores };
    const cache_sim_result plain = cache_simulate(tr, 1, false, cache_policy_kind::lru, {}, 0, 1.0);
    const cache_sim_result subst = cache_simulate(tr, 1, false, cache_policy_kind::lru, {}, 0, 1.0, 0.3f);
    CHECK(plain.misses_high == 2 && plain.hits == 0 && plain.substituted == 0);
    CHECK(subst.misses_high == 1 && subst.hits == 1 && subst.substituted == 1);
    // a batch of two tokens, nothing cached: token 0 picks 0 and 1; token 1 picks 0 and 3, whose
    // 3 is low-score (0.20 < 1.3 x 0.19) and in band of expert 1 (0.19), which token 0 reads
    // anyway: served by 1. Alone, token 1 keeps 3 (nothing cached to take instead)
    const std::vector<std::vector<float>> batch_scores = { { 0.40f, 0.30f, 0.10f, 0.10f, 0.05f, 0.05f },
                                                           { 0.40f, 0.19f, 0.05f, 0.20f, 0.08f, 0.08f } };
    const std::vector<std::vector<int>> batch_ids = { { 0, 1 }, { 0, 3 } };
    const std::vector<std::vector<float>> batch_weights = { { 0.4f / 0.7f, 0.3f / 0.7f }, { 0.4f / 0.6f, 0.2f / 0.6f } };
    const std::vector<substitution_plan> bp = plan_batch_substitution(batch_scores, batch_ids, batch_weights, 0.3f, cached({}));
    CHECK(bp.size() == 2 && bp[0].n_substituted == 0 && bp[1].n_substituted == 1);
    CHECK(bp[1].ids == std::vector<int>({ 0, 1 }) && std::fabs(bp[1].weights[1] - 0.19f / 0.59f) < 1e-6f);
    CHECK(plan_substitution(batch_scores[1], batch_ids[1], batch_weights[1], 0.3f, cached({})).n_substituted == 0);
    // a token's own low-score selection that another token reads anyway is kept (expert 1 here)
    const std::vector<std::vector<int>> both_one = { { 0, 1 }, { 0, 1 } };
    const std::vector<std::vector<float>> both_scores = { batch_scores[0], { 0.40f, 0.20f, 0.05f, 0.19f, 0.08f, 0.08f } };
    const std::vector<substitution_plan> kept = plan_batch_substitution(both_scores, both_one, batch_weights, 0.3f, cached({}));
    CHECK(kept[1].n_substituted == 0 && kept[1].ids == std::vector<int>({ 0, 1 }));
    printf("ok substitution\n");
}

static void test_balance_misses() {
    const auto miss = [](int n_tokens, double load_s, double in_place_s) {
        miss_cost c;
        c.n_tokens = n_tokens;
        c.load_s = load_s;
        c.in_place_s = in_place_s;
        return c;
    };
    // Algorithm 2's walk: batches 9, 5, 3, 2, 1 (given out of order), every load 1 s, in place 1.5 s
    // (a cold read through the mapping, slower than a load): load 9 (C_load 1 > 0), in place 1
    // (1.5), load 5 (2 > 1.5), in place 2 (3), load 3 (3 <= 3 goes to the load side)
    std::vector<bool> s = balance_misses({ miss(3, 1, 1.5), miss(9, 1, 1.5), miss(1, 1, 1.5), miss(5, 1, 1.5),
                                           miss(2, 1, 1.5) });
    CHECK(s == std::vector<bool>({ false, false, true, false, true }));
    // an expert the page cache holds costs nothing in place and runs there; the rest as before
    s = balance_misses({ miss(1, 1, 0.0), miss(4, 1, 1), miss(1, 1, 1) });
    CHECK(s == std::vector<bool>({ true, false, true }));
    // a decode token's two misses: one each way; one miss alone: loaded (it is worth its slot)
    CHECK(balance_misses({ miss(1, 1, 1), miss(1, 1, 1) }) == std::vector<bool>({ false, true }));
    CHECK(balance_misses({ miss(1, 1, 1) }) == std::vector<bool>({ false }));
    CHECK(balance_misses({}).empty());
    // the latency model's costs: a load at its bandwidth, in place only what is not resident
    executor_choice c;
    c.load_bytes_per_s = 1e9;
    c.map_bytes_per_s  = 5e8;
    const miss_cost m = c.cost(3, 1000000000, 0.75);
    CHECK(m.n_tokens == 3 && std::fabs(m.load_s - 1.0) < 1e-9 && std::fabs(m.in_place_s - 0.5) < 1e-9);
    printf("ok balance_misses\n");
}

static neuron_bits bits(int n, std::initializer_list<int> set) {
    neuron_bits b(n);
    for (int i : set) {
        b.set(i);
    }
    return b;
}

static void test_neuron_sim_cache() {
    const int n = 10;  // neurons; one neuron of one projection is 4 bytes, a whole expert 120
    CHECK(neuron_bits(n, true).count() == 10 && neuron_bits(70, true).count() == 70);
    CHECK(bits(n, { 0, 1, 2, 5, 7, 8 }).runs() == 3);
    neuron_sim_cache c(2, 4, n, 4, 100, 0.75);
    c.begin_step();
    // a cold selection of 3 neurons reads them: 3 rows of W1 + 3 of W3 + 3 columns of W2
    neuron_sim_plan p = c.plan_access(0, 1, { bits(n, { 1, 2, 3 }), bits(n, { 1, 2, 3 }) });
    CHECK(!p.hit && !p.whole && p.read_bytes == 36 && p.n_requests == 3 && p.evict.empty());
    c.apply(p);
    CHECK(c.used_bytes() == 36);
    // the same expert needs 2..5: only 4 and 5 are missing (the union is kept)
    c.begin_step();
    p = c.plan_access(0, 1, { bits(n, { 2, 3, 4, 5 }), bits(n, { 2, 3, 4, 5 }) });
    CHECK(p.hit && p.read_bytes == 24 && p.read_rest.count() == 2);
    c.apply(p);
    CHECK(c.used_bytes() == 60);
    // W1 whole, W3/W2 for two neurons (W1-first): 10 + 2 x 2 neurons
    p = c.plan_access(1, 0, { neuron_bits(n, true), bits(n, { 0, 9 }) });
    CHECK(p.read_bytes == 56 && p.n_requests == 1 + 2 * 2);
    // over the limit (8 of 10 > 0.75): the whole expert, and room made by evicting the least
    // recent expert the step has not pinned; expert (0, 1) was pinned by this step
    const neuron_need most = { bits(n, { 0, 1, 2, 3, 4, 5, 6, 7 }), bits(n, { 0, 1, 2, 3, 4, 5, 6, 7 }) };
    p = c.plan_access(1, 2, most);
    CHECK(p.whole && p.read_bytes == 120 && p.evict.empty());  // nothing may go: it runs over the budget
    c.begin_step();
    p = c.plan_access(1, 2, most);
    CHECK(p.whole && p.evict == std::vector<int64_t>({ 0 * 4 + 1 }));
    c.apply(p);
    CHECK(c.used_bytes() == 120 && c.n_cached() == 1);
    // expert-granular: a limit of 0 reads every selection whole
    neuron_sim_cache whole(1, 4, n, 4, 1000, 0.0);
    whole.begin_step();
    CHECK(whole.plan_access(0, 0, { bits(n, { 1 }), bits(n, { 1 }) }).read_bytes == 120);
    // the replay: one layer, one expert, two tokens needing neurons {0,1} then {1,2}
    const int32_t experts[2] = { 3, 3 };
    const uint8_t need[4] = { 0x03, 0x00, 0x06, 0x00 };  // two bytes a selection for 10 neurons
    const neuron_sim_trace tr = { 2, 1, 4, 1, n, experts, need, need };
    const neuron_sim_result r = neuron_sim_cache_simulate(tr, 4, 1000, 0.75);
    CHECK(r.accesses == 2 && r.bytes_read == (2 + 1) * 12 && r.hits == 0 && r.whole == 0 && r.requests == 6);
    const neuron_sim_result lru = neuron_sim_cache_simulate(tr, 4, 1000, 0.0);
    CHECK(lru.bytes_read == 120 && lru.hits == 1 && lru.whole == 2);
    printf("ok neuron cache\n");
}

// CORM's neuron reads: the keep rule, the neuron row cache, the sparse up and down products
// over Q8_0 rows in pages, and ranged loads through the scheduler
static void test_neuron_reads(const std::string & path) {
    // SiLU of these: -0.072, -0.048, 0, 0.026, 0.172, 0.731, 2.858, -0.189
    const float g[8] = { -4.0f, -0.1f, 0.0f, 0.05f, 0.3f, 1.0f, 3.0f, -0.5f };
    neuron_bits keep;
    CHECK(!neuron_keep(g, 8, 0.18f, 1.0f, keep) && keep.count() == 3 && keep.test(5) && keep.test(6) && keep.test(7));
    CHECK(neuron_keep(g, 8, 0.0f, 0.75f, keep) && keep.count() == 8); // every neuron passes: over the limit, whole

    // the row cache: rows read land in the lowest free pages, a run of neurons in a run of pages;
    // a hit reads only what it lacks; room comes from the least recently used owner outside the pass
    {
        neuron_row_cache rows(10, 100, 12, /*bridge*/ 1);
        neuron_rows_plan plan;
        std::vector<neuron_row_run> runs;
        CHECK(rows.plan_rows({ { 7, bits(10, { 0, 1, 2, 5 }) } }, plan) && plan.evict.empty());
        rows.apply_rows(plan, runs);
        CHECK(runs.size() == 2 && runs[0].first == 0 && runs[0].count == 3 && runs[0].first_page == 0 &&
              runs[1].first == 5 && runs[1].count == 1 && runs[1].first_page == 3);
        CHECK(rows.pages(7)[5] == 3 && rows.pages(7)[3] == -1 && rows.n_free() == 8 && rows.pages(8) == nullptr);
        CHECK(rows.plan_rows({ { 8, bits(10, { 0, 1, 2, 3, 4, 5 }) } }, plan) && plan.evict.empty());
        runs.clear();
        rows.apply_rows(plan, runs);
        CHECK(rows.n_free() == 2);
        // owner 7 again: only neuron 6 is read
        CHECK(rows.plan_rows({ { 7, bits(10, { 1, 5, 6 }) } }, plan) && plan.evict.empty() && plan.reads.size() == 1 &&
              plan.reads[0].second.count() == 1 && plan.reads[0].second.test(6));
        runs.clear();
        rows.apply_rows(plan, runs);
        // a third owner needing 5 rows: 8 (used before 7) goes, 7 stays
        CHECK(rows.plan_rows({ { 9, bits(10, { 0, 1, 2, 3, 4 }) } }, plan) && plan.evict == std::vector<int64_t>{ 8 });
        runs.clear();
        rows.apply_rows(plan, runs);
        CHECK(rows.pages(8) == nullptr && rows.pages(7) != nullptr && rows.n_free() == 12 - 5 - 5);
        CHECK(runs.size() == 1 && runs[0].first_page == 4 && runs[0].count == 5); // the pages 8 left
        // a one-row gap between two needed rows is read too (one request), unless it is held
        neuron_bits gap = bits(10, { 2, 4, 7, 9 });
        rows.bridge_gaps(gap, nullptr);
        CHECK(gap.count() == 6 && gap.test(3) && gap.test(8) && !gap.test(5) && !gap.test(6));
        const std::vector<int32_t> held = { -1, -1, -1, -1, -1, -1, -1, -1, 3, -1 };
        gap = bits(10, { 2, 4, 7, 9 });
        rows.bridge_gaps(gap, held.data());
        CHECK(gap.count() == 5 && gap.test(3) && !gap.test(8));
        // an expert that keeps no neuron reads nothing and holds nothing, now or after
        CHECK(rows.plan_rows({ { 5, neuron_bits(10) } }, plan) && plan.reads.empty());
        runs.clear();
        rows.apply_rows(plan, runs);
        CHECK(runs.empty() && rows.pages(5) == nullptr);
        CHECK(rows.plan_rows({ { 5, bits(10, { 4 }) } }, plan) && plan.reads.size() == 1);
        // a pass needing more than the pages: refused, nothing changed
        CHECK(!rows.plan_rows({ { 7, neuron_bits(10, true) }, { 9, neuron_bits(10, true) } }, plan));
        CHECK(rows.n_free() == 2);

        int n_gate = 0;
        int64_t n_page = 0;
        // 10 experts of a 300-byte gate and 2 x 3 rows of 100: the rows of 2 whole, the gates the rest
        CHECK(neuron_rows_split(10 * 900, 300, 3, 100, 2, 1000, n_gate, n_page) && n_gate == 26 && n_page == 6);
        // every gate held (n_max): the pages take the rest, up to n_max experts' rows
        CHECK(neuron_rows_split(10 * 900, 300, 3, 100, 2, 20, n_gate, n_page) && n_gate == 20 && n_page == 15);
        CHECK(neuron_rows_split(100 * 900, 300, 3, 100, 2, 20, n_gate, n_page) && n_gate == 20 && n_page == 60);
        CHECK(!neuron_rows_split(2 * 900 - 1, 300, 3, 100, 2, 1000, n_gate, n_page));
        CHECK(neuron_rows_split(2 * 900, 300, 3, 100, 2, 1000, n_gate, n_page) && n_gate == 2 && n_page == 6);
    }

    // the sparse down equals the sum of the kept rows, dequantized, times their activations
    const int n_embd = 64, n_ff = 5;
    std::vector<float> w((size_t) n_ff * n_embd);
    for (size_t i = 0; i < w.size(); ++i) {
        w[i] = std::sin(0.37f * (float) i) * (1.0f + (float) (i % 7));
    }
    const size_t row = ggml_row_size(GGML_TYPE_Q8_0, n_embd);
    std::vector<uint8_t> q(n_ff * row);
    ggml_quantize_chunk(GGML_TYPE_Q8_0, w.data(), q.data(), 0, n_ff, n_embd, nullptr);
    std::vector<float> deq(w.size());
    ggml_get_type_traits(GGML_TYPE_Q8_0)->to_float(q.data(), deq.data(), (int64_t) deq.size());
    const float act[n_ff] = { 0.5f, 0.0f, -2.0f, 0.0f, 1.25f };
    // the rows in pages (of two rows: these in the second) out of order; neuron 3 never read
    const int32_t pages[n_ff] = { 2, 0, 4, -1, 1 };
    const size_t page = 2 * row;
    std::vector<uint8_t> arena(n_ff * page, 0xff);
    uint8_t * base = arena.data() + row;
    for (int f = 0; f < n_ff; ++f) {
        if (pages[f] >= 0) {
            memcpy(base + pages[f] * page, q.data() + f * row, row);
        }
    }
    std::vector<float> out(n_embd, 99.0f);
    neuron_down_q8_0(base, page, pages, n_ff, act, out.data(), 0, 1); // two threads' shares of the blocks
    neuron_down_q8_0(base, page, pages, n_ff, act, out.data(), 1, 2);
    for (int j = 0; j < n_embd; ++j) {
        float ref = 0.0f;
        for (int f = 0; f < n_ff; ++f) {
            ref += act[f] * deq[(size_t) f * n_embd + j];
        }
        CHECK(std::fabs(out[j] - ref) <= 1e-5f * (1.0f + std::fabs(ref)));
    }
    // a neuron left out is never touched: its row may be anything (here NaN scales)
    memset(base + pages[1] * page, 0xff, row);
    std::vector<float> again(n_embd);
    neuron_down_q8_0(base, page, pages, n_ff, act, again.data(), 0, 2);
    CHECK(memcmp(again.data(), out.data(), n_embd * sizeof(float)) == 0);
    // the sparse up: each kept neuron's dequantized row times x, 0 for the others (neuron 1's row is NaN)
    std::vector<float> x(n_embd);
    for (int j = 0; j < n_embd; ++j) {
        x[j] = std::cos(0.11f * (float) j);
    }
    const float kept[n_ff] = { 1.0f, 0.0f, 1.0f, 0.0f, 1.0f };
    float up[n_ff];
    neuron_up_q8_0(base, page, pages, n_embd, x.data(), kept, up, 0, 2);
    neuron_up_q8_0(base, page, pages, n_embd, x.data(), kept, up, 2, n_ff);
    for (int f = 0; f < n_ff; ++f) {
        float ref = 0.0f;
        for (int j = 0; j < n_embd && kept[f] != 0.0f; ++j) {
            ref += deq[(size_t) f * n_embd + j] * x[j];
        }
        CHECK(std::fabs(up[f] - ref) <= 1e-4f * (1.0f + std::fabs(ref)));
    }

    // a load of ranges writes their bytes alone and reports their sum, read by the expert
    // readers or by row readers (a range longer than a row reader's buffer cut into several
    // reads: the model of 1024 neurons has 256 KB of up per expert)
    const std::string wide = write_model(path + ".wide", /*n_ff*/ 1024);
    for (const std::string & file : { path, wide }) {
        const expert_index idx = expert_index::from_file(file);
        const uint64_t n_up = idx.layers[0].proj[LLAMA_MOE_PROJ_UP].n_bytes;
        for (int n_row_readers : { 0, 3 }) {
            std::vector<uint8_t> buf(n_up, 0xab);
            const uint64_t a = 256, b = 520, c = n_up - 300; // [0, a) and [b, c)
            std::mutex mtx;
            std::condition_variable cv;
            uint64_t reported = 0;
            bool done = false;
            {
                io_scheduler io({ &idx }, /*direct_io*/ true, /*n_threads*/ 2,
                    [&](const load_task &, const std::string & err, uint64_t n, int64_t) {
                        CHECK(err.empty());
                        std::lock_guard<std::mutex> lock(mtx);
                        reported = n;
                        done = true;
                        cv.notify_all();
                    }, nullptr, n_row_readers);
                load_task t = { 0, 0, 0, /*layer*/ 0, /*expert*/ 1, /*prefetch*/ false, {}, {}, {} };
                t.ranges = { { LLAMA_MOE_PROJ_UP, 0, a, buf.data() }, { LLAMA_MOE_PROJ_UP, b, c, buf.data() + b } };
                io.submit({ t });
                std::unique_lock<std::mutex> lock(mtx);
                cv.wait(lock, [&] { return done; });
            }
            CHECK(reported == a + (c - b));
            CHECK(file == path || c - b > 2 * HOBBIT_ROW_READ_BYTES);
            for (uint64_t i = 0; i < n_up; ++i) {
                const bool in = i < a || (i >= b && i < c);
                CHECK(buf[i] == (in ? pattern(0, LLAMA_MOE_PROJ_UP, 1, i) : 0xab));
            }
        }
    }
    unlink(wide.c_str());
    printf("ok neuron reads\n");
}

// a file mapped, then cut: a read past its new end inside a guard reads zeros and marks the
// guard, where it would have been a SIGBUS
static void test_mapping_guard(const std::string & dir) {
    const std::string path = dir + "/hobbit-guard-test-" + std::to_string(getpid());
    const long page = sysconf(_SC_PAGESIZE);
    const int fd = open(path.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
    CHECK(fd >= 0);
    std::vector<char> ones(3 * page, 1);
    CHECK(write(fd, ones.data(), ones.size()) == (ssize_t) ones.size());
    auto * map = (volatile const char *) mmap(nullptr, 3 * page, PROT_READ, MAP_SHARED, fd, 0);
    CHECK(map != MAP_FAILED);
    {
        mapping_guard guard((const void *) map, 3 * page);
        CHECK(map[2 * page] == 1 && !guard.faulted());
        CHECK(ftruncate(fd, page) == 0);
        CHECK(map[0] == 1 && !guard.faulted());  // still in the file
        CHECK(map[2 * page + 5] == 0);           // past the end: zeros, no signal
        CHECK(guard.faulted());
        // the file whole again: restore maps it back over the zero page
        CHECK(pwrite(fd, ones.data(), ones.size(), 0) == (ssize_t) ones.size());
        CHECK(guard.restore(fd, 0, MADV_RANDOM) && !guard.faulted());
        CHECK(map[2 * page + 5] == 1 && map[0] == 1 && !guard.faulted());
        // and again, on another page: each restore maps back the pages of its own faults
        CHECK(ftruncate(fd, 0) == 0);
        CHECK(map[page] == 0 && guard.faulted());
        CHECK(pwrite(fd, ones.data(), ones.size(), 0) == (ssize_t) ones.size());
        CHECK(guard.restore(fd, 0, MADV_RANDOM) && !guard.faulted());
        CHECK(map[page] == 1 && map[2 * page] == 1 && !guard.faulted());
    }
    munmap((void *) map, 3 * page);
    close(fd);
    unlink(path.c_str());
    printf("mapping guard: ok\n");
}

int main(int argc, char ** argv) {
    const std::string dir = argc > 1 ? argv[1] : "/tmp";
    const std::string path = write_model(dir + "/hobbit-native-test-" + std::to_string(getpid()) + ".gguf");
    test_index(path);
    for (bool staged : {false, true}) {
        test_store(path, false, staged);
        test_store(path, true, staged);
    }
    test_direct_granule(path);
    test_truncated(path);
    test_lru();
    test_lfu_lhu_fld();
    test_arc();
    test_popularity();
    test_score_policy();
    test_simulator();
    test_take_slot();
    test_slot_table();
    test_pool(path);
    test_scheduler(path);
    test_precision_scorer();
    test_companion_check(path, dir);
    test_level_budgets(path);
    test_per_layer_plan(path);
    test_stacked_predictor();
    test_predicted_expert_counts();
    test_substitution();
    test_balance_misses();
    test_neuron_sim_cache();
    test_neuron_reads(path);
    test_mapping_guard(dir);
    unlink(path.c_str());
    printf("all native tests passed\n");
    return 0;
}
