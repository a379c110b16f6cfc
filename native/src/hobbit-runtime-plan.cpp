// hobbit-runtime-plan.cpp - the runtime's plan: the levels' files opened and checked, then from them and the
// params, values only: layers, thresholds, placement, popularity, level budgets and pools.

#include "hobbit-runtime-plan.h"

#include "hobbit-error.h"
#include "hobbit-executor-choice.h"
#include "hobbit-neuron-rows.h"
#include "hobbit-pool-plan.h"

#include "ggml.h"

#include <algorithm>
#include <cfloat>
#include <climits>

std::vector<const expert_index *> model_levels::in_order() const {
    std::vector<const expert_index *> out;
    for (int l = 0; l < n_level; ++l) {
        out.push_back(&level(l));
    }
    return out;
}

model_levels open_levels(const std::string & path, const hobbit_params & params) {
    model_levels levels{ expert_index::from_file(path), std::nullopt, {}, params.n_level };
    if (levels.index.info.n_layer_moe == 0) {
        throw hobbit_error(HOBBIT_STATUS_ERROR_NOT_MOE, path + ": the model has no routed experts (a dense model); nothing to offload");
    }
    if (params.level_paths[0] != nullptr && params.level_paths[0][0] != '\0') {
        levels.high.emplace(expert_index::from_file(params.level_paths[0]));
        if (levels.high->info.n_split > 1) {
            throw hobbit_error(HOBBIT_STATUS_ERROR_FORMAT, levels.high->path + ": split GGUF files cannot be companions");
        }
        levels.index.check_companion(*levels.high);
    }
    for (int l = 1; l < levels.n_level; ++l) {
        if (params.level_paths[l] == nullptr || params.level_paths[l][0] == '\0') {
            throw hobbit_error(HOBBIT_STATUS_ERROR_INVALID, "precision level " + std::to_string(l) + " has no file");
        }
        levels.companions.push_back(expert_index::from_file(params.level_paths[l]));
        if (levels.companions.back().info.n_split > 1) {
            throw hobbit_error(HOBBIT_STATUS_ERROR_FORMAT, levels.companions.back().path + ": split GGUF files cannot be companions");
        }
        levels.index.check_companion(levels.companions.back());
    }
    return levels;
}

