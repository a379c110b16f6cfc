// test-cache-sim.cpp - native unit tests: the cache simulator over a synthetic trace.
#include "test-common.h"

#include "hobbit-cache-sim.h"
#include "hobbit-cache-policy.h"

void test_simulator() {
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
