// hobbit-pool-plan.h - how a byte budget becomes pools and slots.
//
// One pool per expert signature (projection shapes and types); every pool gets one
// token's top-k, the rest of the budget is shared in proportion to each signature's
// expert bytes. Pure arithmetic on the file index, so Python can ask before loading.
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
