// test-expert-cache.cpp - native unit tests: the expert cache's decision (plan_wave, apply_wave) over slot
// tables without storage, its loads completed at once, the world around it (in place, the I/O queue) a fake.
#include "test-common.h"

#include "hobbit-expert-cache.h"

#include <algorithm>
#include <climits>
#include <map>

namespace {

// the runtime as the cache sees it: which misses run in place, a queue of background reads it may drop
struct fake_env : cache_env {
    std::vector<bool> in_place;        // [n_expert]: runs in place (with an in-place pass)
    std::vector<load_task> queued;     // background reads not yet run
    std::vector<int> prepared;         // experts prepared to run in place
    bool has_failed = false;
    std::string why;

    bool runs_in_place(int, int e, int) const override { return !in_place.empty() && in_place[e]; }
    std::vector<bool> balanced_in_place(int, const wave_selection &, const std::vector<int> &,
                                        const std::function<bool(int)> &) const override { return {}; }
    bool prepare_in_place(int, int e) override { prepared.push_back(e); return true; }
    std::vector<load_task> drop_queued(const std::function<bool(const load_task &)> & pred) override {
        std::vector<load_task> dropped;
        auto keep = std::stable_partition(queued.begin(), queued.end(), [&](const load_task & t) { return !pred(t); });
        dropped.assign(keep, queued.end());
        queued.erase(keep, queued.end());
        return dropped;
    }
    bool failed() const override { return has_failed; }
    void fail(const std::string & msg) override { if (!has_failed) { has_failed = true; why = msg; } }
};

// every layer a MoE layer, one pool a level shared by all, n_slot[l] slots at level l
expert_cache_setup setup_of(std::vector<int> n_slot, int hit_policy = HOBBIT_HIT_EXACT) {
    expert_cache_setup s;
    s.n_layer = N_LAYER;
    s.n_expert = N_EXPERT;
    s.n_expert_used = N_USED;
    s.n_level = (int) n_slot.size();
    s.moe_layers = { 0, 1, 2 };
    for (int l = 0; l < s.n_level; ++l) {
        s.pools.push_back({ l, 0, 1000 >> l, n_slot[l], { 0, 1, 2 } });
    }
    s.policy = cache_policy_kind::lru;
    s.hit_policy = hit_policy;
    s.inplace_ok.assign(N_LAYER, false);
    return s;
}

// a ubatch's selection: tokens[t] = its experts with the level each wants (n_level: skipped if missed)
wave_selection selection(const std::vector<std::vector<std::pair<int, int>>> & tokens, int n_level) {
    wave_selection sel;
    sel.n_used = N_USED;
    sel.n_tokens = (int) tokens.size();
    sel.n_pairs.assign(N_EXPERT, 0);
    sel.want.assign(N_EXPERT, INT_MAX);
    sel.top1.assign(N_EXPERT, false);
    sel.share_low.assign(N_EXPERT, false);
    for (const auto & token : tokens) {
        for (size_t k = 0; k < token.size(); ++k) {
            const auto [e, want] = token[k];
            sel.ids.push_back(e);
            sel.n_pairs[e]++;
            sel.want[e] = std::min(sel.want[e], want);
            sel.top1[e] = sel.top1[e] || k == 0;
        }
    }
    for (int e = 0; e < N_EXPERT; ++e) {
        if (sel.n_pairs[e] > 0) {
            sel.order.push_back(e);
        }
    }
    std::stable_sort(sel.order.begin(), sel.order.end(), [&](int a, int b) { return sel.n_pairs[a] > sel.n_pairs[b]; });
    (void) n_level;
    return sel;
}

// every load done at once (the disk as fast as it gets); the loads that were queued
std::vector<load_task> complete(expert_cache & cache, std::vector<load_task> & loads) {
    std::vector<load_task> done = loads;
    for (const load_task & t : loads) {
        cache.load_done(t, true, 1000);
    }
    loads.clear();
    return done;
}

// one wave served and its loads completed (what the runtime's dispatch does)
wave_assignment serve(expert_cache & cache, int il, const wave_selection & sel, std::vector<load_task> * out = nullptr) {
    std::vector<load_task> loads;
    const wave_assignment a = cache.serve_wave(il, 0, -1, 0, sel, {}, loads);
    const std::vector<load_task> done = complete(cache, loads);
    if (out) {
        *out = done;
    }
    cache.wait_for_pins(il);
    return a;
}

const expert_choice & choice_of(const wave_plan & plan, int e) {
    for (const expert_choice & c : plan.choices) {
        if (c.expert == e) {
            return c;
        }
    }
    CHECK(false && "no choice for the expert");
    return plan.choices.front();
}

} // namespace

