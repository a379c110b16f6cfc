#include "hobbit-cache-sim.h"

#include "hobbit-substitution.h"

#include <algorithm>
#include <vector>

cache_sim_result cache_simulate(const cache_sim_trace & tr, int n_slot, bool belady, cache_policy_kind kind,
                                const cache_policy_weights & weights, uint64_t seed, double low_miss_cost,
                                float substitute_alpha) {
    const int K = tr.n_expert_used;
    const int n_id = tr.n_layer * tr.n_expert;
    std::unique_ptr<cache_policy_i> policy = belady ?
        cache_policy_make_belady(tr.experts, (int64_t) tr.n_tokens * tr.n_layer, tr.n_layer, tr.n_expert, K, n_slot) :
        cache_policy_make(kind, n_slot, tr.n_layer, tr.n_expert, weights, seed, tr.popularity);
    std::vector<int> slot_of(n_id, -1);
    std::vector<int> owner(n_slot, -1);
    std::vector<int> pinned_at(n_slot, -1);             // step (token * n_layer + layer) that pinned the slot
    std::vector<uint8_t> prefetched(n_slot, 0);         // 1 while a prefetched expert waits for its first selection
    const int n_prefetch = belady || tr.predicted == nullptr ? 0 : std::min(tr.prefetch_layers, tr.n_lookahead);
    std::vector<int> candidates;
    int pinned_step = -1;                               // the step being served
    cache_sim_result r;
    const bool substitute = substitute_alpha > 0.0f && tr.scores != nullptr && !belady;
    std::vector<int32_t> step_experts(K);               // the step's selections, after substitution
    std::vector<float> scores(tr.n_expert);
    std::vector<int> ids(K);
    std::vector<float> unused_weights(K, 0.0f);
    // a slot is taken as the runtime's pools take one: empty first, then the policy's
    // victim among the slots the step has not pinned
    const auto use = [&](int s) {
        return owner[s] < 0 ? slot_use::empty : pinned_at[s] == pinned_step ? slot_use::busy : slot_use::evictable;
    };

    for (int t = 0; t < tr.n_tokens; ++t) {
        if (tr.seq_start && tr.seq_start[t]) {
            policy->reset();
        }
        for (int l = 0; l < tr.n_layer; ++l) {
            const int step = t * tr.n_layer + l;
            pinned_step = step;
            policy->on_layer(l);
            if (tr.scores != nullptr) {
                policy->on_scores(l, tr.scores + (int64_t) step * tr.n_expert); // the score-history policy's input
            }
            for (int k = 0; k < K; ++k) {
                step_experts[k] = tr.experts[(int64_t) step * K + k];
            }
            if (substitute) {
                const float * s = tr.scores + (int64_t) step * tr.n_expert;
                scores.assign(s, s + tr.n_expert);
                ids.assign(step_experts.begin(), step_experts.end());
                const substitution_plan plan = plan_substitution(scores, ids, unused_weights, substitute_alpha,
                    [&](int e) { return slot_of[l * tr.n_expert + e] >= 0; });
                for (int k = 0; k < K; ++k) {
                    step_experts[k] = plan.ids[k];
                }
                r.substituted += plan.n_substituted;
            }
            // as the runtime does: the experts already cached are used and pinned first,
            // then the missing ones are loaded in top-k order
            for (int pass = 0; pass < 2; ++pass) {
                for (int k = 0; k < K; ++k) {
                    const int64_t i = (int64_t) step * K + k;
                    const int32_t e = step_experts[k];
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
                        r.prefetch_used += prefetched[s];
                        prefetched[s] = 0;
                    } else {
                        if (high) {
                            r.misses_high++;
                        } else {
                            r.misses_low++;
                        }
                        s = cache_take_slot(n_slot, use, *policy, candidates);
                        if (s < 0) {
                            continue; // fewer slots than top-k: cannot be cached at all
                        }
                        if (owner[s] >= 0) {
                            slot_of[owner[s]] = -1;
                        }
                        owner[s] = id;
                        slot_of[id] = s;
                        prefetched[s] = 0;
                        policy->on_insert(s, l, e);
                    }
                    policy->on_access(s, high);
                    pinned_at[s] = step;
                }
            }
            // the next layers' guesses, nearest layer first, each guess in the predictor's
            // order; a prefetched slot is pinned with the step so the next guess cannot take it
            for (int p = 1; p <= n_prefetch && l + p < tr.n_layer; ++p) {
                const int32_t * guess = tr.predicted + ((int64_t) step * tr.n_lookahead + (p - 1)) * K;
                for (int k = 0; k < K; ++k) {
                    const int32_t e = guess[k];
                    const int id = (l + p) * tr.n_expert + e;
                    if (e < 0 || e >= tr.n_expert || slot_of[id] >= 0) {
                        continue;
                    }
                    const int s = cache_take_slot(n_slot, use, *policy, candidates);
                    if (s < 0) {
                        break;
                    }
                    if (owner[s] >= 0) {
                        slot_of[owner[s]] = -1;
                    }
                    owner[s] = id;
                    slot_of[id] = s;
                    prefetched[s] = 1;
                    pinned_at[s] = step;
                    policy->on_insert(s, l + p, e);
                    r.prefetched++;
                }
            }
        }
    }
    r.miss_penalty = (double) r.misses_high + (double) r.misses_low * low_miss_cost;
    return r;
}

static neuron_bits bits_of(const uint8_t * packed, int n_neuron) {
    neuron_bits b(n_neuron, packed == nullptr);
    if (packed != nullptr) {
        for (int i = 0; i < n_neuron; ++i) {
            if ((packed[i >> 3] >> (i & 7)) & 1) {
                b.set(i);
            }
        }
    }
    return b;
}

neuron_sim_result neuron_sim_cache_simulate(const neuron_sim_trace & tr, int64_t neuron_bytes, int64_t budget_bytes,
                                        double limit) {
    neuron_sim_cache cache(tr.n_layer, tr.n_expert, tr.n_neuron, neuron_bytes, budget_bytes, limit);
    const int K = tr.n_expert_used;
    const int64_t row = (tr.n_neuron + 7) / 8;
    neuron_sim_result r;
    for (int64_t step = 0; step < (int64_t) tr.n_tokens * tr.n_layer; ++step) {
        cache.begin_step();
        for (int k = 0; k < K; ++k) {
            const int64_t sel = step * K + k;
            const int e = tr.experts[sel];
            if (e < 0 || e >= tr.n_expert) {
                continue;
            }
            const neuron_need need = { bits_of(tr.need_w1 ? tr.need_w1 + sel * row : nullptr, tr.n_neuron),
                                       bits_of(tr.need_rest ? tr.need_rest + sel * row : nullptr, tr.n_neuron) };
            const neuron_sim_plan p = cache.plan_access((int) (step % tr.n_layer), e, need);
            cache.apply(p);
            r.accesses++;
            r.hits += p.hit && p.read_bytes == 0;
            r.whole += p.whole;
            r.bytes_read += p.read_bytes;
            r.requests += p.n_requests;
        }
    }
    return r;
}
