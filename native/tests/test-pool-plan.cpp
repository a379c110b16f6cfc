// test-pool-plan.cpp - native unit tests: level budgets and per-layer pools.
#include "test-common.h"

#include "hobbit-pool-plan.h"
#include "hobbit-expert-store.h"
#include "hobbit-error.h"

// the budget split among precision levels, by hand
void test_level_budgets(const std::string & path) {
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
void test_per_layer_plan(const std::string & path) {
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

// with a static placement: a slot for every expert placed at the level, not a share by bytes
// (one signature here, MoE layers 0 and 2 of 4 experts, top-2: the minimum is 2 slots)
void test_placed_plan(const std::string & path) {
    const expert_index idx = expert_index::from_file(path);
    const int64_t e = (int64_t) idx.info.expert_bytes, min = idx.info.min_budget_bytes;
    auto slots = [&](int64_t budget, std::vector<int> n_placed) {
        n_placed.resize(idx.info.n_layer, 0);
        int n = 0;
        for (const pool_plan_group & g : pool_plan_make_placed(idx, budget, n_placed)) {
            n += g.n_slot;
        }
        return n;
    };
    CHECK(slots(min + 3 * e, { 3, 0, 2 }) == 5);      // exactly what is placed
    CHECK(slots(min + 5 * e, { 3, 0, 2 }) == 7);      // and what the rest of the budget buys
    CHECK(slots(min + 3 * e, { 1, 0, 0 }) == 5);      // at least one token's top-k, the rest given
    CHECK(slots(min + 1 * e, { 4, 0, 4 }) == 3);      // less than the placement: pool_plan_make's
    CHECK(slots(min + 1 * e, { 4, 0, 4 }) == slots(min + 1 * e, {}) && pool_plan_make(idx, min + e)[0].n_slot == 3);
    printf("ok placed plan\n");
}