namespace {

// what neuron sparsity and neuron-granular reads need of the model and the high level
bool check_neuron_options(const model_levels & levels, const hobbit_params & params, const std::vector<int> & moe_layers,
                          const std::string & path) {
    const expert_index & index = levels.index;
    // CORM's neuron sparsity zeroes a neuron's gate pre-activation (build_moe_ffn): a layer must have one
    if (params.neuron_threshold >= 0.0f) {
        for (int il : moe_layers) {
            if (!index.layers[il].proj[LLAMA_MOE_PROJ_GATE].present) {
                throw hobbit_error(HOBBIT_STATUS_ERROR_INVALID, path + ": layer " + std::to_string(il) + " has no separate "
                    "gate projection of its experts, which neuron sparsity (neuron_threshold) needs");
            }
        }
    }
    // neuron-granular reads (hobbit_params checked the threshold and the one level): the high level is
    // a neuron layout (up and down bundled by neuron) whose rows the runtime's own kernels multiply (Q8_0)
    if (!params.neuron_reads) {
        return false;
    }
    const std::optional<expert_index> & high = levels.high;
    if (!high || !high->neuron_layout) {
        throw hobbit_error(HOBBIT_STATUS_ERROR_INVALID, std::string(high ? high->path : "no file") + ": not a neuron "
            "layout; neuron-granular reads need the file `hobbitpy prepare --neuron-layout` writes");
    }
    for (int il : moe_layers) {
        const expert_layer_layout & l = high->layers[il];
        if (!l.proj[LLAMA_MOE_PROJ_GATE].present || !l.proj[LLAMA_MOE_PROJ_UP].present ||
            l.proj[LLAMA_MOE_PROJ_UP].type != GGML_TYPE_Q8_0) {
            throw hobbit_error(HOBBIT_STATUS_ERROR_FORMAT, high->path + ": layer " + std::to_string(il) + " needs separate "
                "gate and up projections, up and down bundled in Q8_0, for neuron-granular reads");
        }
    }
    return true;
}

// a static placement's level of every expert, copied and checked
std::vector<std::vector<int8_t>> take_placement(const hobbit_model_info & info, const hobbit_params & params, int n_level,
                                                const std::vector<int> & moe_layers, const std::string & path) {
    std::vector<std::vector<int8_t>> placement;
    if (params.expert_levels == nullptr) {
        return placement;
    }
    const int64_t n_want = (int64_t) moe_layers.size() * info.n_expert;
    if (params.n_expert_levels != n_want) {
        throw hobbit_error(HOBBIT_STATUS_ERROR_INVALID, path + ": a placement of " + std::to_string(params.n_expert_levels) +
            " experts was given; the model has " + std::to_string(n_want) + " (" + std::to_string(moe_layers.size()) +
            " MoE layers x " + std::to_string(info.n_expert) + " experts)");
    }
    placement.assign(info.n_layer, {});
    for (size_t i = 0; i < moe_layers.size(); ++i) {
        const int8_t * row = params.expert_levels + i * info.n_expert;
        for (int e = 0; e < info.n_expert; ++e) {
            if (row[e] < 0 || row[e] >= n_level) {
                throw hobbit_error(HOBBIT_STATUS_ERROR_INVALID, "the placement puts expert " + std::to_string(e) +
                    " of layer " + std::to_string(moe_layers[i]) + " at level " + std::to_string(row[e]) +
                    "; the levels are 0.." + std::to_string(n_level - 1));
            }
        }
        placement[moe_layers[i]].assign(row, row + info.n_expert);
    }
    return placement;
}

// a popularity profile (Fiddler), copied and checked
std::vector<float> take_popularity(const hobbit_model_info & info, const hobbit_params & params,
                                   const std::vector<int> & moe_layers, cache_policy_kind policy, const std::string & path) {
    std::vector<float> popularity;
    if (params.expert_popularity != nullptr) {
        const int64_t n_want = (int64_t) moe_layers.size() * info.n_expert;
        if (params.n_expert_popularity != n_want) {
            throw hobbit_error(HOBBIT_STATUS_ERROR_INVALID, path + ": a popularity profile of " +
                std::to_string(params.n_expert_popularity) + " experts was given; the model has " + std::to_string(n_want) +
                " (" + std::to_string(moe_layers.size()) + " MoE layers x " + std::to_string(info.n_expert) + " experts)");
        }
        popularity.assign((size_t) info.n_layer * info.n_expert, 0.0f);
        for (size_t i = 0; i < moe_layers.size(); ++i) {
            for (int e = 0; e < info.n_expert; ++e) {
                const float x = params.expert_popularity[i * info.n_expert + e];
                if (!(x >= 0.0f && x <= FLT_MAX)) {
                    throw hobbit_error(HOBBIT_STATUS_ERROR_INVALID, "the popularity profile gives expert " + std::to_string(e) +
                        " of layer " + std::to_string(moe_layers[i]) + " " + std::to_string(x) + "; it must be finite and >= 0");
                }
                popularity[(size_t) moe_layers[i] * info.n_expert + e] = x;
            }
        }
    }
    if (policy == cache_policy_kind::popularity && popularity.empty()) {
        throw hobbit_error(HOBBIT_STATUS_ERROR_INVALID, "the popularity policy needs a popularity profile (expert_popularity)");
    }
    return popularity;
}

// each level's share of the budget: by the placement's bytes, or by the shares asked for
std::vector<int64_t> level_budgets(const model_levels & levels, const hobbit_params & params, const runtime_plan & plan) {
    const hobbit_model_info & info = levels.index.info;
    const std::vector<const expert_index *> level_indexes = levels.in_order();
    if (!plan.placement.empty()) {
        std::vector<int64_t> placed_bytes(levels.n_level, 0);
        for (int il : plan.moe_layers) {
            for (int e = 0; e < info.n_expert; ++e) {
                const int l = plan.placement[il][e];
                placed_bytes[l] += (int64_t) levels.level(l).layers[il].n_bytes();
            }
        }
        return pool_plan_placed_budgets(level_indexes, params.budget_bytes, placed_bytes);
    }
    // Fate's share with a decode that wants the model's experts only: the low pool is the prompts'
    const float prompt_low_share = params.t1 >= 1.0f ? params.prefill_low_share : 0.0f;
    return pool_plan_level_budgets(level_indexes, params.budget_bytes, params.level_shares,
                                   params.shallow_layers >= 0 ? pool_plan_per_layer_min_bytes(levels.level(0)) : -1,
                                   prompt_low_share);
}

// every level's pools: one per expert signature, or (Fate) one per layer at the highest level
std::vector<planned_pool> plan_pools(const model_levels & levels, const hobbit_params & params, bool neuron_reads,
                                     const std::vector<int64_t> & budgets,
                                     const std::vector<std::vector<int8_t>> & placement) {
    const hobbit_model_info & info = levels.index.info;
    std::vector<planned_pool> pools;
    for (int l = 0; l < levels.n_level; ++l) {
        const expert_index & li = levels.level(l);
        // Fate's pool per layer holds the precision decode serves (the highest); a lower one
        // (the low copies of a prompt's least popular experts) is one pool shared by every layer
        std::vector<pool_plan_group> plan;
        if (params.shallow_layers >= 0 && l == 0) {
            plan = pool_plan_make_per_layer(li, budgets[l], params.shallow_layers);
        } else if (!placement.empty()) {
            std::vector<int> n_placed(info.n_layer, 0);
            for (int il = 0; il < info.n_layer && il < (int) placement.size(); ++il) {
                for (int8_t level : placement[il]) {
                    n_placed[il] += level == l;
                }
            }
            plan = pool_plan_make_placed(li, budgets[l], n_placed);
        } else {
            plan = pool_plan_make(li, budgets[l]);
        }
        int64_t planned = 0; // the bytes of the plan's whole slots: what a budget of rows shares out, with the rest
        for (const pool_plan_group & g : plan) {
            planned += g.n_slot * g.expert_bytes;
        }
        for (pool_plan_group & g : plan) {
            const expert_layer_layout & shape = li.layers[g.layers.front()];
            planned_pool pp;
            pp.cache.level        = l;
            pp.cache.type         = shape.proj[neuron_reads ? LLAMA_MOE_PROJ_UP : LLAMA_MOE_PROJ_DOWN].type; // a neuron layout's up holds down
            pp.cache.expert_bytes = g.expert_bytes;
            pp.cache.layers       = g.layers;
            pp.bytes              = g.n_slot * g.expert_bytes;
            if (neuron_reads) {
                // the group's bytes, its share of what whole slots left over too (rows are smaller
                // than experts), shared by gate slots and the pages of the row cache
                int64_t bytes = pp.bytes;
                bytes += planned > 0 ? (int64_t) ((double) (budgets[l] - planned) * (double) bytes / (double) planned) : 0;
                pp.n_ff      = (int) shape.proj[LLAMA_MOE_PROJ_GATE].ne[1];
                pp.row_bytes = shape.proj[LLAMA_MOE_PROJ_UP].n_bytes / (2 * pp.n_ff); // up holds down too
                if (!neuron_rows_split(bytes, (int64_t) shape.proj[LLAMA_MOE_PROJ_GATE].n_bytes, pp.n_ff, pp.row_bytes,
                                       std::min(g.n_slot, info.n_expert_used), (int) g.layers.size() * info.n_expert,
                                       g.n_slot, pp.n_page)) {
                    throw hobbit_error(HOBBIT_STATUS_ERROR_INTERNAL, "the pool plan left less than one token's experts");
                }
                pp.cache.expert_bytes = (int64_t) shape.proj[LLAMA_MOE_PROJ_GATE].n_bytes; // a slot's
                pp.bytes = g.n_slot * pp.cache.expert_bytes + 2 * pp.n_page * (int64_t) pp.row_bytes; // a page: one up row, one down column
            }
            pp.cache.n_slot = g.n_slot; // (neuron reads: as many gate slots as the row split gave)
            pools.push_back(std::move(pp));
        }
    }
    return pools;
}

} // namespace

