#include "hobbit-runtime.h"

#include "hobbit-error.h"
#include "hobbit-neuron-reads.h"
#include "hobbit-params.h"
#include "hobbit-substitution.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cfloat>
#include <chrono>
#include <climits>
#include <cstdint>
#include <cmath>
#include <cstring>
#include <map>
#include <numeric>

// every MoE layer's router as floats, whatever its type and wherever it lives
std::vector<router_weights> load_routers(const llama_model * model, const std::vector<int> & moe_layers) {
    std::vector<router_weights> routers;
    for (int il : moe_layers) {
        const ggml_tensor * t = llama_model_get_router_tensor(model, il);
        if (t == nullptr) {
            continue;
        }
        std::vector<uint8_t> raw(ggml_nbytes(t));
        ggml_backend_tensor_get(t, raw.data(), 0, raw.size());
        router_weights r;
        r.il = il;
        r.w.resize(ggml_nelements(t));
        if (t->type == GGML_TYPE_F32) {
            memcpy(r.w.data(), raw.data(), raw.size());
        } else {
            const auto * traits = ggml_get_type_traits(t->type);
            if (traits->to_float == nullptr) {
                throw hobbit_error(HOBBIT_STATUS_ERROR_FORMAT, std::string("router ") + t->name + " has a type that cannot be read as floats");
            }
            traits->to_float(raw.data(), r.w.data(), ggml_nelements(t));
        }
        routers.push_back(std::move(r));
    }
    return routers;
}

hobbit_runtime::hobbit_runtime(const llama_model * model, const std::string & path, const hobbit_params & params)
        : index(expert_index::from_file(path)), params(params), model(model) {
    const std::string problem = params_problem(params); // hobbit_request_offload checked them too; other callers may not
    if (!problem.empty()) {
        throw hobbit_error(HOBBIT_STATUS_ERROR_INVALID, problem);
    }
    open_levels(path);
    const cache_policy_kind policy_kind = parse_policy();
    find_moe_layers(path);
    check_neuron_options(path);
    take_placement(path);
    take_popularity(path, policy_kind);
    const std::vector<int64_t> budgets = level_budgets();
    choose_pool_device();
    std::vector<cache_pool_setup> pool_setups = make_pools(budgets);
    choose_executor(pool_setups);
    int64_t n_slot_total = 0;
    for (const cache_pool_setup & ps : pool_setups) {
        n_slot_total += ps.n_slot;
    }
    make_cache(std::move(pool_setups), policy_kind);
    make_predictor();
    make_io();
    describe_layers();

    stats_.budget_bytes = params.budget_bytes;
    stats_.n_slot       = (int32_t) n_slot_total;
    stats_.direct_io    = io->direct_io();
    stats_.n_level      = n_level;

    // with one level of the model's own experts a miss is served as well from the file, so the
    // pools fill as the run goes; a popularity profile says what deserves them from the start
    // (a neuron layout is the model's own experts, read as needed)
    if (params.warm_low && (n_level > 1 || (high && !neuron_reads) || !popularity.empty())) {
        warm_pools();
    }
}

