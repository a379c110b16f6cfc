#include "hobbit-pool-plan.h"

#include "hobbit-error.h"

#include <algorithm>
#include <cmath>
#include <cstdio>

static std::string mib(int64_t n_bytes) {
    char buf[64];
    snprintf(buf, sizeof(buf), "%.1f MB", n_bytes / (1024.0 * 1024.0));
    return buf;
}

// what the rounding down left over goes to whichever groups it still buys a slot in: a budget of
// exactly every expert gives every expert a slot, in every group
static void give_what_is_left(std::vector<pool_plan_group> & groups, int64_t left, const hobbit_model_info & info) {
    for (bool more = true; more;) {
        more = false;
        for (auto & g : groups) {
            if (left >= g.expert_bytes && g.n_slot < (int64_t) info.n_expert * (int64_t) g.layers.size()) {
                g.n_slot++;
                left -= g.expert_bytes;
                more = true;
            }
        }
    }
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
    int64_t left = spare;
    for (auto & g : groups) {
        const int64_t group_bytes = g.expert_bytes * info.n_expert * (int64_t) g.layers.size();
        const int64_t extra = (int64_t) ((__int128) spare * group_bytes / info.expert_bytes_total) / g.expert_bytes;
        g.n_slot = (int) std::min<int64_t>(info.n_expert_used + extra, (int64_t) info.n_expert * g.layers.size());
        left -= (g.n_slot - info.n_expert_used) * g.expert_bytes;
    }
    give_what_is_left(groups, left, info);
    return groups;
}

std::vector<pool_plan_group> pool_plan_make_placed(const expert_index & index, int64_t budget_bytes,
                                                   const std::vector<int> & n_placed) {
    std::vector<pool_plan_group> groups = pool_plan_make(index, budget_bytes);
    const hobbit_model_info & info = index.info;
    int64_t left = budget_bytes - info.min_budget_bytes;
    for (auto & g : groups) {
        int64_t placed = 0;
        for (int il : g.layers) {
            placed += n_placed[il];
        }
        g.n_slot = (int) std::clamp<int64_t>(placed, info.n_expert_used, (int64_t) info.n_expert * g.layers.size());
        left -= (g.n_slot - info.n_expert_used) * g.expert_bytes;
    }
    if (left < 0) {
        return pool_plan_make(index, budget_bytes); // less than the placement: shared by bytes, as without one
    }
    give_what_is_left(groups, left, info);
    return groups;
}

int64_t pool_plan_per_layer_min_bytes(const expert_index & index) {
    int64_t min = 0;
    for (const expert_layer_layout & layer : index.layers) {
        min += layer.has_experts() ? (int64_t) layer.n_bytes() * index.info.n_expert_used : 0;
    }
    return min;
}

std::vector<int> pool_plan_deal_per_layer(const std::vector<int64_t> & expert_bytes, int n_expert_used, int n_expert,
                                          int64_t budget_bytes, int n_shallow) {
    std::vector<int> slots(expert_bytes.size(), n_expert_used);
    int64_t left = budget_bytes;
    for (int64_t b : expert_bytes) {
        left -= b * n_expert_used;
    }
    const int n_layer = (int) slots.size();
    const int n_first = std::min(std::max(n_shallow, 0), n_layer);
    for (int i = 0; i < n_first; ++i) {  // the shallow layers in order, each whole if it can be
        const int64_t extra = std::max<int64_t>(0, std::min<int64_t>(left / expert_bytes[i], n_expert - slots[i]));
        slots[i] += (int) extra;
        left -= extra * expert_bytes[i];
    }
    // the deep layers evenly: a slot each round while the budget buys one somewhere
    for (bool more = true; more;) {
        more = false;
        for (int i = n_first; i < n_layer; ++i) {
            if (left >= expert_bytes[i] && slots[i] < n_expert) {
                slots[i]++;
                left -= expert_bytes[i];
                more = true;
            }
        }
    }
    return slots;
}

std::vector<pool_plan_group> pool_plan_make_per_layer(const expert_index & index, int64_t budget_bytes, int n_shallow) {
    const hobbit_model_info & info = index.info;
    const int64_t min = pool_plan_per_layer_min_bytes(index);
    if (budget_bytes < min) {
        throw hobbit_error(HOBBIT_STATUS_ERROR_BUDGET, index.path + ": expert budget " + mib(budget_bytes) +
            " is below the minimum of " + mib(min) + " for a pool per layer (" + std::to_string(info.n_expert_used) +
            " experts of one token in each of " + std::to_string(info.n_layer_moe) + " MoE layers)");
    }
    std::vector<pool_plan_group> groups;
    std::vector<int64_t> expert_bytes;
    for (int il = 0; il < info.n_layer; ++il) {
        if (index.layers[il].has_experts()) {
            pool_plan_group g;
            g.layers       = { il };
            g.expert_bytes = (int64_t) index.layers[il].n_bytes();
            groups.push_back(g);
            expert_bytes.push_back(g.expert_bytes);
        }
    }
    const std::vector<int> slots = pool_plan_deal_per_layer(expert_bytes, info.n_expert_used, info.n_expert, budget_bytes, n_shallow);
    for (size_t i = 0; i < groups.size(); ++i) {
        groups[i].n_slot = slots[i];
    }
    return groups;
}

