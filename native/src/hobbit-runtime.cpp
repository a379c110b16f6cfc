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

// params as given, once params_problem finds nothing wrong (hobbit_request_offload checked them too; other
// callers may not)
static const hobbit_params & checked(const hobbit_params & params) {
    const std::string problem = params_problem(params);
    if (!problem.empty()) {
        throw hobbit_error(HOBBIT_STATUS_ERROR_INVALID, problem);
    }
    return params;
}

hobbit_runtime::hobbit_runtime(const llama_model * model, const std::string & path, const hobbit_params & params)
        : levels(open_levels(path, checked(params))), params(params), files(model) {
    plan = plan_runtime(levels, params, path);
    // the plan holds what the caller's arrays said: its copies are reused by the next request
    this->params.expert_levels       = nullptr;
    this->params.n_expert_levels     = 0;
    this->params.expert_popularity   = nullptr;
    this->params.n_expert_popularity = 0;
    check_model_tensors(path);
    choose_pool_device();
    make_pools();
    choose_executor();
    if (model != nullptr) {
        files.open(levels.index, plan.moe_layers); // for the run: guarded, checked before each ubatch
    }
    make_cache();
    make_predictor();
    make_io();
    describe_layers();

    stats_.budget_bytes = params.budget_bytes;
    stats_.pool_bytes   = plan.pool_bytes;
    stats_.n_slot       = (int32_t) plan.n_slot;
    stats_.direct_io    = io->direct_io();
    stats_.n_level      = levels.n_level;

    if (plan.warm_deepest >= 0) {
        warm_pools();
    }
}

// the model holds exactly the expert tensors the file index describes
void hobbit_runtime::check_model_tensors(const std::string & path) {
    if (files.model() == nullptr) {
        return;
    }
    for (int il : plan.moe_layers) {
        for (int p = 0; p < LLAMA_MOE_PROJ_COUNT; ++p) {
            const ggml_tensor * t = llama_model_get_expert_tensor(files.model(), il, (llama_moe_proj) p);
            const expert_proj_layout & pl = levels.index.layers[il].proj[p];
            if ((t != nullptr) != pl.present || (t && (t->type != pl.type || t->ne[0] != pl.ne[0] || t->ne[1] != pl.ne[1] || t->ne[2] != pl.ne[2]))) {
                throw hobbit_error(HOBBIT_STATUS_ERROR_FORMAT, path + ": layer " + std::to_string(il) +
                    ": the loaded expert tensors do not match the file's");
            }
        }
    }
}

// where the pools live, and a device's budget checked against its free memory
void hobbit_runtime::choose_pool_device() {
    // the pools live on the GPU when there is one (HOBBIT §4), in its memory: on a discrete
    // GPU that memory, not the host's, must hold the budget
    pools.dev = plan.neuron_reads ? ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU) : expert_pool_device(); // the CPU runs the neuron ops
    if (ggml_backend_dev_type(pools.dev) != GGML_BACKEND_DEVICE_TYPE_CPU) {
        size_t free = 0, total = 0;
        ggml_backend_dev_memory(pools.dev, &free, &total);
        if (free > 0 && (size_t) params.budget_bytes > free) {
            throw hobbit_error(HOBBIT_STATUS_ERROR_BUDGET, "the expert budget (" + std::to_string(params.budget_bytes >> 20) +
                " MB) is more than " + ggml_backend_dev_name(pools.dev) + " has free (" + std::to_string(free >> 20) +
                " MB); give a smaller cache");
        }
    }
}

// the plan's pools: each one's slot tensors (and with neuron reads its row cache) made
void hobbit_runtime::make_pools() {
    for (const planned_pool & pp : plan.pools) {
        const expert_layer_layout & shape = levels.level(pp.cache.level).layers[pp.cache.layers.front()];
        pools.tensors.push_back(std::make_unique<expert_pool>(shape, levels.index.info.n_expert_used, pp.cache.n_slot, pools.dev,
                                                             /*gate_only*/ plan.neuron_reads, params.cpu_repack));
        neurons.caches.push_back(pp.n_page > 0 ? std::make_unique<neuron_row_cache>(pp.n_ff, pp.row_bytes, pp.n_page,
                                                                                params.neuron_bridge) : nullptr);
    }
}

// which layers may compute a miss in place, and the executor choice (mode, latency model)
void hobbit_runtime::choose_executor() {
    const std::vector<bool> inplace_ok = plan_inplace_layers(levels, plan, params, files.model() != nullptr,
                                                             [&](int p) { return pools.tensors[p]->repacked(); });
    const bool any_inplace = std::find(inplace_ok.begin(), inplace_ok.end(), true) != inplace_ok.end();
    executor = executor_choice_make(levels.index, params.mode, any_inplace, params.direct_io);
    executor.inplace_ok = inplace_ok;
    stats_.mode             = any_inplace ? params.mode : HOBBIT_MODE_GPU_CENTRIC;
    stats_.load_bytes_per_s = executor.load_bytes_per_s;
    stats_.map_bytes_per_s  = executor.map_bytes_per_s;
}