// the levels' files (the high one, the companions), each checked against the model; the thresholds
void hobbit_runtime::open_levels(const std::string & path) {
    const hobbit_model_info & info = index.info;
    if (info.n_layer_moe == 0) {
        throw hobbit_error(HOBBIT_STATUS_ERROR_NOT_MOE, path + ": the model has no routed experts (a dense model); nothing to offload");
    }
    n_level = params.n_level;
    if (params.level_paths[0] != nullptr && params.level_paths[0][0] != '\0') {
        high.emplace(expert_index::from_file(params.level_paths[0]));
        if (high->info.n_split > 1) {
            throw hobbit_error(HOBBIT_STATUS_ERROR_FORMAT, high->path + ": split GGUF files cannot be companions");
        }
        index.check_companion(*high);
    }
    for (int l = 1; l < n_level; ++l) {
        if (params.level_paths[l] == nullptr || params.level_paths[l][0] == '\0') {
            throw hobbit_error(HOBBIT_STATUS_ERROR_INVALID, "precision level " + std::to_string(l) + " has no file");
        }
        companions.push_back(expert_index::from_file(params.level_paths[l]));
        if (companions.back().info.n_split > 1) {
            throw hobbit_error(HOBBIT_STATUS_ERROR_FORMAT, companions.back().path + ": split GGUF files cannot be companions");
        }
        index.check_companion(companions.back());
    }
    thresholds = { n_level, params.t1, params.t_mid, params.t2, n_level > 1 ? params.prefill_low_share : 0.0f,
                   params.skip_cached };
    // auto and balanced choose between loading a miss and computing it in place by timings they
    // measure (bandwidths, what the page cache holds), so what the pools hold differs from run to
    // run; with several precisions a hit is then served at its wanted precision only (as
    // HOBBIT_HIT_EXACT), so that what is served, and the logits, stay a function of the text
    if (n_level > 1 && (params.mode == HOBBIT_MODE_AUTO || params.mode == HOBBIT_MODE_BALANCED)) {
        params.hit_policy = HOBBIT_HIT_EXACT;
    }
}

// the cache policy hobbit.h names
cache_policy_kind hobbit_runtime::parse_policy() const {
    cache_policy_kind policy_kind;
    if (!cache_policy_of(params.policy, policy_kind)) {
        throw hobbit_error(HOBBIT_STATUS_ERROR_INVALID, "unknown cache policy " + std::to_string((int) params.policy));
    }
    return policy_kind;
}

// the MoE layers, and the model's expert tensors exactly as the file index describes them
void hobbit_runtime::find_moe_layers(const std::string & path) {
    const hobbit_model_info & info = index.info;
    for (int il = 0; il < info.n_layer; ++il) {
        if (index.layers[il].has_experts()) {
            moe_layers.push_back(il);
        }
    }

    // the model must hold exactly the tensors the file index describes
    if (model != nullptr) {
        for (int il : moe_layers) {
            for (int p = 0; p < LLAMA_MOE_PROJ_COUNT; ++p) {
                const ggml_tensor * t = llama_model_get_expert_tensor(model, il, (llama_moe_proj) p);
                const expert_proj_layout & pl = index.layers[il].proj[p];
                if ((t != nullptr) != pl.present || (t && (t->type != pl.type || t->ne[0] != pl.ne[0] || t->ne[1] != pl.ne[1] || t->ne[2] != pl.ne[2]))) {
                    throw hobbit_error(HOBBIT_STATUS_ERROR_FORMAT, path + ": layer " + std::to_string(il) +
                        ": the loaded expert tensors do not match the file's");
                }
            }
        }
    }

}

// what neuron sparsity and neuron-granular reads need of the model and the high level
void hobbit_runtime::check_neuron_options(const std::string & path) {
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
    neuron_reads = params.neuron_reads;
    if (neuron_reads) {
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
    }
}

// a static placement's level of every expert, copied and checked
void hobbit_runtime::take_placement(const std::string & path) {
    const hobbit_model_info & info = index.info;
    if (params.expert_levels != nullptr) {
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
    }
    this->params.expert_levels   = nullptr; // the caller's copy is reused by the next request: placement holds it
    this->params.n_expert_levels = 0;
}

// a popularity profile (Fiddler), copied and checked; the policies that read it or the scores
void hobbit_runtime::take_popularity(const std::string & path, cache_policy_kind policy_kind) {
    const hobbit_model_info & info = index.info;
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
    if (policy_kind == cache_policy_kind::popularity && popularity.empty()) {
        throw hobbit_error(HOBBIT_STATUS_ERROR_INVALID, "the popularity policy needs a popularity profile (expert_popularity)");
    }
    this->params.expert_popularity   = nullptr; // copied into popularity
    this->params.n_expert_popularity = 0;
}

