// hobbit-runtime-plan.h - what a runtime will be, decided before anything is made: the model's
// experts at each precision level (their files opened and checked), and from them and the
// params a plan of values: the MoE layers, the thresholds and the hit rule, a static placement or
// a popularity profile copied and checked, each level's budget and its pools (with neuron reads,
// each pool's gate slots and row pages). The runtime then makes what the plan says.
#pragma once

#include "hobbit-cache-policy.h"
#include "hobbit-expert-cache.h"
#include "hobbit-expert-store.h"
#include "hobbit-precision-scorer.h"

#include "hobbit.h"

#include <functional>
#include <optional>
#include <string>
#include <vector>

// the model's experts at every precision level
struct model_levels {
    expert_index index;                    // the model: level 0, the high precision, unless high is set
    std::optional<expert_index> high;      // a companion as level 0 (a precision ladder): the model's experts are not read
    std::vector<expert_index> companions;  // levels 1..n_level-1: the same experts at lower precisions
    int n_level = 1;

    const expert_index & level(int l) const { return l > 0 ? companions[l - 1] : high ? *high : index; }
    std::vector<const expert_index *> in_order() const; // every level's file, high to low
};

// the model's file and the levels' files params names (the high one, the companions), each
// checked against the model; throws hobbit_error (a dense model, a split companion, a level without a file)
model_levels open_levels(const std::string & path, const hobbit_params & params);

// one pool of the plan
struct planned_pool {
    cache_pool_setup cache;     // its level, layers, slots
    int64_t bytes = 0;          // what it takes of the budget
    // neuron reads: the row cache beside its gate slots (n_page 0: none)
    int      n_ff = 0;
    uint64_t row_bytes = 0;
    int64_t  n_page = 0;
};

struct runtime_plan {
    precision_thresholds thresholds;       // which level a selection wants (HOBBIT eq. 2)
    int hit_policy = HOBBIT_HIT_FOUND;     // as params asks, or exact where the executor measures timings
    cache_policy_kind policy = cache_policy_kind::lru;
    std::vector<int> moe_layers;
    std::vector<std::vector<int8_t>> placement; // [n_layer][n_expert]: a static placement's level of each expert (empty: none)
    std::vector<float> popularity;              // [n_layer * n_expert]: a popularity profile (Fiddler), 0 off the MoE layers (empty: none)
    bool neuron_reads = false;
    std::vector<planned_pool> pools;
    int64_t pool_bytes = 0;                     // every pool's
    int64_t n_slot = 0;                         // every pool's
    // the pools filled in the background from the start, levels warm_deepest up to 0 (-1: none):
    // every level with params.warm_low where a miss is not served as well from the model's file
    // (several levels, a high companion, a popularity profile); else with a profile the highest
    // level alone (its popular experts are what a frequency or popularity policy keeps), in this
    // order of (layer, expert): across the layers expert by expert, the most popular first with a profile
    int warm_deepest = -1;
    std::vector<std::pair<int, int>> warm_order(int n_expert) const;

    // the static placement's levels of layer il's experts, or nullptr (the thresholds decide)
    const int8_t * placed(int il) const { return placement.empty() ? nullptr : placement[il].data(); }
    // the expert cache's setup for this plan; inplace_ok / inplace_any_width are the executor's, left to the runtime
    expert_cache_setup cache_setup(const model_levels & levels, const hobbit_params & params) const;
};

// path names the model in messages; throws hobbit_error on a placement, profile or neuron option that does
// not fit the model, or a policy it does not know
runtime_plan plan_runtime(const model_levels & levels, const hobbit_params & params, const std::string & path);

// [n_layer] whether a layer's misses may run on the mapped model (in place): model_mapped, the
// model's own experts as level 0 (no high companion), its level-0 pool not repacked
// (pool_repacked(p): plan.pools[p] stores a projection repacked), and cooperative mode or room in
// the page cache for two layers of experts
std::vector<bool> plan_inplace_layers(const model_levels & levels, const runtime_plan & plan, const hobbit_params & params,
                                      bool model_mapped, const std::function<bool(int)> & pool_repacked);
