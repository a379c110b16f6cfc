#include "hobbit-pool-plan.h"

#include "hobbit-error.h"

#include <algorithm>
#include <cstdio>

static std::string mib(int64_t n_bytes) {
    char buf[64];
    snprintf(buf, sizeof(buf), "%.1f MB", n_bytes / (1024.0 * 1024.0));
    return buf;
}

std::vector<pool_plan_group> pool_plan_make(const expert_index & index, int64_t budget_bytes) {
    const hobbit_model_info & info = index.info;
    if (budget_bytes < info.min_budget_bytes) {
        throw hobbit_error(HOBBIT_STATUS_ERROR_BUDGET, index.path + ": expert budget " + mib(budget_bytes) + " is below the minimum of " +
            mib(info.min_budget_bytes) + " (" + std::to_string(info.n_expert_used) + " experts of one token)");
    }
    std::vector<pool_plan_group> groups;
    std::vector<int> first_layer;
    for (int il = 0; il < info.n_layer; ++il) {
        const expert_layer_layout & layer = index.layers[il];
        if (!layer.has_experts()) {
            continue;
        }
        size_t g = 0;
        while (g < groups.size() && !index.layers[first_layer[g]].same_signature(layer)) {
            ++g;
        }
        if (g == groups.size()) {
            groups.emplace_back();
            groups.back().expert_bytes = (int64_t) layer.n_bytes();
            first_layer.push_back(il);
        }
        groups[g].layers.push_back(il);
    }
    const int64_t spare = budget_bytes - info.min_budget_bytes;
    for (auto & g : groups) {
        const int64_t group_bytes = g.expert_bytes * info.n_expert * (int64_t) g.layers.size();
        const int64_t extra = (int64_t) ((double) spare * group_bytes / info.expert_bytes_total) / g.expert_bytes;
        g.n_slot = (int) std::min<int64_t>(info.n_expert_used + extra, (int64_t) info.n_expert * g.layers.size());
    }
    return groups;
}