// every level's file, high to low
std::vector<const expert_index *> hobbit_runtime::levels_in_order() const {
    std::vector<const expert_index *> level_indexes;
    for (int l = 0; l < n_level; ++l) {
        level_indexes.push_back(&level_index(l));
    }
    return level_indexes;
}

// each level's share of the budget: by the placement's bytes, or by the shares asked for
std::vector<int64_t> hobbit_runtime::level_budgets() const {
    const hobbit_model_info & info = index.info;
    const std::vector<const expert_index *> level_indexes = levels_in_order();
    std::vector<int64_t> budgets;
    if (!placement.empty()) {
        std::vector<int64_t> placed_bytes(n_level, 0);
        for (int il : moe_layers) {
            for (int e = 0; e < info.n_expert; ++e) {
                placed_bytes[placement[il][e]] += (int64_t) level_index(placement[il][e]).layers[il].n_bytes();
            }
        }
        budgets = pool_plan_placed_budgets(level_indexes, params.budget_bytes, placed_bytes);
    } else {
        // Fate's share with a decode that wants the model's experts only: the low pool is the prompts'
        const float prompt_low_share = params.t1 >= 1.0f ? params.prefill_low_share : 0.0f;
        budgets = pool_plan_level_budgets(level_indexes, params.budget_bytes, params.level_shares,
                                          params.shallow_layers >= 0 ? pool_plan_per_layer_min_bytes(level_index(0)) : -1,
                                          prompt_low_share);
    }
    return budgets;
}

// where the pools live, and a device's budget checked against its free memory
void hobbit_runtime::choose_pool_device() {
    // the pools live on the GPU when there is one (HOBBIT §4), in its memory: on a discrete
    // GPU that memory, not the host's, must hold the budget
    pool_dev = neuron_reads ? ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU) : expert_pool_device(); // the CPU runs the neuron ops
    if (ggml_backend_dev_type(pool_dev) != GGML_BACKEND_DEVICE_TYPE_CPU) {
        size_t free = 0, total = 0;
        ggml_backend_dev_memory(pool_dev, &free, &total);
        if (free > 0 && (size_t) params.budget_bytes > free) {
            throw hobbit_error(HOBBIT_STATUS_ERROR_BUDGET, "the expert budget (" + std::to_string(params.budget_bytes >> 20) +
                " MB) is more than " + ggml_backend_dev_name(pool_dev) + " has free (" + std::to_string(free >> 20) +
                " MB); give a smaller cache");
        }
    }
}