runtime_plan plan_runtime(const model_levels & levels, const hobbit_params & params, const std::string & path) {
    const hobbit_model_info & info = levels.index.info;
    runtime_plan plan;
    plan.thresholds = { levels.n_level, params.t1, params.t_mid, params.t2,
                        levels.n_level > 1 ? params.prefill_low_share : 0.0f, params.skip_cached };
    plan.hit_policy = params.hit_policy;
    // auto and balanced choose between loading a miss and computing it in place by timings they
    // measure (bandwidths, what the page cache holds), so what the pools hold differs from run to
    // run; with several precisions a hit is then served at its wanted precision only (as
    // HOBBIT_HIT_EXACT), so that what is served, and the logits, stay a function of the text
    if (levels.n_level > 1 && (params.mode == HOBBIT_MODE_AUTO || params.mode == HOBBIT_MODE_BALANCED)) {
        plan.hit_policy = HOBBIT_HIT_EXACT;
    }
    if (!cache_policy_of(params.policy, plan.policy)) {
        throw hobbit_error(HOBBIT_STATUS_ERROR_INVALID, "unknown cache policy " + std::to_string((int) params.policy));
    }
    for (int il = 0; il < info.n_layer; ++il) {
        if (levels.index.layers[il].has_experts()) {
            plan.moe_layers.push_back(il);
        }
    }
    plan.neuron_reads = check_neuron_options(levels, params, plan.moe_layers, path);
    plan.placement    = take_placement(info, params, levels.n_level, plan.moe_layers, path);
    plan.popularity   = take_popularity(info, params, plan.moe_layers, plan.policy, path);
    plan.pools        = plan_pools(levels, params, plan.neuron_reads, level_budgets(levels, params, plan), plan.placement);
    for (const planned_pool & pp : plan.pools) {
        plan.pool_bytes += pp.bytes;
        plan.n_slot     += pp.cache.n_slot;
    }
    // with one level of the model's own experts a miss is served as well from the file, so the
    // pools fill as the run goes; a popularity profile says what deserves them from the start
    // (a neuron layout is the model's own experts, read as needed); with several levels and warm_low
    // off a profile still fills the highest level's pools (the lowest's is left to the selections
    // that want it)
    if (params.warm_low && (levels.n_level > 1 || (levels.high && !plan.neuron_reads) || !plan.popularity.empty())) {
        plan.warm_deepest = levels.n_level - 1;
    } else if (!plan.popularity.empty() && levels.n_level > 1) {
        plan.warm_deepest = 0;
    }
    return plan;
}