// the experts already cached are planned (and pinned) before any miss looks for a victim
static void test_hits_before_misses() {
    fake_env env;
    expert_cache cache(setup_of({ 2 }), env);
    serve(cache, 0, selection({ { { 0, 0 } } }, 1)); // layer 0's 0, the least recently used
    serve(cache, 0, selection({ { { 2, 0 } } }, 1)); // layer 0's 2
    // expert 1 is selected by more tokens (first in the order), 0 is cached: 0 is planned first and
    // pinned, and the miss evicts 2 (were misses first, LRU would have given it 0's slot)
    const wave_selection sel = selection({ { { 1, 0 }, { 0, 0 } }, { { 1, 0 } } }, 1);
    CHECK(sel.order.front() == 1);
    cache.begin_wave(0, 0, sel, {});
    const wave_plan plan = cache.plan_wave(0, 0, sel);
    CHECK(plan.choices.front().expert == 0 && plan.choices.front().how == serve_as::hit && plan.choices.front().slot == 0);
    CHECK(choice_of(plan, 1).how == serve_as::load && choice_of(plan, 1).level == 0);
    std::vector<load_task> loads;
    const wave_assignment a = cache.apply_wave(0, plan, sel, loads);
    CHECK(a.slot_of[0] == 0 && a.slot_of[1] == 1 && loads.size() == 1 && loads[0].expert == 1 && loads[0].slot == 1);
    const std::vector<bool> cached = cache.cached_experts(0);
    CHECK(cached[0] && cached[1] && !cached[2]);
    printf("ok expert cache: hits before misses\n");
}

// planning changes nothing: the same plan twice, no counter moved, no slot taken
static void test_plan_changes_nothing() {
    fake_env env;
    expert_cache cache(setup_of({ 2 }), env);
    serve(cache, 0, selection({ { { 0, 0 } } }, 1));
    const cache_counters before = cache.counters();
    const wave_selection sel = selection({ { { 0, 0 }, { 1, 0 } } }, 1);
    cache.begin_wave(0, 0, sel, {});
    const wave_plan a = cache.plan_wave(0, 0, sel), b = cache.plan_wave(0, 0, sel);
    CHECK(a.choices.size() == b.choices.size());
    for (size_t i = 0; i < a.choices.size(); ++i) {
        CHECK(a.choices[i].expert == b.choices[i].expert && a.choices[i].how == b.choices[i].how &&
              a.choices[i].slot == b.choices[i].slot && a.choices[i].level == b.choices[i].level);
    }
    const cache_counters after = cache.counters();
    CHECK(after.hits == before.hits && after.misses == before.misses && cache.used_slot_bytes() == 1000);
    printf("ok expert cache: a plan changes nothing\n");
}

// hits "exact": a selection is served at the level it wants or loaded there, never from another level's copy;
// a slot busy with this graph's prediction for a later layer is waited for (the prediction dropped), not given
// up for another level
static void test_exact_waits() {
    fake_env env;
    expert_cache cache(setup_of({ 1, 1 }), env); // one slot a level
    serve(cache, 0, selection({ { { 1, 1 } } }, 2)); // 1 of layer 0 wanted low: cached low
    // the prediction for layer 2 takes the high slot, pinned until layer 2 runs, its read still queued
    std::vector<load_task> loads;
    cache.prefetch_predicted({ { 2, { 3 }, { 0 } } }, loads);
    CHECK(loads.size() == 1 && loads[0].level == 0 && loads[0].layer == 2 && loads[0].prefetch);
    env.queued = loads;
    // layer 1 wants 1 high: the low copy does not serve it, the only high slot is the prediction's: wait
    const wave_selection sel = selection({ { { 1, 0 } } }, 2);
    cache.begin_wave(1, 0, sel, {});
    const wave_plan plan = cache.plan_wave(1, 0, sel);
    CHECK(choice_of(plan, 1).how == serve_as::wait && choice_of(plan, 1).level == 0);
    std::vector<load_task> wave_loads;
    const wave_assignment a = cache.apply_wave(1, plan, sel, wave_loads);
    CHECK(a.level_of[1] == 0 && a.slot_of[1] == 0);           // the prediction gave its slot up
    CHECK(env.queued.empty());                                 // its queued read dropped
    CHECK(wave_loads.size() == 1 && wave_loads[0].level == 0 && wave_loads[0].layer == 1 && !wave_loads[0].prefetch);
    CHECK(!env.has_failed);
    printf("ok expert cache: hits exact wait for the wanted level\n");
}