// every level's pools (one per expert signature, or per layer): their tensors and row caches made, the
// cache's pools planned
std::vector<cache_pool_setup> hobbit_runtime::make_pools(const std::vector<int64_t> & budgets) {
    const hobbit_model_info & info = index.info;
    std::vector<cache_pool_setup> setups;
    for (int l = 0; l < n_level; ++l) {
        const expert_index & li = level_index(l);
        // Fate's pool per layer holds the precision decode serves (the highest); a lower one
        // (the low copies of a prompt's least popular experts) is one pool shared by every layer
        std::vector<pool_plan_group> plan = params.shallow_layers >= 0 && l == 0
            ? pool_plan_make_per_layer(li, budgets[l], params.shallow_layers) : pool_plan_make(li, budgets[l]);
        int64_t planned = 0; // the bytes of the plan's whole slots: what a budget of rows shares out, with the rest
        for (const pool_plan_group & g : plan) {
            planned += g.n_slot * g.expert_bytes;
        }
        for (pool_plan_group & g : plan) {
            const expert_layer_layout & shape = li.layers[g.layers.front()];
            cache_pool_setup ps;
            ps.level        = l;
            ps.type         = shape.proj[neuron_reads ? LLAMA_MOE_PROJ_UP : LLAMA_MOE_PROJ_DOWN].type; // a neuron layout's up holds down
            ps.expert_bytes = g.expert_bytes;
            ps.layers       = g.layers;
            int64_t bytes   = g.n_slot * g.expert_bytes;
            std::unique_ptr<neuron_row_cache> rows;
            if (neuron_reads) {
                // the group's bytes, its share of what whole slots left over too (rows are smaller
                // than experts), shared by gate slots and the pages of the row cache
                bytes += planned > 0 ? (int64_t) ((double) (budgets[l] - planned) * (double) bytes / (double) planned) : 0;
                const int n_ff = (int) shape.proj[LLAMA_MOE_PROJ_GATE].ne[1];
                const uint64_t row_bytes = shape.proj[LLAMA_MOE_PROJ_UP].n_bytes / (2 * n_ff); // up holds down too
                int64_t n_page = 0;
                if (!neuron_rows_split(bytes, (int64_t) shape.proj[LLAMA_MOE_PROJ_GATE].n_bytes, n_ff, row_bytes,
                                       std::min(g.n_slot, info.n_expert_used), (int) g.layers.size() * info.n_expert,
                                       g.n_slot, n_page)) {
                    throw hobbit_error(HOBBIT_STATUS_ERROR_INTERNAL, "the pool plan left less than one token's experts");
                }
                rows = std::make_unique<neuron_row_cache>(n_ff, row_bytes, n_page, params.neuron_bridge);
                ps.expert_bytes = (int64_t) shape.proj[LLAMA_MOE_PROJ_GATE].n_bytes; // a slot's
                bytes = g.n_slot * ps.expert_bytes + rows->bytes();
            }
            ps.n_slot = g.n_slot; // (neuron reads: as many gate slots as the row split gave)
            pool_tensors.push_back(std::make_unique<expert_pool>(shape, info.n_expert_used, g.n_slot, pool_dev,
                                                                 /*gate_only*/ neuron_reads));
            row_caches.push_back(std::move(rows));
            stats_.pool_bytes += bytes;
            setups.push_back(std::move(ps));
        }
    }
    return setups;
}

// which layers may compute a miss in place, and the executor choice (mode, latency model)
void hobbit_runtime::choose_executor(const std::vector<cache_pool_setup> & pools) {
    const hobbit_model_info & info = index.info;
    // in place runs the model's own mapped weights with stock's kernels: only where the CPU
    // does not repack that type on load (a repacked pool computes with other kernels), and,
    // unless cooperative mode was asked for, only where the page cache has room for what it
    // faults in once the pools are full. Otherwise a ubatch wider than the pools runs in
    // waves through them: computing its overflow in place under a tight cap made the process
    // reach its cap 298 k times with a pool per layer on ref-mixtral at 0.55 (a 128-token
    // prompt 4x slower), and a shared pool at 0.30 231 k times
    inplace_ok.assign(info.n_layer, false);
    bool any_inplace = false;
    for (int il : moe_layers) {
        // with a companion as the high level the model's experts are another precision than asked for
        const int64_t layer_bytes = (int64_t) index.layers[il].n_bytes() * info.n_expert;
        // the model's own pool: the level-0 one serving il
        bool repacked = false;
        for (size_t p = 0; p < pools.size(); ++p) {
            if (pools[p].level == 0 && std::count(pools[p].layers.begin(), pools[p].layers.end(), il) > 0) {
                repacked = pool_tensors[p]->repacked();
            }
        }
        inplace_ok[il] = model != nullptr && !high && !repacked &&
                         (params.mode == HOBBIT_MODE_COOPERATIVE ||
                          page_cache_holds_two_layers(layer_bytes, params.page_cache_room_bytes));
        any_inplace = any_inplace || inplace_ok[il];
    }
    executor = executor_choice_make(index, params.mode, any_inplace, params.direct_io);
    if (model != nullptr) {
        advise_mapping_random();
        open_and_guard_parts();
    }
    stats_.mode             = any_inplace ? params.mode : HOBBIT_MODE_GPU_CENTRIC;
    stats_.load_bytes_per_s = executor.load_bytes_per_s;
    stats_.map_bytes_per_s  = executor.map_bytes_per_s;
}