std::vector<std::pair<int, int>> runtime_plan::warm_order(int n_expert) const {
    // the lowest level is filled first (expert_cache::warm): a copy of every expert in memory is
    // what spares a decode the disk; expert by expert across the layers, so a pool too small for
    // all of them still holds some of every layer; with a popularity profile the most popular
    // experts of any layer first (Fiddler's placement: they are the ones its policy keeps)
    std::vector<std::pair<int, int>> order; // (layer, expert)
    for (int e = 0; e < n_expert; ++e) {
        for (int il : moe_layers) {
            order.emplace_back(il, e);
        }
    }
    if (!popularity.empty()) {
        std::stable_sort(order.begin(), order.end(), [&](const std::pair<int, int> & a, const std::pair<int, int> & b) {
            return popularity[(size_t) a.first * n_expert + a.second] > popularity[(size_t) b.first * n_expert + b.second];
        });
    }
    return order;
}

expert_cache_setup runtime_plan::cache_setup(const model_levels & levels, const hobbit_params & params) const {
    const hobbit_model_info & info = levels.index.info;
    expert_cache_setup setup;
    setup.n_layer        = info.n_layer;
    setup.n_expert       = info.n_expert;
    setup.n_expert_used  = info.n_expert_used;
    setup.n_level        = levels.n_level;
    setup.moe_layers     = moe_layers;
    for (const planned_pool & pp : pools) {
        setup.pools.push_back(pp.cache);
    }
    setup.policy         = policy;
    setup.policy_weights = { params.policy_weights.lru, params.policy_weights.lfu,
                             params.policy_weights.lhu, params.policy_weights.fld };
    setup.seed           = params.seed;
    setup.popularity     = popularity.empty() ? nullptr : popularity.data();
    setup.hit_policy     = hit_policy;
    setup.skip_cached    = thresholds.skip_cached;
    setup.level_waves    = levels.n_level > 1 && hit_policy == HOBBIT_HIT_EXACT && placement.empty() &&
                           thresholds.prefill_low_share == 0.0f && !neuron_reads;
    if (neuron_reads) {
        // a wave's experts need their kept rows at once: no more than the pages hold whole
        setup.wave_limit.assign(info.n_layer, INT_MAX);
        for (const planned_pool & pp : pools) {
            for (int il : pp.cache.layers) {
                if (pp.cache.level == 0) {
                    setup.wave_limit[il] = (int) (pp.n_page / pp.n_ff);
                }
            }
        }
    }
    return setup;
}

std::vector<bool> plan_inplace_layers(const model_levels & levels, const runtime_plan & plan, const hobbit_params & params,
                                      bool model_mapped, const std::function<bool(int)> & pool_repacked) {
    const hobbit_model_info & info = levels.index.info;
    // in place runs the model's own mapped weights with stock's kernels: only where the CPU
    // does not repack that type on load (a repacked pool computes with other kernels), and,
    // unless cooperative mode was asked for, only where the page cache has room for what it
    // faults in once the pools are full. Otherwise a ubatch wider than the pools runs in
    // waves through them: computing its overflow in place under a tight cap made the process
    // reach its cap 298 k times with a pool per layer on ref-mixtral at 0.55 (a 128-token
    // prompt 4x slower), and a shared pool at 0.30 231 k times
    std::vector<bool> inplace_ok(info.n_layer, false);
    for (int il : plan.moe_layers) {
        bool repacked = false; // the model's own pool: the level-0 one serving il
        for (size_t p = 0; p < plan.pools.size(); ++p) {
            const cache_pool_setup & pool = plan.pools[p].cache;
            if (pool.level == 0 && std::count(pool.layers.begin(), pool.layers.end(), il) > 0) {
                repacked = pool_repacked((int) p);
            }
        }
        // with a companion as the high level the model's experts are another precision than asked for
        const int64_t layer_bytes = (int64_t) levels.index.layers[il].n_bytes() * info.n_expert;
        inplace_ok[il] = model_mapped && !levels.high && !repacked &&
                         (params.mode == HOBBIT_MODE_COOPERATIVE ||
                          page_cache_holds_two_layers(layer_bytes, params.page_cache_room_bytes));
    }
    return inplace_ok;
}
