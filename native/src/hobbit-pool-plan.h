// hobbit-pool-plan.h - how a byte budget becomes pools and slots.
//
// The budget is split among the precision levels; within a level, one pool per expert
// signature (projection shapes and types), each with one token's top-k, the rest shared
// in proportion to each signature's expert bytes (with a static placement: by what it
// places). Pure arithmetic on the file indexes.
#pragma once

#include "hobbit-expert-store.h"

#include <cstdint>
#include <vector>

struct pool_plan_group {
    std::vector<int> layers;   // MoE layers served by this pool
    int64_t expert_bytes = 0;  // one expert, all projections
    int     n_slot       = 0;
};

// throws hobbit_error if the budget is below info.min_budget_bytes
std::vector<pool_plan_group> pool_plan_make(const expert_index & index, int64_t budget_bytes);

// with a static placement: each signature's pool gets a slot for every expert placed at this
// level in its layers (n_placed[il], by layer; at least one token's top-k), not a share in
// proportion to its bytes: a placement that favours some layers (those whose experts lose most
// at the copy) would otherwise leave some of its experts without a slot, read at every use. The
// rest as pool_plan_make gives it; where the budget holds less than the placement, pool_plan_make's.
std::vector<pool_plan_group> pool_plan_make_placed(const expert_index & index, int64_t budget_bytes,
                                                   const std::vector<int> & n_placed);

// Fate's shallow-favoring allocation (§4.4): one pool per MoE layer, so a layer's misses evict
// only its own experts. Every layer gets one token's top-k; then the first n_shallow MoE
// layers, in order, get room for all of their experts (the router's next-layer prediction is
// weakest there, so prefetch cannot cover their misses); the rest is split evenly over the
// deeper layers. 0 splits everything evenly. Throws hobbit_error if the budget is below
// pool_plan_per_layer_min_bytes.
std::vector<pool_plan_group> pool_plan_make_per_layer(const expert_index & index, int64_t budget_bytes, int n_shallow);

// the slots of each MoE layer's pool as pool_plan_make_per_layer deals them, from the bytes
// of one expert of each layer; the budget must hold n_expert_used of every layer
std::vector<int> pool_plan_deal_per_layer(const std::vector<int64_t> & expert_bytes, int n_expert_used, int n_expert,
                                          int64_t budget_bytes, int n_shallow);

// one token's top-k in every MoE layer: the least a pool per layer needs
int64_t pool_plan_per_layer_min_bytes(const expert_index & index);

// how a budget is split among precision levels (levels[0] the model, then its companions):
// each gets its minimum (one token's top-k), the rest goes by level_shares (or, all 0, the
// lowest level gets room for all of its experts up to HOBBIT_AUTO_LOW_SHARE of the budget:
// a copy of every expert in memory means a decode never waits for the disk); a level
// that could hold all of its experts with less passes the excess on, highest precision
// first. high_min_bytes: level 0's minimum where it is not one token's top-k (a pool per
// layer: pool_plan_per_layer_min_bytes), or -1. prompt_low_share > 0 (Fate's share, with a
// decode that never wants the low level): automatic gives the lowest level room for two
// layers of a prompt's least popular experts, ceil(HOBBIT_PROMPT_LOW_SKEW x share x n_expert)
// each, up to HOBBIT_PROMPT_LOW_MAX_SHARE of the budget. Throws hobbit_error if the budget is below the
// levels' minima.
std::vector<int64_t> pool_plan_level_budgets(const std::vector<const expert_index *> & levels, int64_t budget_bytes,
                                             const float * level_shares, int64_t high_min_bytes = -1,
                                             float prompt_low_share = 0.0f);

// with a static placement: placed_bytes[l] are the bytes of the experts placed at level l.
// Each level gets exactly those (at least its minimum) when the budget holds them all, else
// the budget is split in their proportion (pool_plan_level_budgets with them as shares).
std::vector<int64_t> pool_plan_placed_budgets(const std::vector<const expert_index *> & levels, int64_t budget_bytes,
                                              const std::vector<int64_t> & placed_bytes);