// the expert cache over the planned pools: its policies, its hit rule, where its waves may run in place
void hobbit_runtime::make_cache(std::vector<cache_pool_setup> pools, cache_policy_kind policy_kind) {
    const hobbit_model_info & info = index.info;
    expert_cache_setup setup;
    setup.n_layer        = info.n_layer;
    setup.n_expert       = info.n_expert;
    setup.n_expert_used  = info.n_expert_used;
    setup.n_level        = n_level;
    setup.moe_layers     = moe_layers;
    setup.pools          = std::move(pools);
    setup.policy         = policy_kind;
    setup.policy_weights = { params.policy_weights.lru, params.policy_weights.lfu,
                             params.policy_weights.lhu, params.policy_weights.fld };
    setup.seed           = params.seed;
    setup.popularity     = popularity.empty() ? nullptr : popularity.data();
    setup.hit_policy     = params.hit_policy;
    setup.skip_cached    = thresholds.skip_cached;
    setup.level_waves    = n_level > 1 && params.hit_policy == HOBBIT_HIT_EXACT && placement.empty() &&
                           thresholds.prefill_low_share == 0.0f && !neuron_reads;
    setup.inplace_ok     = inplace_ok;
    // experts run in place only when a ubatch selects more pairs than the pools hold,
    // and never when the model's pool is repacked: the mapped original would take other
    // kernels than stock, so such a ubatch runs in waves instead (n_waves)
    setup.inplace_any_width = params.mode != HOBBIT_MODE_GPU_CENTRIC;
    if (neuron_reads) {
        // a wave's experts need their kept rows at once: no more than the pages hold whole
        setup.wave_limit.assign(info.n_layer, INT_MAX);
        for (size_t p = 0; p < setup.pools.size(); ++p) {
            for (int il : setup.pools[p].layers) {
                if (setup.pools[p].level == 0) {
                    setup.wave_limit[il] = (int) (row_caches[p]->n_page() / row_caches[p]->n_ff());
                }
            }
        }
    }
    cache = std::make_unique<expert_cache>(setup, static_cast<cache_env &>(*this));
}

// HOBBIT's stacked gates for the decode prefetch
void hobbit_runtime::make_predictor() {
    const hobbit_model_info & info = index.info;
    if (params.prefetch_layers > 0 && model != nullptr) {
        // a width past the model's experts names them all
        int width = params.prefetch_width == HOBBIT_PREFETCH_WIDTH_FATE
            ? std::min(std::max(info.n_expert_used + 1, (info.n_expert + 3) / 4), info.n_expert)
            : params.prefetch_width > 0 ? std::min(params.prefetch_width, info.n_expert) : info.n_expert_used;
        if (params.substitute_alpha > 0.0f) {
            width = std::max(width, std::min(info.n_expert_used + 1, info.n_expert)); // β, to tell the top scores
        }
        predictor = predictor_make_stacked_gates(load_routers(model, moe_layers), info.n_embd, width,
                                                 params.prefetch_layers);
    }
}

// the I/O threads over every level's file
void hobbit_runtime::make_io() {
    const std::vector<const expert_index *> level_indexes = levels_in_order();
    // loads into device pools are staged in the device's page-locked host memory (disk ->
    // pinned -> device, HOBBIT §4), each I/O thread copying on its own stream
    ggml_backend_buffer_type_t pinned = ggml_backend_dev_type(pool_dev) != GGML_BACKEND_DEVICE_TYPE_CPU
        ? ggml_backend_dev_host_buffer_type(pool_dev) : nullptr;
    io = std::make_unique<io_scheduler>(level_indexes, params.direct_io, params.n_io_threads,
        [this](const load_task & t, const std::string & err, uint64_t n, int64_t us) { on_load_done(t, err, n, us); },
        pinned, neuron_reads ? params.n_row_readers : 0);
}

