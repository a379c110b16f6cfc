#include "hobbit-cache-sim.h"

#include <algorithm>
#include <climits>
#include <vector>

cache_sim_result cache_simulate(const cache_sim_trace & tr, int n_slot, bool belady, cache_policy_kind kind,
                                const cache_policy_weights & weights, uint64_t seed, double low_miss_cost) {
    const int K = tr.n_expert_used;
    const int64_t n_access = (int64_t) tr.n_tokens * tr.n_layer * K;
    const int n_id = tr.n_layer * tr.n_expert;

    // Belady needs, for every access, the position of the same expert's next access
    std::vector<int64_t> next_use;
    if (belady) {
        next_use.assign(n_access, INT64_MAX);
        std::vector<int64_t> seen(n_id, INT64_MAX);
        for (int64_t i = n_access - 1; i >= 0; --i) {
            const int32_t e = tr.experts[i];
            if (e < 0 || e >= tr.n_expert) {
                continue;
            }
            const int id = (int) ((i / K) % tr.n_layer) * tr.n_expert + e;
            next_use[i] = seen[id];
            seen[id] = i;
        }
    }

    std::unique_ptr<cache_policy_i> policy = belady ? nullptr :
        cache_policy_make(kind, n_slot, tr.n_layer, tr.n_expert, weights, seed);
    std::vector<int> slot_of(n_id, -1);
    std::vector<int> owner(n_slot, -1);
    std::vector<int64_t> owner_next(n_slot, INT64_MAX); // Belady: next use of the slot's expert
    std::vector<int> pinned_at(n_slot, -1);             // step (token * n_layer + layer) that pinned the slot
    std::vector<int> candidates;
    int n_used_slots = 0;
    cache_sim_result r;

    for (int t = 0; t < tr.n_tokens; ++t) {
        if (policy && tr.seq_start && tr.seq_start[t]) {
            policy->reset();
        }
        for (int l = 0; l < tr.n_layer; ++l) {
            const int step = t * tr.n_layer + l;
            if (policy) {
                policy->on_layer(l);
            }
            // as the runtime does: the experts already cached are used and pinned first,
            // then the missing ones are loaded in top-k order
            for (int pass = 0; pass < 2; ++pass) {
                for (int k = 0; k < K; ++k) {
                    const int64_t i = (int64_t) step * K + k;
                    const int32_t e = tr.experts[i];
                    if (e < 0 || e >= tr.n_expert) {
                        continue;
                    }
                    const int id = l * tr.n_expert + e;
                    const bool high = tr.high_precision == nullptr || tr.high_precision[i] != 0;
                    int s = slot_of[id];
                    if (s >= 0 && pinned_at[s] == step) {
                        continue; // served already (a hit of the first pass, or twice in one top-k)
                    }
                    if ((pass == 0) != (s >= 0)) {
                        continue; // hits in the first pass, misses in the second
                    }
                    r.accesses++;
                    if (s >= 0) {
                        r.hits++;
                    } else {
                        if (high) {
                            r.misses_high++;
                        } else {
                            r.misses_low++;
                        }
                        if (n_used_slots < n_slot) {
                            s = n_used_slots++;
                        } else {
                            candidates.clear();
                            for (int c = 0; c < n_slot; ++c) {
                                if (pinned_at[c] != step) {
                                    candidates.push_back(c);
                                }
                            }
                            if (candidates.empty()) {
                                continue; // fewer slots than top-k: cannot be cached at all
                            }
                            if (belady) {
                                s = *std::max_element(candidates.begin(), candidates.end(),
                                    [&](int a, int b) { return owner_next[a] < owner_next[b]; });
                            } else {
                                s = policy->choose_victim(candidates);
                            }
                            slot_of[owner[s]] = -1;
                        }
                        owner[s] = id;
                        slot_of[id] = s;
                        if (policy) {
                            policy->on_insert(s, l, e);
                        }
                    }
                    if (policy) {
                        policy->on_access(s, high);
                    }
                    if (belady) {
                        owner_next[s] = next_use[i];
                    }
                    pinned_at[s] = step;
                }
            }
        }
    }
    r.miss_penalty = (double) r.misses_high + (double) r.misses_low * low_miss_cost;
    return r;
}