// hits "at-least": a lower copy does not serve a selection that wants more (the wanted one loads), a higher one
// serves a selection that wants less
static void test_at_least() {
    fake_env env;
    expert_cache cache(setup_of({ 2, 2 }, HOBBIT_HIT_AT_LEAST), env);
    serve(cache, 0, selection({ { { 0, 1 }, { 1, 0 } } }, 2)); // 0 cached low, 1 high
    const wave_selection sel = selection({ { { 0, 0 }, { 1, 1 } } }, 2);
    cache.begin_wave(0, 0, sel, {});
    const wave_plan plan = cache.plan_wave(0, 0, sel);
    CHECK(choice_of(plan, 0).how == serve_as::load && choice_of(plan, 0).level == 0);
    CHECK(choice_of(plan, 1).how == serve_as::hit && choice_of(plan, 1).level == 0);
    // hits "found" take the low copy as it is
    fake_env env2;
    expert_cache found(setup_of({ 2, 2 }, HOBBIT_HIT_FOUND), env2);
    serve(found, 0, selection({ { { 0, 1 } } }, 2));
    const wave_selection high = selection({ { { 0, 0 } } }, 2);
    found.begin_wave(0, 0, high, {});
    const wave_plan found_plan = found.plan_wave(0, 0, high);
    const expert_choice & c = choice_of(found_plan, 0);
    CHECK(c.how == serve_as::hit && c.level == 1);
    printf("ok expert cache: hits at-least\n");
}

// per-level pools: a selection served at each level takes that level's slots and is counted there
static void test_per_level_pools() {
    fake_env env;
    expert_cache cache(setup_of({ 1, 2 }), env);
    std::vector<load_task> loads;
    const wave_assignment a = serve(cache, 0, selection({ { { 0, 0 }, { 1, 1 } }, { { 2, 1 }, { 0, 0 } } }, 2), &loads);
    CHECK(a.level_of[0] == 0 && a.level_of[1] == 1 && a.level_of[2] == 1);
    CHECK(loads.size() == 3);
    cache_pool_counters high, low;
    CHECK(cache.pool_counters(0, high) && cache.pool_counters(1, low));
    CHECK(high.misses == 1 && low.misses == 2 && high.n_slot == 1 && low.n_slot == 2 && low.level == 1);
    const cache_counters c = cache.counters();
    CHECK(c.served[0] == 2 && c.served[1] == 2 && c.misses == 3);
    printf("ok expert cache: per-level pools\n");
}

// skipped (HOBBIT's T2) when missed, served when cached (unless skip_cached); counted by pairs
static void test_skip() {
    fake_env env;
    expert_cache cache(setup_of({ 2 }, HOBBIT_HIT_FOUND), env);
    serve(cache, 0, selection({ { { 0, 0 } } }, 1));
    const wave_assignment a = serve(cache, 0, selection({ { { 0, 1 }, { 1, 1 } } }, 1)); // both want "skip"
    CHECK(a.slot_of[0] >= 0 && a.level_of[1] == 1 && a.slot_of[1] == -1);
    CHECK(cache.counters().skipped == 1);
    printf("ok expert cache: skipped misses\n");
}

// a prompt's least popular experts want the low level (Fate's share): loaded low even with hits exact
static void test_prompt_low_share() {
    fake_env env;
    expert_cache cache(setup_of({ 2, 2 }), env);
    wave_selection sel = selection({ { { 0, 0 }, { 1, 0 } }, { { 0, 0 }, { 3, 0 } } }, 2);
    sel.share_low[3] = true;
    sel.want[3] = 1;
    const wave_assignment a = serve(cache, 0, sel);
    CHECK(a.level_of[0] == 0 && a.level_of[1] == 0 && a.level_of[3] == 1);
    printf("ok expert cache: a prompt's low share\n");
}