// the offload description llama.cpp's graph reads: per MoE layer, its dispatch ops, pools and neuron ops
void hobbit_runtime::describe_layers() {
    const hobbit_model_info & info = index.info;
    dispatch_uds.resize((size_t) info.n_layer * LLAMA_MOE_MAX_WAVES);
    layers.resize(info.n_layer);
    for (int il : moe_layers) {
        llama_moe_offload_layer & lo = layers[il];
        for (int w = 0; w < LLAMA_MOE_MAX_WAVES; ++w) {
            dispatch_ud & d = dispatch_uds[(size_t) il * LLAMA_MOE_MAX_WAVES + w];
            d = { this, il, w };
            lo.dispatch_ud[w] = &d;
        }
        lo.n_waves = &hobbit_runtime::n_waves_op;
        lo.ctx     = lo.dispatch_ud[0];
        lo.n_pool  = n_level; // one mul_mat_id pass per precision
        for (int l = 0; l < n_level; ++l) {
            const expert_pool & pool = *pool_tensors[cache->pool_of(l, il)];
            for (int p = 0; p < LLAMA_MOE_PROJ_COUNT; ++p) {
                lo.pools[l].w[p] = pool.weights(p);
            }
            lo.pools[l].n_slot = pool.n_slot();
        }
        lo.inplace_min_pairs = cache->inplace_min_pairs(il);
        lo.dispatch    = &hobbit_runtime::dispatch_op;
        lo.neuron_sparse    = params.neuron_threshold >= 0.0f && !neuron_reads;
        lo.neuron_threshold = params.neuron_threshold;
        lo.neuron_limit     = params.neuron_limit;
        lo.neuron_count     = &hobbit_runtime::neuron_count_op;
        lo.neuron_count_ud  = this;
        if (neuron_reads) {
            lo.neuron_fetch    = &hobbit_runtime::neuron_fetch_op;
            lo.neuron_fetch_ud = lo.dispatch_ud[0];
            lo.neuron_up       = &hobbit_runtime::neuron_up_op;
            lo.neuron_up_ud    = this;
            lo.neuron_down     = &hobbit_runtime::neuron_down_op;
            lo.neuron_down_ud  = this;
        }
    }
    offload_desc.n_layer  = info.n_layer;
    offload_desc.layers   = layers.data();
    offload_desc.ctx      = this;
    offload_desc.free_ctx = [](void * ctx) { delete (hobbit_runtime *) ctx; };
}

void hobbit_runtime::warm_pools() {
    // the lowest level first (a copy of every expert in memory is what spares a decode the
    // disk), then the free slots of the higher levels; expert by expert across the layers,
    // so a pool too small for all of them still holds some of every layer; with a popularity
    // profile the most popular experts of any layer first (Fiddler's placement: they are the
    // ones its policy keeps). With a static placement each expert only at its own level.
    // On-demand loads overtake these (they are background loads).
    std::vector<std::pair<int, int>> order; // (layer, expert)
    for (int e = 0; e < index.info.n_expert; ++e) {
        for (int il : moe_layers) {
            order.emplace_back(il, e);
        }
    }
    if (!popularity.empty()) {
        const int n_expert = index.info.n_expert;
        std::stable_sort(order.begin(), order.end(), [&](const std::pair<int, int> & a, const std::pair<int, int> & b) {
            return popularity[a.first * n_expert + a.second] > popularity[b.first * n_expert + b.second];
        });
    }
    std::vector<load_task> loads;
    cache->warm(order, [&](int il) { return placed(il); }, loads);
    submit(loads);
}

hobbit_runtime::~hobbit_runtime() {
    io.reset(); // stop the I/O thread before the pool it writes into goes away
    for (const part_file & f : part_files) {
        if (f.fd >= 0) {
            close(f.fd);
        }
    }
}