// the expert cache over the planned pools, and where its waves may run in place (the executor's)
void hobbit_runtime::make_cache() {
    expert_cache_setup setup = plan.cache_setup(levels, params);
    setup.inplace_ok = executor.inplace_ok;
    // experts run in place only when a ubatch selects more pairs than the pools hold,
    // and never when the model's pool is repacked: the mapped original would take other
    // kernels than stock, so such a ubatch runs in waves instead (n_waves)
    setup.inplace_any_width = params.mode != HOBBIT_MODE_GPU_CENTRIC;
    cache = std::make_unique<expert_cache>(setup, static_cast<cache_env &>(*this));
}

// HOBBIT's stacked gates for the decode prefetch
void hobbit_runtime::make_predictor() {
    const hobbit_model_info & info = levels.index.info;
    if (params.prefetch_layers > 0 && files.model() != nullptr) {
        // a width past the model's experts names them all
        int width = params.prefetch_width == HOBBIT_PREFETCH_WIDTH_FATE
            ? std::min(std::max(info.n_expert_used + 1, (info.n_expert + 3) / 4), info.n_expert)
            : params.prefetch_width > 0 ? std::min(params.prefetch_width, info.n_expert) : info.n_expert_used;
        if (params.substitute_alpha > 0.0f) {
            width = std::max(width, std::min(info.n_expert_used + 1, info.n_expert)); // β, to tell the top scores
        }
        predictor = predictor_make_stacked_gates(load_routers(files.model(), plan.moe_layers), info.n_embd, width,
                                                 params.prefetch_layers);
    }
}

// the I/O threads over every level's file
void hobbit_runtime::make_io() {
    const std::vector<const expert_index *> level_indexes = levels.in_order();
    // loads into device pools are staged in the device's page-locked host memory (disk ->
    // pinned -> device, HOBBIT §4), each I/O thread copying on its own stream
    ggml_backend_buffer_type_t pinned = ggml_backend_dev_type(pools.dev) != GGML_BACKEND_DEVICE_TYPE_CPU
        ? ggml_backend_dev_host_buffer_type(pools.dev) : nullptr;
    io = std::make_unique<io_scheduler>(level_indexes, params.direct_io, params.n_io_threads,
        [this](const load_task & t, const std::string & err, uint64_t n, int64_t us) { on_load_done(t, err, n, us); },
        pinned, plan.neuron_reads ? params.n_row_readers : 0);
}

// the offload description llama.cpp's graph reads: per MoE layer, its dispatch ops, pools and neuron ops
void hobbit_runtime::describe_layers() {
    const hobbit_model_info & info = levels.index.info;
    graph.uds.resize((size_t) info.n_layer * LLAMA_MOE_MAX_WAVES);
    graph.layers.resize(info.n_layer);
    for (int il : plan.moe_layers) {
        llama_moe_offload_layer & lo = graph.layers[il];
        for (int w = 0; w < LLAMA_MOE_MAX_WAVES; ++w) {
            dispatch_ud & d = graph.uds[(size_t) il * LLAMA_MOE_MAX_WAVES + w];
            d = { this, il, w };
            lo.dispatch_ud[w] = &d;
        }
        lo.n_waves = &hobbit_runtime::n_waves_op;
        lo.ctx     = lo.dispatch_ud[0];
        lo.n_pool  = levels.n_level; // one mul_mat_id pass per precision
        for (int l = 0; l < levels.n_level; ++l) {
            const expert_pool & pool = *pools.tensors[cache->pool_of(l, il)];
            for (int p = 0; p < LLAMA_MOE_PROJ_COUNT; ++p) {
                lo.pools[l].w[p] = pool.weights(p);
            }
            lo.pools[l].n_slot = pool.n_slot();
        }
        lo.inplace_min_pairs = cache->inplace_min_pairs(il);
        lo.dispatch    = &hobbit_runtime::dispatch_op;
        lo.neuron_sparse    = params.neuron_threshold >= 0.0f && !plan.neuron_reads;
        lo.neuron_threshold = params.neuron_threshold;
        lo.neuron_limit     = params.neuron_limit;
        lo.neuron_count     = &hobbit_runtime::neuron_count_op;
        lo.neuron_count_ud  = this;
        if (plan.neuron_reads) {
            lo.neuron_fetch    = &hobbit_runtime::neuron_fetch_op;
            lo.neuron_fetch_ud = lo.dispatch_ud[0];
            lo.neuron_up       = &hobbit_runtime::neuron_up_op;
            lo.neuron_up_ud    = this;
            lo.neuron_down     = &hobbit_runtime::neuron_down_op;
            lo.neuron_down_ud  = this;
        }
    }
    graph.desc.n_layer  = info.n_layer;
    graph.desc.layers   = graph.layers.data();
    graph.desc.ctx      = this;
    graph.desc.free_ctx = [](void * ctx) { delete (hobbit_runtime *) ctx; };
}

// fill the free slots of every level's pools in the background (the plan's warm-up; on-demand loads
// overtake these: they are background loads)
void hobbit_runtime::warm_pools() {
    std::vector<load_task> loads;
    cache->warm(plan.warm_order(levels.index.info.n_expert), [&](int il) { return plan.placed(il); },
                plan.warm_deepest, loads);
    submit(loads);
}

hobbit_runtime::~hobbit_runtime() {
    io.reset(); // stop the I/O thread before the pool it writes into goes away
}