// a ubatch wider than the pools without in place runs in waves: the first holds what fits, the rest later;
// the last wave waits for slots (its earlier waves' pins released) rather than leave an expert out
static void test_waves_and_the_last_wait() {
    fake_env env;
    expert_cache cache(setup_of({ 2 }), env);
    const wave_selection sel = selection({ { { 0, 0 }, { 1, 0 } }, { { 2, 0 }, { 3, 0 } } }, 1);
    CHECK(cache.n_waves(0, 2) == 2 && cache.waves_of_level(0, 2) == 2);
    std::vector<load_task> loads;
    const wave_assignment first = cache.serve_wave(0, 0, -1, 0, sel, {}, loads);
    complete(cache, loads);
    cache.wait_for_pins(0);
    int n_first = 0;
    for (int e = 0; e < N_EXPERT; ++e) {
        n_first += first.slot_of[e] >= 0;
    }
    CHECK(n_first == 2);
    cache.begin_wave(0, 1, sel, {});
    const wave_plan last = cache.plan_wave(0, 1, sel);
    CHECK(last.last && last.must_fit && last.choices.size() == 2);
    std::vector<load_task> more;
    const wave_assignment second = cache.apply_wave(0, last, sel, more);
    for (int e = 0; e < N_EXPERT; ++e) {
        CHECK((first.slot_of[e] >= 0) != (second.slot_of[e] >= 0)); // every expert in exactly one wave
    }
    CHECK(!env.has_failed);
    printf("ok expert cache: waves, and the last one's waits\n");
}

// in place: with an in-place pass, a miss the executor runs in place is computed on the mapped model
static void test_in_place() {
    fake_env env;
    env.in_place.assign(N_EXPERT, false);
    env.in_place[1] = true;
    expert_cache_setup s = setup_of({ 2 });
    s.inplace_ok[0] = true;
    s.inplace_any_width = true;
    expert_cache cache(s, env);
    CHECK(cache.inplace_min_pairs(0) == 0 && cache.inplace_min_pairs(2) == INT32_MAX);
    const wave_assignment a = serve(cache, 0, selection({ { { 0, 0 }, { 1, 0 } } }, 1));
    CHECK(a.inplace[1] && a.slot_of[1] == -1 && !a.inplace[0] && a.slot_of[0] >= 0);
    CHECK(env.prepared == std::vector<int>{ 1 } && cache.counters().inplace == 1);
    printf("ok expert cache: in place\n");
}

// a wrong prediction's queued read is dropped at its layer's turn (the slot keeps the expert, unread); a later
// hit on it reads it on demand and counts the miss it is
static void test_dropped_prefetch() {
    fake_env env;
    expert_cache cache(setup_of({ 3 }), env);
    serve(cache, 0, selection({ { { 0, 0 } } }, 1));
    std::vector<load_task> loads;
    cache.prefetch_predicted({ { 2, { 3 }, { 0 } } }, loads);
    env.queued = loads;
    CHECK(cache.counters().prefetch_issued == 1);
    serve(cache, 2, selection({ { { 1, 0 } } }, 1)); // 3 not selected: its read dropped
    CHECK(env.queued.empty());
    const int64_t misses = cache.counters().misses;
    std::vector<load_task> again;
    const wave_assignment a = serve(cache, 2, selection({ { { 3, 0 } } }, 1), &again);
    CHECK(a.slot_of[3] >= 0 && again.size() == 1 && again[0].expert == 3 && cache.counters().misses == misses + 1);
    printf("ok expert cache: a dropped prefetch read on demand\n");
}

// a prompt's ubatch takes as victim what its sweep reaches last: at layer 0, layers 1 and 2 come next, and
// layer 0's other experts only in the next graph
static void test_sweep_victim() {
    fake_env env;
    expert_cache cache(setup_of({ 4 }), env);
    serve(cache, 2, selection({ { { 0, 0 }, { 1, 0 } } }, 1)); // layer 2's 0 and 1: the least recently used
    serve(cache, 0, selection({ { { 0, 0 }, { 1, 0 } } }, 1)); // layer 0's 0 and 1
    std::vector<std::vector<std::pair<int, int>>> tokens(N_EXPERT, { { 2, 0 }, { 3, 0 } });
    const wave_selection prompt = selection(tokens, 1);
    CHECK(is_prompt_ubatch(prompt.n_pair(), N_EXPERT));
    const wave_assignment a = serve(cache, 0, prompt);
    // LRU alone would have evicted layer 2's (used first); the sweep evicts layer 0's 0 and 1
    CHECK(a.slot_of[2] >= 0 && a.slot_of[3] >= 0);
    const std::vector<bool> layer2 = cache.cached_experts(2), layer0 = cache.cached_experts(0);
    CHECK(layer2[0] && layer2[1] && !layer0[0] && !layer0[1] && layer0[2] && layer0[3]);
    printf("ok expert cache: a prompt's sweep victim\n");
}

void test_expert_cache() {
    test_hits_before_misses();
    test_plan_changes_nothing();
    test_exact_waits();
    test_at_least();
    test_per_level_pools();
    test_skip();
    test_prompt_low_share();
    test_waves_and_the_last_wait();
    test_in_place();
    test_dropped_prefetch();
    test_sweep_victim();
}
