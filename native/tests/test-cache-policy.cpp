// test-cache-policy.cpp - native unit tests: each eviction policy, and the slot-taking rule the runtime and the simulator share.
#include "test-common.h"

#include "hobbit-cache-policy.h"
#include "hobbit-cache-sim.h"
#include "hobbit-slot-table.h"
#include "hobbit-substitution.h"

void test_lru() {
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

void test_lfu_lhu_fld() {
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

void test_arc() {
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

void test_popularity() {
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

void test_frequency() {
    // one layer of 4 experts, top-1; the profile's prior (8 tokens' worth): 2 -> 4.8, 0 -> 3.2, 1 and 3 -> 0
    const float profile[4] = { 2.0f, 0.0f, 3.0f, 0.0f };
    auto fq = cache_policy_make(cache_policy_kind::frequency, 4, 1, 4, {}, 0, profile, HOBBIT_SCORE_HISTORY, 1);
    for (int s = 0; s < 4; ++s) {
        fq->on_insert(s, 0, s);
    }
    CHECK(fq->choose_victim({0, 1, 2, 3}) == 1);   // no uses: the prior, ties to the least recent (1 before 3)
    for (int i = 0; i < 4; ++i) {
        fq->on_access(1, true);                    // 4 uses: 1 outranks 0 (3.2) and 3 (0)
    }
    CHECK(fq->choose_victim({0, 1, 2, 3}) == 3);
    CHECK(fq->choose_victim({0, 1, 2}) == 0);
    for (int i = 0; i < 4; ++i) {
        fq->on_access(3, true);                    // 3 ties 1 (4 + 0): 1 is the older
    }
    CHECK(fq->choose_victim({1, 3}) == 1);
    fq->reset();                                   // a new sequence: the run's counts stay
    CHECK(fq->choose_victim({0, 3}) == 0);
    // without a profile: LFU, aged: 32 uses per expert of the table (128) halve every count
    auto plain = cache_policy_make(cache_policy_kind::frequency, 2, 1, 4);
    plain->on_insert(0, 0, 0);
    plain->on_insert(1, 0, 1);
    for (int i = 0; i < 100; ++i) {
        plain->on_access(0, true);
    }
    for (int i = 0; i < 28; ++i) {
        plain->on_access(1, true);                 // the 128th use halves: 50 against 14
    }
    CHECK(plain->choose_victim({0, 1}) == 1);
    for (int i = 0; i < 40; ++i) {
        plain->on_access(1, true);                 // 50 against 54 (unaged, 100 against 68)
    }
    CHECK(plain->choose_victim({0, 1}) == 0);
    printf("ok frequency\n");
}

void test_score_policy() {
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

void test_take_slot() {
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
