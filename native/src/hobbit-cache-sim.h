// hobbit-cache-sim.h - replays a routing trace through one expert cache, offline.
//
// The cache is the runtime's own (expert_cache) as it builds it for a uniform model: one
// pool of n_slot slots shared by all MoE layers, each decode step served as the dispatch
// serves it (begin, plan, apply, the decode prefetch), its loads completing at once.
// "belady", the offline optimum for misses (Belady 1966), is one more policy, the bound.
#pragma once

#include "hobbit-cache-policy.h"
#include "hobbit-neuron-sim-cache.h"
#include "hobbit-runtime-plan.h"

#include "hobbit.h"

#include <cstdint>

struct cache_sim_trace {
    int32_t n_tokens;
    int32_t n_layer;          // MoE layers in the trace (indices 0..n_layer-1)
    int32_t n_expert;
    int32_t n_expert_used;
    const int32_t * experts;        // [n_tokens][n_layer][n_expert_used]; -1 = none
    const uint8_t * seq_start;      // [n_tokens]; 1 where a new sequence begins; may be NULL
    const uint8_t * high_precision; // [n_tokens][n_layer][n_expert_used]; 0 = served low; NULL = all high
    const float *   scores;         // [n_tokens][n_layer][n_expert] router scores; NULL = none (no substitution)
    const float *   popularity;     // [n_layer][n_expert] the profile the popularity policy ranks by; NULL for the others
    const int32_t * predicted = nullptr; // [n_tokens][n_layer][n_lookahead][n_expert_used] guesses for the next layers
    int32_t n_lookahead       = 0;
    int32_t prefetch_layers   = 0;  // after each layer, the next P layers' guesses are loaded (not with belady)
};

struct cache_sim_result {
    int64_t accesses = 0;
    int64_t hits     = 0;
    int64_t misses_high = 0;
    int64_t misses_low  = 0;
    double  miss_penalty = 0.0; // misses_high + misses_low * low_miss_cost
    int64_t substituted  = 0;   // selections a cached expert of similar score served instead
    int64_t prefetched    = 0;  // experts loaded ahead of their layer
    int64_t prefetch_used = 0;  // of those, selected before they were evicted
};

// a trace's selections with the neurons each needs (CORM), replayed through one neuron cache
struct neuron_sim_trace {
    int32_t n_tokens, n_layer, n_expert, n_expert_used, n_neuron;
    const int32_t * experts;   // [n_tokens][n_layer][n_expert_used]; -1 = none
    const uint8_t * need_w1;   // [n_tokens][n_layer][n_expert_used][(n_neuron + 7) / 8], bit i of byte i / 8 =
                               // neuron i (numpy's packbits, little bit order); NULL = every neuron
    const uint8_t * need_rest; // the same for W3 and W2
};

struct neuron_sim_result {
    int64_t accesses = 0, hits = 0, whole = 0;
    int64_t bytes_read = 0, requests = 0;
};

neuron_sim_result neuron_sim_cache_simulate(const neuron_sim_trace & trace, int64_t neuron_bytes, int64_t budget_bytes,
                                        double limit);

// belady: ignore kind/weights and use the offline optimum. substitute_alpha > 0 (with the
// trace's scores): each step's selections first go through plan_substitution against the
// cache as it is, as the runtime's decode does (hobbit-substitution.h). prefetch_layers > 0
// (with the trace's guesses): once a layer is served, the experts guessed for the next P
// layers are loaded into slots the layer has not pinned, as the runtime's decode prefetch
// does while the layer computes
cache_sim_result cache_simulate(const cache_sim_trace & trace, int n_slot, bool belady, cache_policy_kind kind,
                                const cache_policy_weights & weights, uint64_t seed, double low_miss_cost,
                                float substitute_alpha = 0.0f);

// a run's routing as the runtime served it, ubatch by ubatch
struct cache_replay_trace {
    int32_t n_tokens, n_layer, n_expert, n_expert_used; // n_layer: the model's MoE layers, in order
    const int32_t * experts;      // [n_tokens][n_layer][n_expert_used]; -1 = none
    const float *   weights;      // [n_tokens][n_layer][n_expert_used] their gate weights (which level each wants)
    const uint8_t * ubatch_start; // [n_tokens] 1 where a ubatch begins; NULL: every token its own
    const uint8_t * seq_start;    // [n_tokens] 1 where a sequence begins (new_sequence); may be NULL
};

// what a runtime made of levels and params counts serving the trace: its plan (plan_runtime), its
// cache driven as its dispatch drives it (the waves of each ubatch and layer, level by level
// where hits are exact, a prompt's next layer loaded whole, the warm-up), every load completing at
// once. Its counters and bytes (the runtime's, but for a prediction's queued read the runtime
// dropped when its layer did not select the expert: the replay reads it); throws hobbit_error for what the trace cannot replay (the decode
// prefetch and substitution, which need the router inputs and scores; computing in place, which
// depends on the page cache; neuron options) and for a trace of another shape
hobbit_stats cache_replay(const model_levels & levels, const hobbit_params & params, const cache_replay_trace & trace);