std::vector<int64_t> pool_plan_level_budgets(const std::vector<const expert_index *> & levels, int64_t budget_bytes,
                                             const float * level_shares, int64_t high_min_bytes, float prompt_low_share) {
    const int n = (int) levels.size();
    const auto min_of = [&](int l) { return l == 0 && high_min_bytes >= 0 ? high_min_bytes : levels[l]->info.min_budget_bytes; };
    int64_t min_total = 0;
    std::string parts;
    for (int l = 0; l < n; ++l) {
        min_total += min_of(l);
        parts += (l ? " + " : "") + mib(min_of(l));
    }
    if (budget_bytes < min_total) {
        throw hobbit_error(HOBBIT_STATUS_ERROR_BUDGET, levels[0]->path + ": expert budget " + mib(budget_bytes) +
            " is below the minimum of " + mib(min_total) + (n > 1 ? " (one token's experts at each precision: " + parts + ")" :
            " (" + std::to_string(levels[0]->info.n_expert_used) + " experts of one token)"));
    }
    std::vector<double> share(n, 0.0);
    double share_total = 0.0;
    for (int l = 0; l < n; ++l) {
        if (!(level_shares[l] >= 0.0f)) {
            throw hobbit_error(HOBBIT_STATUS_ERROR_INVALID, "level_shares must be non-negative");
        }
        share_total += level_shares[l];
    }
    const int64_t spare = budget_bytes - min_total;
    if (share_total > 0.0) {
        for (int l = 0; l < n; ++l) {
            share[l] = level_shares[l] / share_total;
        }
    } else if (n == 1) {
        share[0] = 1.0;
    } else {
        const expert_index & low = *levels[n - 1];
        double low_bytes = std::min<double>(low.info.expert_bytes_total - low.info.min_budget_bytes,
                                            HOBBIT_AUTO_LOW_SHARE * budget_bytes);
        if (prompt_low_share > 0.0f) {
            // only prompts read the low copies: what two layers' share needs, beyond the minimum
            const double n_per_layer = std::min<double>(low.info.n_expert,
                                                        std::ceil(HOBBIT_PROMPT_LOW_SKEW * prompt_low_share * low.info.n_expert));
            const double per_layer = n_per_layer * low.info.expert_bytes;
            low_bytes = std::min({ low_bytes, 2.0 * per_layer - low.info.min_budget_bytes,
                                   (double) HOBBIT_PROMPT_LOW_MAX_SHARE * budget_bytes });
            low_bytes = std::max(0.0, low_bytes);
        }
        share[n - 1] = spare > 0 ? std::min(1.0, low_bytes / spare) : 0.0;
        for (int l = 0; l < n - 1; ++l) {
            share[l] = (1.0 - share[n - 1]) / (n - 1);
        }
    }
    std::vector<int64_t> budget(n);
    int64_t excess = 0;
    for (int l = 0; l < n; ++l) {
        budget[l] = min_of(l) + (int64_t) (spare * share[l]);
        const int64_t all = levels[l]->info.expert_bytes_total;
        if (budget[l] > all) {
            excess += budget[l] - all;
            budget[l] = all;
        }
    }
    for (int l = 0; l < n && excess > 0; ++l) {
        const int64_t room = std::max<int64_t>(0, levels[l]->info.expert_bytes_total - budget[l]);
        const int64_t give = std::min(room, excess);
        budget[l] += give;
        excess -= give;
    }
    return budget;
}

std::vector<int64_t> pool_plan_placed_budgets(const std::vector<const expert_index *> & levels, int64_t budget_bytes,
                                              const std::vector<int64_t> & placed_bytes) {
    const int n = (int) levels.size();
    std::vector<int64_t> budget(n);
    int64_t total = 0;
    for (int l = 0; l < n; ++l) {
        budget[l] = std::max(placed_bytes[l], levels[l]->info.min_budget_bytes);
        total += budget[l];
    }
    if (total <= budget_bytes) {
        return budget; // what is left would hold no placed expert: it stays unallocated
    }
    std::vector<float> shares(n);
    for (int l = 0; l < n; ++l) {
        shares[l] = (float) placed_bytes[l];
    }
    return pool_plan_level_budgets(levels, budget_bytes, shares.data());
}
