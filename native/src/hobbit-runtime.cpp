#include "hobbit-runtime.h"

#include "hobbit-error.h"
#include "hobbit-neuron-reads.h"
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

// the names of hobbit.h's enum hobbit_policy, in its order
static std::string policy_name(int policy) {
    static const char * names[] = { "lru", "lfu", "lhu", "fld", "random", "weighted", "arc", "popularity", "score" };
    return policy >= 0 && policy < 9 ? names[policy] : "?";
}

static int64_t now_us() {
    return std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// every MoE layer's router as floats, whatever its type and wherever it lives
static std::vector<router_weights> load_routers(const llama_model * model, const std::vector<int> & moe_layers) {
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
    const hobbit_model_info & info = index.info;
    if (info.n_layer_moe == 0) {
        throw hobbit_error(HOBBIT_STATUS_ERROR_NOT_MOE, path + ": the model has no routed experts (a dense model); nothing to offload");
    }
    if (params.n_level < 1 || params.n_level > HOBBIT_MAX_LEVELS) {
        throw hobbit_error(HOBBIT_STATUS_ERROR_INVALID, "n_level must be 1.." + std::to_string(HOBBIT_MAX_LEVELS));
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
    if (params.hit_policy < HOBBIT_HIT_FOUND || params.hit_policy > HOBBIT_HIT_EXACT) {
        throw hobbit_error(HOBBIT_STATUS_ERROR_INVALID, "unknown hit policy " + std::to_string((int) params.hit_policy));
    }
    const bool ordered = 0.0f <= params.t1 && params.t1 <= params.t2 && params.t2 <= 1.0f &&
                         (n_level < 3 || (params.t1 <= params.t_mid && params.t_mid <= params.t2));
    if ((n_level > 1 || params.skip_cached) && !ordered) {
        throw hobbit_error(HOBBIT_STATUS_ERROR_INVALID, "thresholds must satisfy 0 <= t1 <= t_mid <= t2 <= 1 (t1 " +
            std::to_string(params.t1) + ", t_mid " + std::to_string(params.t_mid) + ", t2 " + std::to_string(params.t2) + ")");
    }

    cache_policy_kind policy_kind;
    if (!cache_policy_parse(policy_name(params.policy), policy_kind)) {
        throw hobbit_error(HOBBIT_STATUS_ERROR_INVALID, "unknown cache policy " + std::to_string((int) params.policy));
    }
    const cache_policy_weights weights = { params.policy_weights.lru, params.policy_weights.lfu,
                                           params.policy_weights.lhu, params.policy_weights.fld };
    moe_rank.assign(info.n_layer, -1);
    for (int il = 0; il < info.n_layer; ++il) {
        if (index.layers[il].has_experts()) {
            moe_rank[il] = (int) moe_layers.size();
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

    last_moe_layer = moe_layers.back();

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
    policy_reads_scores = policy_kind == cache_policy_kind::score;
    if (policy_kind == cache_policy_kind::popularity && popularity.empty()) {
        throw hobbit_error(HOBBIT_STATUS_ERROR_INVALID, "the popularity policy needs a popularity profile (expert_popularity)");
    }
    this->params.expert_popularity   = nullptr; // copied into popularity
    this->params.n_expert_popularity = 0;

    std::vector<const expert_index *> level_indexes;
    for (int l = 0; l < n_level; ++l) {
        level_indexes.push_back(&level_index(l));
    }
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
    pool_of.assign(n_level, std::vector<int>(info.n_layer, -1));
    int64_t n_slot_total = 0;
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
            pool_group pg;
            pg.level        = l;
            pg.type         = shape.proj[neuron_reads ? LLAMA_MOE_PROJ_UP : LLAMA_MOE_PROJ_DOWN].type; // a neuron layout's up holds down
            pg.expert_bytes = g.expert_bytes;
            int64_t bytes   = g.n_slot * g.expert_bytes;
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
                pg.rows = std::make_unique<neuron_row_cache>(n_ff, row_bytes, n_page, params.neuron_bridge);
                pg.expert_bytes = (int64_t) shape.proj[LLAMA_MOE_PROJ_GATE].n_bytes; // a slot's
                bytes = g.n_slot * pg.expert_bytes + pg.rows->bytes();
            }
            pg.pool   = std::make_unique<expert_pool>(shape, info.n_layer, info.n_expert, info.n_expert_used,
                                                      g.n_slot, pool_dev, /*gate_only*/ neuron_reads);
            pg.policy = cache_policy_make(policy_kind, g.n_slot, info.n_layer, info.n_expert, weights, params.seed,
                                          popularity.empty() ? nullptr : popularity.data());
            pg.n_layer = (int) g.layers.size();
            for (int il : g.layers) {
                pool_of[l][il] = (int) pools.size();
            }
            stats_.pool_bytes += bytes;
            n_slot_total += g.n_slot;
            pools.push_back(std::move(pg));
        }
    }
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
        inplace_ok[il] = model != nullptr && !high && !pools[pool_of[0][il]].pool->repacked() &&
                         (params.mode == HOBBIT_MODE_COOPERATIVE ||
                          page_cache_holds_two_layers(layer_bytes, params.page_cache_room_bytes));
        any_inplace = any_inplace || inplace_ok[il];
    }
    if (params.mode < HOBBIT_MODE_GPU_CENTRIC || params.mode > HOBBIT_MODE_BALANCED) {
        throw hobbit_error(HOBBIT_STATUS_ERROR_INVALID, "unknown mode " + std::to_string((int) params.mode));
    }
    executor = executor_choice_make(index, params.mode, any_inplace, params.direct_io);
    if (model != nullptr) {
        advise_mapping_random();
        open_and_guard_parts();
    }
    stats_.mode             = any_inplace ? params.mode : HOBBIT_MODE_GPU_CENTRIC;
    stats_.load_bytes_per_s = executor.load_bytes_per_s;
    stats_.map_bytes_per_s  = executor.map_bytes_per_s;

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
    // loads into device pools are staged in the device's page-locked host memory (disk ->
    // pinned -> device, HOBBIT §4), each I/O thread copying on its own stream
    ggml_backend_buffer_type_t pinned = ggml_backend_dev_type(pool_dev) != GGML_BACKEND_DEVICE_TYPE_CPU
        ? ggml_backend_dev_host_buffer_type(pool_dev) : nullptr;
    io = std::make_unique<io_scheduler>(level_indexes, params.direct_io, params.n_io_threads,
        [this](const load_task & t, const std::string & err, uint64_t n, int64_t us) { on_load_done(t, err, n, us); },
        pinned, neuron_reads ? params.n_row_readers : 0);

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
            const expert_pool & pool = *pools[pool_of[l][il]].pool;
            for (int p = 0; p < LLAMA_MOE_PROJ_COUNT; ++p) {
                lo.pools[l].w[p] = pool.weights(p);
            }
            lo.pools[l].n_slot = pool.n_slot();
        }
        // experts run in place only when a ubatch selects more pairs than the pools hold,
        // and never when the model's pool is repacked: the mapped original would take other
        // kernels than stock, so such a ubatch runs in waves instead (n_waves)
        lo.inplace_min_pairs = !inplace_ok[il] ? INT32_MAX :
                               params.mode != HOBBIT_MODE_GPU_CENTRIC ? 0 : layer_capacity(il) + 1;
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

bool hobbit_runtime::runs_in_place(int il, int e, int n_tokens) const {
    return inplace_ok[il] && executor.in_place(n_tokens, measures_residency() ? resident(il, e) : 0.0,
                                               (int64_t) index.layers[il].n_bytes() * index.info.n_expert,
                                               page_cache_room());
}

bool hobbit_runtime::measures_residency() const {
    return executor.mode == HOBBIT_MODE_AUTO || executor.mode == HOBBIT_MODE_BALANCED;
}

std::vector<bool> hobbit_runtime::balanced_in_place(int il, const wave_selection & sel, const std::vector<int> & misses,
                                                    const std::function<bool(int)> & either_way) const {
    std::vector<bool> in_place(index.info.n_expert, false);
    // under a tight cap the page cache has no room for what in place faults in: every miss loads
    if (!page_cache_holds_two_layers((int64_t) index.layers[il].n_bytes() * index.info.n_expert, page_cache_room())) {
        return in_place;
    }
    std::vector<int> experts;
    std::vector<miss_cost> costs;
    for (int e : misses) {
        if (either_way(e)) {
            experts.push_back(e);
            costs.push_back(executor.cost(sel.n_pairs[e], (int64_t) index.layers[il].n_bytes(), resident(il, e)));
        }
    }
    const std::vector<bool> split = balance_misses(costs);
    for (size_t i = 0; i < experts.size(); ++i) {
        in_place[experts[i]] = split[i];
    }
    return in_place;
}

int64_t hobbit_runtime::page_cache_room() const {
    // pool memory is committed as slots are first written and stays; what is not yet
    // committed is still free for the page cache
    return params.page_cache_room_bytes < 0 ? -1 : params.page_cache_room_bytes + stats_.pool_bytes - stats_.peak_pool_bytes;
}

double hobbit_runtime::resident(int il, int e) const {
    uint64_t total = 0;
    double resident_bytes = 0.0;
    for (int p = 0; p < LLAMA_MOE_PROJ_COUNT; ++p) {
        const ggml_tensor * t = llama_model_get_expert_tensor(model, il, (llama_moe_proj) p);
        if (t == nullptr || t->data == nullptr) {
            continue;
        }
        const size_t n = t->nb[2];
        resident_bytes += resident_share((const char *) t->data + (size_t) e * n, n) * n;
        total += n;
    }
    return total > 0 ? resident_bytes / total : 0.0;
}

void hobbit_runtime::warm_pools() {
    // the lowest level first (a copy of every expert in memory is what spares a decode the
    // disk), then the free slots of the higher levels; expert by expert across the layers,
    // so a pool too small for all of them still holds some of every layer; with a popularity
    // profile the most popular experts of any layer first (Fiddler's placement: they are the
    // ones its policy keeps). With a static placement each expert only at its own level.
    // On-demand loads overtake these (they are background loads).
    std::lock_guard<std::mutex> lock(mtx);
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
    for (int l = n_level - 1; l >= 0; --l) {
        for (const auto & [il, e] : order) {
            if (placed(il) && placed(il)[e] != l) {
                continue; // a static placement: each expert at its own level only
            }
            const int p = pool_of[l][il];
            const expert_pool & pool = *pools[p].pool;
            const bool has_free = std::any_of(pool.slots.begin(), pool.slots.end(),
                                              [](const pool_slot & s) { return s.state == slot_state::empty; });
            if (has_free && pool.find(il, e) < 0 && queue_background_load(p, il, e, /*prefetch*/ false, loads, nullptr) >= 0) {
                stats_.warm_loads++;
            }
        }
    }
    io->submit(loads);
}

hobbit_runtime::~hobbit_runtime() {
    io.reset(); // stop the I/O thread before the pool it writes into goes away
    for (const part_file & f : part_files) {
        if (f.fd >= 0) {
            close(f.fd);
        }
    }
}

void hobbit_runtime::dispatch_op(ggml_tensor * dst, int ith, int nth, void * ud) {
    (void) nth;
    if (ith != 0) {
        return;
    }
    const auto * d = (const dispatch_ud *) ud;
    d->rt->dispatch(dst, d->il, d->wave);
}

void hobbit_runtime::neuron_count_op(ggml_tensor * dst, int ith, int nth, void * ud) {
    (void) nth;
    if (ith != 0) {
        return;
    }
    auto * rt = (hobbit_runtime *) ud;
    const ggml_tensor * kept = dst->src[0]; // [1, n_expert_used, n_tokens]
    const ggml_tensor * ids  = dst->src[1]; // [n_expert_used, n_tokens, n_pool + 1]
    int64_t n = 0, whole = 0;
    double sum = 0.0;
    for (int64_t t = 0; t < ids->ne[1]; ++t) {
        for (int64_t k = 0; k < ids->ne[0]; ++k) {
            bool in_pass = false;
            for (int64_t p = 0; p < ids->ne[2]; ++p) {
                in_pass |= *(const int32_t *) ((const char *) ids->data + k * ids->nb[0] + t * ids->nb[1] + p * ids->nb[2]) >= 0;
            }
            if (in_pass) {
                const float share = *(const float *) ((const char *) kept->data + k * kept->nb[1] + t * kept->nb[2]);
                n++;
                whole += share >= 1.0f;
                sum += share;
            }
        }
    }
    std::lock_guard<std::mutex> lock(rt->mtx);
    rt->stats_.neuron_selections += n;
    rt->stats_.neuron_whole      += whole;
    rt->stats_.neuron_kept       += sum;
}

void hobbit_runtime::neuron_fetch_op(ggml_tensor * dst, int ith, int nth, void * ud) {
    (void) nth;
    if (ith != 0) {
        return;
    }
    const auto * d = (const dispatch_ud *) ud;
    d->rt->fetch_neurons(dst, d->il);
}

// the pair (k, t) of a pass: its pages, or nullptr when it is not in the pass
static const int32_t * pair_pages(const std::vector<const int32_t *> & pages, int64_t n_used, int64_t k, int64_t t) {
    const size_t i = (size_t) (t * n_used + k);
    return i < pages.size() ? pages[i] : nullptr;
}

void hobbit_runtime::neuron_up_op(ggml_tensor * dst, int ith, int nth, void * ud) {
    const auto * rt = (const hobbit_runtime *) ud;
    const ggml_tensor * x    = dst->src[0]; // [n_embd, 1 or n_expert_used, n_tokens]
    const ggml_tensor * keep = dst->src[1]; // [n_ff, n_expert_used, n_tokens]
    const neuron_row_cache & rows = *rt->pass_rows;
    const int n_ff = (int) dst->ne[0];
    // each thread its share of the neurons, for every pair
    const int f0 = (int) ((int64_t) n_ff * ith / nth), f1 = (int) ((int64_t) n_ff * (ith + 1) / nth);
    for (int64_t t = 0; t < dst->ne[2]; ++t) {
        for (int64_t k = 0; k < dst->ne[1]; ++k) {
            float * out = (float *) ((char *) dst->data + k * dst->nb[1] + t * dst->nb[2]);
            const int32_t * pages = pair_pages(rt->pass_pages, dst->ne[1], k, t);
            if (pages == nullptr) {
                std::fill(out + f0, out + f1, 0.0f);
                continue;
            }
            const float * xk = (const float *) ((const char *) x->data + (x->ne[1] == 1 ? 0 : k) * x->nb[1] + t * x->nb[2]);
            neuron_up_q8_0(rows.row(0, 0), rows.page_bytes(), pages, (int) x->ne[0], xk,
                           (const float *) ((const char *) keep->data + k * keep->nb[1] + t * keep->nb[2]), out, f0, f1);
        }
    }
}

void hobbit_runtime::neuron_down_op(ggml_tensor * dst, int ith, int nth, void * ud) {
    const auto * rt = (const hobbit_runtime *) ud;
    const ggml_tensor * act = dst->src[0]; // [n_ff, n_expert_used, n_tokens]
    const neuron_row_cache & rows = *rt->pass_rows;
    const int64_t n_block = dst->ne[0] / 32;
    // each thread its share of the output's blocks, for every pair
    const int64_t b0 = n_block * ith / nth, b1 = n_block * (ith + 1) / nth;
    for (int64_t t = 0; t < act->ne[2]; ++t) {
        for (int64_t k = 0; k < act->ne[1]; ++k) {
            float * out = (float *) ((char *) dst->data + k * dst->nb[1] + t * dst->nb[2]);
            const int32_t * pages = pair_pages(rt->pass_pages, act->ne[1], k, t);
            if (pages == nullptr) {
                memset(out + b0 * 32, 0, (size_t) (b1 - b0) * 32 * sizeof(float));
                continue;
            }
            neuron_down_q8_0(rows.row(1, 0), rows.page_bytes(), pages, (int) act->ne[0],
                             (const float *) ((const char *) act->data + k * act->nb[1] + t * act->nb[2]), out, b0, b1);
        }
    }
}

void hobbit_runtime::fetch_neurons(ggml_tensor * dst, int il) {
    const ggml_tensor * gate = dst->src[0]; // [n_ff, n_expert_used, n_tokens]
    const ggml_tensor * ids  = dst->src[1]; // [n_expert_used, n_tokens, n_pool + 1]; plane 0: the slot
    const int n_ff = (int) gate->ne[0];
    const int64_t t_enter = now_us();

    std::unique_lock<std::mutex> lock(mtx);
    const int p = pool_of[0][il];
    pool_group & pg = pools[p];
    neuron_row_cache & rows = *pg.rows;
    std::map<int64_t, neuron_bits> need;                       // owner (layer * n_expert + expert) -> the union of its pairs' kept neurons
    std::vector<int64_t> pair_owner(gate->ne[1] * gate->ne[2], -1); // token-major
    pass_rows = &rows;
    pass_pages.assign(pair_owner.size(), nullptr); // a failed fetch leaves the up and down ops zero rows
    neuron_bits keep;
    for (int64_t t = 0; t < gate->ne[2]; ++t) {
        for (int64_t k = 0; k < gate->ne[1]; ++k) {
            const int32_t s = *(const int32_t *) ((const char *) ids->data + k * ids->nb[0] + t * ids->nb[1]);
            float * mask = (float *) ((char *) dst->data + k * dst->nb[1] + t * dst->nb[2]);
            if (s < 0 || failed()) {
                std::fill(mask, mask + n_ff, 0.0f); // not in this pass: its down row is zero anyway
                continue;
            }
            const float * g = (const float *) ((const char *) gate->data + k * gate->nb[1] + t * gate->nb[2]);
            const bool whole = neuron_keep(g, n_ff, params.neuron_threshold, params.neuron_limit, keep);
            const int kept = keep.count();
            for (int f = 0; f < n_ff; ++f) {
                mask[f] = keep.test(f) ? 1.0f : 0.0f;
            }
            stats_.neuron_selections++;
            stats_.neuron_whole += whole;
            stats_.neuron_kept  += (double) kept / n_ff;
            const pool_slot & slot = pg.pool->slots[s];
            const int64_t owner = (int64_t) slot.layer * index.info.n_expert + slot.expert;
            pair_owner[t * gate->ne[1] + k] = owner;
            auto it = need.find(owner);
            if (it == need.end()) {
                need.emplace(owner, keep);
            } else {
                join(it->second, keep);
            }
        }
    }
    // read the rows the pass's experts lack, making room from the least recently used others
    neuron_rows_plan plan;
    if (!rows.plan_rows(need, plan)) {
        // the waves hold no more experts than the pages can hold whole (layer_capacity)
        fail("neuron reads: a pass of layer " + std::to_string(il) + " needs more rows than the neuron row cache's " +
             std::to_string(rows.n_page()) + " pages");
        return;
    }
    std::vector<neuron_row_run> runs;
    rows.apply_rows(plan, runs);
    for (size_t i = 0; i < pair_owner.size(); ++i) {
        pass_pages[i] = pair_owner[i] < 0 ? nullptr : rows.pages(pair_owner[i]);
    }
    // a run of neurons is one read: the layout bundles each neuron's up row and down column, as a page does
    const uint64_t page_bytes = rows.page_bytes();
    std::vector<load_task> loads;
    for (const neuron_row_run & run : runs) {
        const int e = (int) (run.owner % index.info.n_expert);
        if (loads.empty() || loads.back().expert != e) {
            loads.push_back({ p, 0, pg.pool->find(il, e), il, e, /*prefetch*/ false, {}, {}, {} });
        }
        loads.back().ranges.push_back({ LLAMA_MOE_PROJ_UP, (uint64_t) run.first * page_bytes,
                                        (uint64_t) (run.first + run.count) * page_bytes, rows.row(0, run.first_page) });
        stats_.neuron_reads++;
    }
    if (loads.empty()) {
        stats_.dispatch_us += now_us() - t_enter;
        return;
    }
    rows_pending += (int) loads.size();
    io->submit(loads);
    const int64_t t0 = now_us();
    n_waiting++;
    cv_loaded.wait(lock, [&] { return failed() || rows_pending == 0; });
    n_waiting--;
    const int64_t waited = now_us() - t0;
    stats_.stall_us    += waited;
    stats_.dispatch_us += now_us() - t_enter - waited;
}

int32_t hobbit_runtime::n_waves_op(void * ctx, int32_t n_tokens) {
    const auto * d = (const dispatch_ud *) ctx;
    return d->rt->n_waves(d->il, n_tokens);
}

int hobbit_runtime::layer_capacity(int il) const {
    int n = 0;
    for (int l = 0; l < n_level; ++l) {
        n += pools[pool_of[l][il]].pool->n_slot();
    }
    if (neuron_reads) {
        // a wave's experts need their kept rows at once: no more than the pages hold whole
        const neuron_row_cache & rows = *pools[pool_of[0][il]].rows;
        n = (int) std::min<int64_t>(n, rows.n_page() / rows.n_ff());
    }
    return n;
}

int hobbit_runtime::n_waves(int il, int n_tokens) const {
    // a layer whose experts may not run in place (a repacked pool, a high companion) serves a
    // wide ubatch in several waves
    const int n_expert = index.info.n_expert;
    const int capacity = layer_capacity(il);
    if (inplace_ok[il] || capacity >= n_expert) {
        return 1;
    }
    const int64_t distinct = std::min<int64_t>((int64_t) n_tokens * index.info.n_expert_used, n_expert);
    return (int) std::min<int64_t>(LLAMA_MOE_MAX_WAVES, (distinct + capacity - 1) / capacity);
}

slot_use hobbit_runtime::use_of(const pool_slot & s) const {
    if (s.pins > 0 || s.background_graph == graph_seq) {
        return slot_use::busy;
    }
    return s.state == slot_state::empty ? slot_use::empty : slot_use::evictable;
}

void hobbit_runtime::settle(int p, int s, std::unique_lock<std::mutex> * lock) {
    if (pools[p].pool->slots[s].state != slot_state::loading) {
        return;
    }
    if (!io->drop_prefetches([&](const load_task & t) { return t.group == p && t.slot == s; }).empty()) {
        pools[p].pool->slots[s].state = slot_state::unread;
        return;
    }
    if (lock != nullptr) {
        cv_loaded.wait(*lock, [&] { return failed() || pools[p].pool->slots[s].state != slot_state::loading; });
    }
}

int hobbit_runtime::take_slot(int p, std::unique_lock<std::mutex> * lock) {
    const expert_pool & pool = *pools[p].pool;
    cache_policy_i & policy = *pools[p].policy;
    std::vector<int> candidates;
    const auto use = [&](int s) { return use_of(pool.slots[s]); };
    const int n_moe = (int) moe_layers.size();
    // a prompt's ubatch: what the sweep reaches last goes first (the layer just computed)
    const auto ahead = [&](int s) { return (moe_rank[pool.slots[s].layer] - sweep_rank - 1 + n_moe) % n_moe; };
    const int s = sweep_rank < 0 ? cache_take_slot(pool.n_slot(), use, policy, candidates) :
        cache_take_slot(pool.n_slot(), use, [&](const std::vector<int> & c) { return sweep_victim(c, ahead, policy); },
                        candidates);
    if (s >= 0 && pool.slots[s].prefetched) {
        stats_.prefetch_wasted++; // evicted before any layer asked for it
    }
    if (s >= 0) {
        settle(p, s, lock);
    }
    return s;
}

// the levels a selection wanted at `want` may take a slot at, in order: the wanted one,
// then the nearer higher precisions, then (allow_lower) the lower ones. Hits "exact": the
// wanted one only, so what is served is a function of the text alone (a lower level taken
// for want of room depended on which slots loads and predictions held at that moment: the
// soak's repeats differed at a cap whose high pools held a slot or two a layer)
static int first_level(int want, int n_level, bool exact, bool allow_lower, const std::function<bool(int)> & has_room) {
    if (exact) {
        return has_room(want) ? want : -1;
    }
    for (int l = want; l >= 0; --l) {
        if (has_room(l)) {
            return l;
        }
    }
    for (int l = want + 1; allow_lower && l < n_level; ++l) {
        if (has_room(l)) {
            return l;
        }
    }
    return -1;
}

int hobbit_runtime::take_slot_near(int il, int want, bool exact, bool allow_lower, int & level,
                                   std::unique_lock<std::mutex> & lock) {
    int s = -1;
    level = first_level(want, n_level, exact, allow_lower, [&](int l) { return (s = take_slot(pool_of[l][il], &lock)) >= 0; });
    return level >= 0 ? s : -1;
}

int hobbit_runtime::find_cached(int il, int e, int & level) const {
    for (int l = 0; l < n_level; ++l) {
        const int s = pools[pool_of[l][il]].pool->find(il, e);
        if (s >= 0) {
            level = l;
            return s;
        }
    }
    return -1;
}

load_task hobbit_runtime::slot_load(int p, int s, int il, int e, bool prefetch) const {
    load_task task = { p, pools[p].level, s, il, e, prefetch, {}, {}, {} };
    pools[p].pool->slot_targets(s, task.dst, task.view);
    return task; // with neuron reads the pool holds the gate alone: the rows follow once its activations say which
}

int hobbit_runtime::queue_background_load(int p, int il, int e, bool prefetch, std::vector<load_task> & loads,
                                          std::unique_lock<std::mutex> * lock) {
    expert_pool & pool = *pools[p].pool;
    const int s = take_slot(p, lock);
    if (s < 0) {
        return -1;
    }
    pool.assign(s, il, e);
    pool.slots[s].prefetched = prefetch;
    // busy until its layer's turn (a prefetch) or for the rest of this graph (an upgrade); the
    // warm-up's (no lock: before any graph) are the pools' first contents, taken like any other
    pool.slots[s].background_graph = lock != nullptr ? graph_seq : -1;
    if (prefetch && lock != nullptr) {
        prefetched_this_graph.push_back({ p, s, il });
    }
    pools[p].policy->on_insert(s, il, e);
    loads.push_back(slot_load(p, s, il, e, /*prefetch*/ true));
    return s;
}

void hobbit_runtime::prefetch_next_layer_whole(int il, const ggml_tensor * x, std::vector<load_task> & loads,
                                               std::unique_lock<std::mutex> & lock) {
    const auto it = std::find(moe_layers.begin(), moe_layers.end(), il);
    if (it == moe_layers.end() || it + 1 == moe_layers.end()) {
        return;
    }
    const int next = *(it + 1);
    const int n_expert = index.info.n_expert;
    std::vector<int> order(n_expert);
    std::iota(order.begin(), order.end(), 0);
    const bool share_low = thresholds.prefill_low_share > 0.0f;
    std::vector<bool> low(n_expert, false);
    if (predictor && (params.prefill_popular_first || share_low) && x != nullptr) {
        // Fate §4.5: the pools rarely hold a whole layer; what they hold should be what most
        // of the prompt's tokens will select, and the first loads done are the longest computations
        const std::vector<int> count = predicted_expert_counts(*predictor, il, (const float *) x->data,
                                                               x->nb[1] / sizeof(float), (int) x->ne[1],
                                                               index.info.n_expert_used, n_expert);
        if (!count.empty() && params.prefill_popular_first) {
            std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return count[a] > count[b]; });
        }
        if (!count.empty() && share_low) {
            low = least_popular_experts(count, thresholds.prefill_low_share); // loaded low, as the dispatch will want them
        }
    }
    // no more than each pool holds beside what this layer pinned, or the loads would evict each other
    std::vector<int> room(n_level, 0);
    for (int l = 0; l < n_level; ++l) {
        for (const pool_slot & slot : pools[pool_of[l][next]].pool->slots) {
            room[l] += use_of(slot) != slot_use::busy;
        }
    }
    for (int e : order) {
        const int l = low[e] ? n_level - 1 : 0;
        int level = -1;
        if (room[l] <= 0 || find_cached(next, e, level) >= 0 || runs_in_place(next, e, 2)) {
            continue;
        }
        const int p = pool_of[l][next];
        const int s = queue_background_load(p, next, e, /*prefetch*/ true, loads, &lock);
        if (s < 0) {
            room[l] = 0;
            continue;
        }
        stats_.prefetch_issued++;
        pin_predicted(p, s, next);
        room[l]--;
    }
}

void hobbit_runtime::advise_mapping_random() {
    // The loader maps the offloaded experts with MADV_RANDOM, the resident weights with the
    // kernel's default readahead. A fault in a resident tensor then reads read_ahead_kb
    // around it (8 MB on this VM's disk), and the file's readahead runs on past the tensor
    // into the experts beside it: measured, 23 MB of a tiny model's first expert layer in
    // the page cache after one token, outside every budget (a capped soak reached its cap
    // thousands of times). The resident weights were read ahead at load (MADV_WILLNEED);
    // from here a fault reads its page only, and in place reads exactly its slices ahead
    // (read_ahead_in_place). Each part's mapping covers its whole file from offset 0: its start
    // is any of its expert tensors' address less that tensor's file offset.
    std::vector<uintptr_t> base(index.parts.size(), 0);
    part_base.assign(index.parts.size(), 0);
    for (int il : moe_layers) {
        for (int p = 0; p < LLAMA_MOE_PROJ_COUNT; ++p) {
            const ggml_tensor * t = llama_model_get_expert_tensor(model, il, (llama_moe_proj) p);
            const expert_proj_layout & pl = index.layers[il].proj[p];
            if (t == nullptr || t->data == nullptr || !pl.present) {
                continue;
            }
            const uintptr_t b = (uintptr_t) t->data - (uintptr_t) pl.offset;
            if ((base[pl.part] != 0 && b != base[pl.part]) || b % (uintptr_t) sysconf(_SC_PAGESIZE) != 0) {
                return; // not one mapping of the file (not mapped at all): nothing to advise, no base known
            }
            base[pl.part] = b;
        }
    }
    part_base = base;
    for (size_t part = 0; part < index.parts.size(); ++part) {
        struct stat st;
        if (base[part] != 0 && stat(index.parts[part].c_str(), &st) == 0) {
            map_advise_random((const void *) base[part], (size_t) st.st_size);
        }
    }
}

void hobbit_runtime::open_and_guard_parts() {
    // The model's files stay open for the run: their size and identity are asked of what this
    // process maps, not of the paths (a model renamed over or removed is intact here). Every
    // part's whole mapping is guarded, the resident weights too: a file cut while running is
    // this run's error, never a SIGBUS in the compute threads.
    part_files.resize(index.parts.size());
    for (size_t part = 0; part < index.parts.size(); ++part) {
        part_file & f = part_files[part];
        f.fd = open(index.parts[part].c_str(), O_RDONLY | O_CLOEXEC);
        struct stat st;
        if (f.fd < 0 || fstat(f.fd, &st) != 0) {
            throw hobbit_error(HOBBIT_STATUS_ERROR_IO, index.parts[part] + ": cannot open model file: " + strerror(errno));
        }
        f.size  = st.st_size;
        f.mtime = st.st_mtim;
        if (part < part_base.size() && part_base[part] != 0) {
            f.guard = std::make_unique<mapping_guard>((const void *) part_base[part], (size_t) st.st_size);
        }
    }
    loaded_fingerprint = index.fingerprint();
}

void hobbit_runtime::check_files_unchanged() {
    for (size_t part = 0; part < part_files.size(); ++part) {
        part_file & f = part_files[part];
        const std::string & path = index.parts[part];
        struct stat st;
        if (fstat(f.fd, &st) != 0) {
            fail(path + ": cannot stat the model file while running: " + strerror(errno));
            return;
        }
        if (st.st_size == f.size && st.st_mtim.tv_sec == f.mtime.tv_sec && st.st_mtim.tv_nsec == f.mtime.tv_nsec) {
            continue;
        }
        if (st.st_size < f.size) {
            fail(path + ": truncated while running: the file now has " + std::to_string((int64_t) st.st_size) +
                 " bytes, it had " + std::to_string((int64_t) f.size) + " when loaded");
            return;
        }
        // written to: the same experts (a file restored, or touched) serve on; others would be
        // computed as if they were the loaded model's
        std::vector<int> fds;
        for (const part_file & pf : part_files) {
            fds.push_back(pf.fd);
        }
        std::string now;
        try {
            now = index.fingerprint_of(fds);
        } catch (const hobbit_error & e) {
            fail(e.what());
            return;
        }
        if (now != loaded_fingerprint) {
            fail(path + ": overwritten while running: its experts are not those loaded (fingerprint " + now +
                 ", loaded " + loaded_fingerprint + "); load the model again to run the new file");
            return;
        }
        f.size  = st.st_size;
        f.mtime = st.st_mtim;
    }
}

void hobbit_runtime::read_ahead_in_place(int il, int e) {
    for (int p = 0; p < LLAMA_MOE_PROJ_COUNT; ++p) {
        const ggml_tensor * t = llama_model_get_expert_tensor(model, il, (llama_moe_proj) p);
        if (t != nullptr && t->data != nullptr) {
            map_advise_willneed((const char *) t->data + (size_t) e * t->nb[2], t->nb[2]);
        }
    }
}

void hobbit_runtime::read_ahead_next_layer(int il) {
    const auto it = std::find(moe_layers.begin(), moe_layers.end(), il);
    if (it == moe_layers.end() || it + 1 == moe_layers.end()) {
        return;
    }
    const int next = *(it + 1);
    // the page cache holds this layer's experts while they compute: only with room for both
    const int64_t layer_bytes = (int64_t) index.layers[next].n_bytes() * index.info.n_expert;
    const int64_t room = page_cache_room();
    if (room >= 0 && (int64_t) index.layers[il].n_bytes() * index.info.n_expert + layer_bytes > room) {
        return;
    }
    for (int p = 0; p < LLAMA_MOE_PROJ_COUNT; ++p) {
        const ggml_tensor * t = llama_model_get_expert_tensor(model, next, (llama_moe_proj) p);
        if (t != nullptr && t->data != nullptr) {
            map_advise_willneed(t->data, ggml_nbytes(t));
        }
    }
}

void hobbit_runtime::pin_predicted(int p, int s, int il) {
    pools[p].pool->slots[s].pins++;
    predicted_pins.push_back({ p, s, il, graph_seq });
}

void hobbit_runtime::release_predicted(const std::function<bool(int p, int s, int il)> & pred) {
    auto keep = predicted_pins.begin();
    for (const predicted_pin & pp : predicted_pins) {
        if (pred(pp.pool, pp.slot, pp.layer)) {
            pools[pp.pool].pool->slots[pp.slot].pins--;
        } else {
            *keep++ = pp;
        }
    }
    predicted_pins.erase(keep, predicted_pins.end());
}

void hobbit_runtime::prefetch_next_layers(int il, const float * x, std::vector<load_task> & loads,
                                          std::unique_lock<std::mutex> & lock) {
    std::vector<layer_prediction> predictions;
    predictor->predict(il, x, params.prefetch_layers, predictions);
    std::vector<int> want;
    for (const layer_prediction & lp : predictions) {
        const int k = (int) lp.experts.size();
        want.resize(k);
        // the precision a predicted expert is fetched at comes from the same score rule, on the
        // predicted top-k; a candidate past it (a widened prediction) would enter the selection
        // last, at the level of the weakest selected
        const int k_sel = std::min(k, index.info.n_expert_used);
        precision_levels(thresholds, lp.weights.data(), k_sel, want.data());
        std::fill(want.begin() + k_sel, want.end(), want[k_sel - 1]);
        for (int i = 0; placed(lp.il) && i < k; ++i) {
            // as read_selection: a placement fixes the level, the skip rule acts only with skip_cached
            if (!(want[i] == PRECISION_SKIP && thresholds.skip_cached)) {
                want[i] = placed(lp.il)[lp.experts[i]];
            }
        }
        // with substitution, only the predicted top-score experts (importance-driven scheduling
        // §5.2): a low-score one that misses is served by a cached expert of similar score
        int n_fetch = k;
        if (params.substitute_alpha > 0.0f && k > k_sel) {
            n_fetch = 0;
            while (n_fetch < k_sel && top_score(lp.weights[n_fetch], lp.weights[k_sel], params.substitute_alpha)) {
                n_fetch++;
            }
        }
        bool all_cached = true;
        for (int i = 0; i < n_fetch; ++i) {
            const int e = lp.experts[i];
            int level = -1;
            int s = find_cached(lp.il, e, level);
            if (s < 0 && runs_in_place(lp.il, e, 1)) {
                continue; // it would run in place on the page cache's copy: as good as cached
            }
            if (s < 0) {
                if (want[i] == PRECISION_SKIP) {
                    continue; // it would be skipped if missed: nothing worth fetching
                }
                all_cached = false;
                level = want[i];
                s = queue_background_load(pool_of[level][lp.il], lp.il, e, /*prefetch*/ true, loads, &lock);
                if (s < 0) {
                    continue; // every slot of that pool is pinned
                }
                stats_.prefetch_issued++;
            }
            pin_predicted(pool_of[level][lp.il], s, lp.il);
        }
        // go one layer deeper only while everything predicted so far is already there
        if (!all_cached) {
            break;
        }
    }
}

bool hobbit_runtime::exact_for(const wave_selection & sel, int e) const {
    return params.hit_policy == HOBBIT_HIT_EXACT && !sel.share_low[e];
}

int hobbit_runtime::lookup(int il, int e, int want, bool exact, int & level) const {
    if (!exact) {
        return find_cached(il, e, level);
    }
    level = want;
    return want < n_level ? pools[pool_of[want][il]].pool->find(il, e) : -1;
}

void hobbit_runtime::begin_wave(int il, int wave, const wave_selection & sel, const ggml_tensor * dst) {
    if (wave == 0) {
        served.assign(index.info.n_expert, false);
    }
    // the previous wave's or layer's matmuls are done: their slots may go
    for (const auto & [p, s] : pinned) {
        pools[p].pool->slots[s].pins--;
    }
    pinned.clear();
    if (wave == 0 && il <= last_dispatch_il) {
        graph_seq++;
        upgrades_this_graph = 0;
        prefetched_this_graph.clear();
    }
    // predictions for this layer have served their purpose (its selection pins what it
    // uses); those of an earlier graph are stale
    release_predicted([&](int, int, int layer) { return layer <= il; });
    const int64_t graph = graph_seq;
    predicted_pins.erase(std::remove_if(predicted_pins.begin(), predicted_pins.end(), [&](const predicted_pin & pp) {
        if (pp.graph == graph) {
            return false;
        }
        pools[pp.pool].pool->slots[pp.slot].pins--;
        return true;
    }), predicted_pins.end());
    // a prefetch for this layer whose expert was not selected was a wrong guess: its read is
    // dropped if still queued (the slot keeps the expert, unread, as if the read had run: what
    // the cache holds is the same whatever the disk's timing). The warm-up's and upgrades'
    // reads are not guesses: they stay
    if (wave == 0) {
        for (const load_task & t : io->drop_prefetches([&](const load_task & t) {
                 return t.layer == il && pools[t.group].pool->slots[t.slot].prefetched && sel.n_pairs[t.expert] == 0; })) {
            pools[t.group].pool->slots[t.slot].state = slot_state::unread;
        }
        // this layer's prefetches have had their turn: from here they are cached like any other
        prefetched_this_graph.erase(std::remove_if(prefetched_this_graph.begin(), prefetched_this_graph.end(),
            [&](const std::array<int, 3> & ps) {
                if (ps[2] != il) {
                    return false;
                }
                pool_slot & slot = pools[ps[0]].pool->slots[ps[1]];
                if (slot.layer == il && slot.background_graph == graph_seq) {
                    slot.background_graph = -1;
                }
                return true;
            }), prefetched_this_graph.end());
    }
    for (pool_group & pg : pools) {
        pg.policy->on_layer(il);
    }
    // the score-history policy sees every token's scores of this layer, selected or not
    const ggml_tensor * probs = dst->src[2];
    if (policy_reads_scores && wave == 0 && probs != nullptr && probs->type == GGML_TYPE_F32 &&
        probs->ne[1] == index.info.n_expert && probs->ne[2] == sel.n_tokens) {
        for (int t = 0; t < sel.n_tokens; ++t) {
            const std::vector<float> scores = router_scores(probs, t);
            for (int l = 0; l < n_level; ++l) {
                pools[pool_of[l][il]].policy->on_scores(il, scores.data());
            }
        }
    }
    if (recorder && wave == 0) {
        recorder->record(il, dst->src[0], dst->src[1], dst->src[2], dst->src[3]);
    }
}

wave_plan hobbit_runtime::plan_wave(int il, int wave, const wave_selection & sel) const {
    wave_plan plan;
    plan.has_inplace = (int64_t) sel.n_pair() >= layers[il].inplace_min_pairs;
    const int waves  = n_waves(il, sel.n_tokens);
    plan.last        = wave == waves - 1;
    plan.must_fit    = plan.last && !plan.has_inplace;
    const int skip = n_level;
    // the waves after this one hold this many experts (every slot of every level each): hits
    // "exact" must not leave them more, though its level has no room now
    const int64_t later_room = (int64_t) (waves - wave - 1) * layer_capacity(il);
    int64_t n_later = 0;

    // slots each level's pool can give a new expert now (empty, or holding one nobody needs),
    // and those it can give after a wait: before this wave pins anything, a busy slot is a
    // background load or a prediction's pin, which wait_for_slot drops or waits out. A wave
    // waits for them rather than leave its experts to a later wave: n_waves counted on every
    // slot of the layer, and the last wave cannot hold more (a prompt at start, while the
    // warm-up loads ran, failed so at a 44 MB budget on two levels)
    std::vector<int> room(n_level, 0), after_wait(n_level, 0);
    for (int l = 0; l < n_level; ++l) {
        for (const pool_slot & s : pools[pool_of[l][il]].pool->slots) {
            room[l]       += use_of(s) != slot_use::busy;
            after_wait[l] += use_of(s) == slot_use::busy;
        }
    }
    // in place computes the model's own experts: the highest level, which "exact" serves
    // only to the selections that want it
    const auto in_place_serves = [&](int e) { return plan.has_inplace && (!exact_for(sel, e) || sel.want[e] == 0); };
    // the order take_slot_near takes slots in; a lower level only without an in-place pass
    // (in place, the model's own weights serve the expert better)
    const auto level_with_room = [&](int e) {
        return first_level(sel.want[e], n_level, exact_for(sel, e), !plan.has_inplace, [&](int l) { return room[l] > 0; });
    };

    // experts already in a pool first: they cost nothing this wave, and their slots are
    // pinned before any miss looks for a victim
    // --skip-cached: skipped before any lookup, resident or not
    const auto skipped_even_cached = [&](int e) { return sel.want[e] == skip && thresholds.skip_cached; };
    std::vector<int> order = sel.order;
    const auto cached = std::stable_partition(order.begin(), order.end(), [&](int e) {
        int l;
        return !skipped_even_cached(e) && lookup(il, e, sel.want[e], exact_for(sel, e), l) >= 0;
    });
    // balanced: the misses that could run either way are split once for the wave (Algorithm 2)
    const std::vector<bool> balanced = executor.mode == HOBBIT_MODE_BALANCED && plan.has_inplace && inplace_ok[il]
        ? balanced_in_place(il, sel, std::vector<int>(cached, order.end()), [&](int e) {
              return sel.want[e] != skip && !(sel.share_low[e] && room[n_level - 1] > 0) && in_place_serves(e);
          })
        : std::vector<bool>();
    // neuron reads: a wave holds no more experts than the row cache's pages hold whole (its
    // experts' kept rows are read at once); n_waves counted on as many
    const int64_t wave_room = neuron_reads ? layer_capacity(il) : INT64_MAX;
    int64_t n_in_wave = 0;
    for (int e : order) {
        if (served[e]) {
            continue;
        }
        expert_choice c;
        c.expert = e;
        if (n_in_wave >= wave_room && !plan.last) {
            c.how = serve_as::later;
            n_later++;
            plan.choices.push_back(c);
            continue;
        }
        c.slot = skipped_even_cached(e) ? -1 : lookup(il, e, sel.want[e], exact_for(sel, e), c.level);
        if (c.slot >= 0) {
            c.how = serve_as::hit;
            if (use_of(pools[pool_of[c.level][il]].pool->slots[c.slot]) != slot_use::busy) {
                room[c.level]--; // pinned from now on
            } else {
                after_wait[c.level]--; // loading this expert already
            }
            // only a token's first expert is worth an upgrade: it carries the largest gate
            // weight, so serving it low costs the most quality; and each upgrade is a read
            // and a copy competing with decode for the cores
            c.upgrade = c.level > sel.want[e] && sel.top1[e] && params.hit_policy == HOBBIT_HIT_UPGRADE;
        } else if (sel.want[e] == skip) {
            c.how = serve_as::skip;
        } else if (sel.share_low[e] && room[n_level - 1] > 0) {
            c.how = serve_as::load; // the low copy is the cheap read the share is for, cheaper than in place
            c.level = n_level - 1;
            room[c.level]--;
        } else if (in_place_serves(e) && (balanced.empty() ? runs_in_place(il, e, sel.n_pairs[e]) : (bool) balanced[e])) {
            c.how = serve_as::in_place; // cooperative: computed on the mapped model instead of loaded
        } else if ((c.level = level_with_room(e)) >= 0) {
            c.how = serve_as::load;
            room[c.level]--;
        } else if (!plan.has_inplace &&
                   (c.level = first_level(sel.want[e], n_level, exact_for(sel, e), true, [&](int l) { return after_wait[l] > 0; })) >= 0) {
            c.how = serve_as::wait;
            after_wait[c.level]--;
        } else if (!plan.has_inplace && !plan.last && n_later >= later_room &&
                   (c.level = first_level(sel.want[e], n_level, false, true, [&](int l) { return room[l] > 0; })) >= 0) {
            // exactness as far as the waves allow: another level now rather than a last wave
            // with more experts than slots (the wanted level's slots all went to this wave)
            c.how = serve_as::load;
            room[c.level]--;
        } else {
            c.how = plan.must_fit ? serve_as::wait
                  : in_place_serves(e) ? serve_as::in_place
                  : plan.last ? serve_as::wait : serve_as::later;
            n_later += c.how == serve_as::later;
        }
        n_in_wave += c.how == serve_as::hit || c.how == serve_as::load || c.how == serve_as::wait;
        plan.choices.push_back(c);
    }
    return plan;
}

int hobbit_runtime::wait_for_slot(int il, int want, bool exact, const wave_selection & sel, std::unique_lock<std::mutex> & lock,
                                  int & level) {
    // what stands in the way besides this ubatch's own experts: the predictions (unpinned) and
    // the background loads of this graph into the layer's pools (made evictable: the policy
    // then chooses among them as among the rest)
    release_predicted([](int, int, int) { return true; });
    for (int l = 0; l < n_level; ++l) {
        for (pool_slot & ps : pools[pool_of[l][il]].pool->slots) {
            if (ps.pins == 0) {
                ps.background_graph = -1;
            }
        }
    }
    int s = failed() ? -1 : take_slot_near(il, want, exact, true, level, lock);
    if (s < 0 && exact && !failed()) {
        // every slot of the wanted level is taken by this very ubatch: exactness as far
        // as the pools allow, another level rather than a failed run
        s = take_slot_near(il, want, false, true, level, lock);
    }
    if (s < 0 && !failed()) {
        // every slot is taken by this very ubatch: it is wider than the pools
        fail("layer " + std::to_string(il) + " selects " + std::to_string(sel.order.size()) +
             " experts in one ubatch but its pools hold " + std::to_string(layer_capacity(il)) +
             "; use a smaller n_ubatch or a larger expert cache");
    }
    return s;
}

wave_assignment hobbit_runtime::apply_wave(int il, const wave_plan & plan, const wave_selection & sel,
                                           std::unique_lock<std::mutex> & lock, std::vector<load_task> & loads) {
    wave_assignment a(index.info.n_expert);
    std::vector<std::pair<int, int>> upgrade; // (expert, wanted level) hit at a lower precision
    bool plan_loads = false; // a miss of the plan's (not a dropped prefetch's read, which the disk's timing decides)
    const auto serve_in_place = [&](int e) {
        if (!mapped_expert_present(il, e)) {
            return; // the run has failed: the abort callback stops the graph before it computes
        }
        read_ahead_in_place(il, e);
        a.any_inplace = true;
        a.inplace[e]  = true;
        served[e]     = true;
        stats_.expert_inplace++;
        stats_.served[0] += sel.n_pairs[e];
    };
    for (const expert_choice & c : plan.choices) {
        const int e = c.expert;
        int level = c.level;
        int s     = c.slot;
        if (c.how == serve_as::later) {
            continue;
        }
        if (c.how == serve_as::skip) {
            served[e]     = true;
            a.level_of[e] = n_level;
            stats_.n_skipped += sel.n_pairs[e];
            continue;
        }
        if (c.how == serve_as::in_place) {
            serve_in_place(e);
            continue;
        }
        if (c.how == serve_as::hit && pools[pool_of[level][il]].pool->slots[s].state == slot_state::unread) {
            // its dropped read, now needed: read on demand, counted as the miss it is for the disk
            pool_group & pg = pools[pool_of[level][il]];
            stats_.expert_misses++;
            pg.misses++;
            pg.pool->slots[s].prefetched = false;
            pg.pool->slots[s].state = slot_state::loading;
            pg.policy->on_access(s, /*high*/ level == 0);
            loads.push_back(slot_load(pool_of[level][il], s, il, e, /*prefetch*/ false));
            if (c.upgrade) {
                upgrade.emplace_back(e, sel.want[e]); // a hit for the plan, whichever way its read went
            }
        } else if (c.how == serve_as::hit) {
            pool_group & pg = pools[pool_of[level][il]];
            stats_.expert_hits++;
            pg.hits++;
            if (pg.pool->slots[s].prefetched) {
                stats_.prefetch_used++;
                pg.pool->slots[s].prefetched = false;
            }
            pg.policy->on_access(s, /*high*/ level == 0);
            if (c.upgrade) {
                upgrade.emplace_back(e, sel.want[e]);
            }
        } else {
            // load or wait: the plan counted a free or evictable slot for each load, and only
            // waits (which drop prefetches and free slots) change the pools in between
            s = c.how == serve_as::load ? take_slot(pool_of[level][il], &lock) : -1;
            if (s < 0 && (plan.must_fit || c.how == serve_as::wait)) {
                s = wait_for_slot(il, sel.want[e], exact_for(sel, e), sel, lock, level);
            }
            if (s < 0) {
                if (plan.has_inplace) {
                    serve_in_place(e);
                }
                continue; // in place, a later wave, or a failure
            }
            const int p = pool_of[level][il];
            pool_group & pg = pools[p];
            stats_.expert_misses++;
            pg.misses++;
            pg.pool->assign(s, il, e);
            pg.policy->on_insert(s, il, e);
            pg.policy->on_access(s, /*high*/ level == 0);
            loads.push_back(slot_load(p, s, il, e, /*prefetch*/ false));
            plan_loads = true;
        }
        const int p = pool_of[level][il];
        pools[p].pool->slots[s].pins++;
        pinned.emplace_back(p, s);
        a.slot_of[e]  = s;
        a.level_of[e] = level;
        served[e]     = true;
        stats_.served[level] += sel.n_pairs[e];
    }
    // the wanted precision of a lower-precision hit loads in the background: one a graph, from
    // a wave that loads nothing, so upgrades use the disk's idle time and never queue up ahead
    // of what the next layers will need (a rule of the plan, not of the disk's timing: the
    // same text upgrades the same experts; a dropped prefetch read again counts as no load,
    // since whether its read was dropped or had already run is the disk's timing)
    for (const auto & [e, level] : upgrade) {
        if (upgrades_this_graph > 0 || plan_loads) {
            break;
        }
        if (pools[pool_of[level][il]].pool->find(il, e) < 0 &&
            queue_background_load(pool_of[level][il], il, e, /*prefetch*/ false, loads, &lock) >= 0) {
            stats_.upgrades++;
            upgrades_this_graph++;
        }
    }
    return a;
}

std::vector<float> hobbit_runtime::router_scores(const ggml_tensor * probs, int token) const {
    const int n_expert = index.info.n_expert;
    std::vector<float> scores(n_expert);
    for (int e = 0; e < n_expert; ++e) {
        scores[e] = *(const float *) ((const char *) probs->data + e * probs->nb[1] + token * probs->nb[2]);
    }
    // gpt-oss routes on its logits and softmaxes over the selected ones only (llama.cpp's
    // SOFTMAX_WEIGHT): the scores the thresholds compare are the softmax over all of them
    if (strcmp(index.info.arch, "gpt-oss") == 0) {
        const float m = *std::max_element(scores.begin(), scores.end());
        float total = 0.0f;
        for (float & s : scores) {
            total += (s = std::exp(s - m));
        }
        for (float & s : scores) {
            s /= total;
        }
    }
    return scores;
}

void hobbit_runtime::substitute_low_scores(int il, ggml_tensor * dst) {
    ggml_tensor * sel = dst->src[0];   // [n_used, n_tokens] I32 (a view: not contiguous)
    ggml_tensor * wts = dst->src[1];   // [1, n_used, n_tokens] F32
    const ggml_tensor * probs = dst->src[2]; // [1, n_expert, n_tokens] F32
    const int n_expert = index.info.n_expert;
    if (sel->type != GGML_TYPE_I32 || wts->type != GGML_TYPE_F32 || probs == nullptr || probs->type != GGML_TYPE_F32 ||
        probs->ne[1] != n_expert || probs->ne[2] != sel->ne[1]) {
        return;
    }
    const int k = (int) sel->ne[0];
    const int n_tokens = (int) sel->ne[1];
    const auto id_at = [&](int j, int t) { return (int32_t *) ((char *) sel->data + j * sel->nb[0] + t * sel->nb[1]); };
    const auto weight_at = [&](int j, int t) { return (float *) ((char *) wts->data + j * wts->nb[1] + t * wts->nb[2]); };
    std::vector<std::vector<float>> scores(n_tokens), weights(n_tokens, std::vector<float>(k));
    std::vector<std::vector<int>> ids(n_tokens, std::vector<int>(k));
    for (int t = 0; t < n_tokens; ++t) {
        scores[t] = router_scores(probs, t);
        for (int j = 0; j < k; ++j) {
            ids[t][j]     = *id_at(j, t);
            weights[t][j] = *weight_at(j, t);
        }
    }
    std::lock_guard<std::mutex> lock(mtx);
    const std::vector<substitution_plan> plans = plan_batch_substitution(scores, ids, weights, params.substitute_alpha,
        [&](int e) { int level = -1; return find_cached(il, e, level) >= 0; });
    for (int t = 0; t < n_tokens; ++t) {
        for (int j = 0; j < k; ++j) {
            *id_at(j, t)     = plans[t].ids[j];
            *weight_at(j, t) = plans[t].weights[j];
        }
        stats_.n_substituted += plans[t].n_substituted;
    }
}

void hobbit_runtime::dispatch(ggml_tensor * dst, int il, int wave) {
    const int64_t t_enter = now_us();
    const int n_expert = index.info.n_expert;
    // decode's ubatches (one token, or a batch of beams or sequences), never a prompt's wide one
    // (a prompt of a few tokens is served as decoding would serve them one by one)
    if (params.substitute_alpha > 0.0f && wave == 0 &&
        !is_prompt_ubatch((size_t) dst->src[0]->ne[0] * dst->src[0]->ne[1], n_expert)) {
        substitute_low_scores(il, dst);
    }
    const wave_selection sel = read_selection(dst->src[0], dst->src[1], n_expert, thresholds, placed(il));
    const int n_tokens = sel.n_tokens;
    const size_t n_pair = sel.n_pair();
    const int n_plane = (int) dst->ne[2]; // one plane per level + the in-place plane
    int32_t * out         = (int32_t *) dst->data;
    int32_t * out_inplace = out + (size_t) (n_plane - 1) * n_pair;

    std::unique_lock<std::mutex> lock(mtx);
    if (wave == 0 && il == moe_layers.front() && !failed()) {
        check_files_unchanged(); // once a ubatch: an fstat of each part
    }
    wave_assignment a(n_expert);
    if (!failed()) {
        begin_wave(il, wave, sel, dst);
        const bool prompt = is_prompt_ubatch(n_pair, n_expert);
        sweep_rank = prompt ? moe_rank[il] : -1; // a prompt sweeps every layer in order (take_slot)
        const wave_plan plan = plan_wave(il, wave, sel);
        std::vector<load_task> loads;
        a = apply_wave(il, plan, sel, lock, loads);

        const ggml_tensor * x = dst->src[3]; // router input [n_embd, n_tokens]
        const bool x_rows = x->type == GGML_TYPE_F32 && x->ne[0] == index.info.n_embd && x->ne[1] == n_tokens &&
                            x->nb[0] == sizeof(float);
        if (predictor && wave == 0 && n_tokens == 1 && x_rows) {
            prefetch_next_layers(il, (const float *) x->data, loads, lock);
        }
        if (wave == 0 && prompt) {
            if (!a.any_inplace) {
                prefetch_next_layer_whole(il, x_rows ? x : nullptr, loads, lock);
            } else {
                read_ahead_next_layer(il);
            }
        }
        io->submit(loads);
        stats_.peak_pool_bytes = std::max<int64_t>(stats_.peak_pool_bytes, used_pool_bytes());

        // block until every slot this layer uses holds its expert
        const int64_t t0 = now_us();
        n_waiting++;
        cv_loaded.wait(lock, [&] {
            return failed() || std::all_of(pinned.begin(), pinned.end(), [&](const std::pair<int, int> & ps) {
                return pools[ps.first].pool->slots[ps.second].state == slot_state::ready;
            });
        });
        n_waiting--;
        const int64_t waited = now_us() - t0;
        stats_.stall_us += waited;
        last_dispatch_il = il;
        stats_.dispatch_us += now_us() - t_enter - waited; // the id planes below are a copy: not counted
    }

    if (failed()) {
        // the abort callback stops the graph before these ids are used; -1 keeps the
        // matmuls harmless until then
        std::fill(out, out + (size_t) n_plane*n_pair, -1);
        return;
    }
    for (size_t i = 0; i < n_pair; ++i) {
        const int32_t e = sel.ids[i];
        const bool valid = e >= 0 && e < n_expert;
        for (int l = 0; l < n_level; ++l) {
            out[(size_t) l*n_pair + i] = (valid && a.level_of[e] == l) ? a.slot_of[e] : -1;
        }
        out_inplace[i] = (valid && a.inplace[e]) ? e : -1;
    }
}

void hobbit_runtime::on_load_done(const load_task & task, const std::string & error, uint64_t n_bytes, int64_t us) {
    {
        std::lock_guard<std::mutex> lock(mtx);
        stats_.io_us += us;
        const bool rows = !task.ranges.empty(); // neuron rows into a slot that holds the expert
        rows_pending -= rows ? 1 : 0;
        if (!error.empty()) {
            if (!rows) {
                pools[task.group].pool->clear(task.slot);
            }
            fail(error);
        } else {
            pools[task.group].pool->slots[task.slot].state = slot_state::ready;
            stats_.bytes_read += (int64_t) n_bytes;
            stats_.demand_bytes_read += task.prefetch ? 0 : (int64_t) n_bytes;
            stats_.background_bytes_read += task.prefetch ? (int64_t) n_bytes : 0;
            pools[task.group].bytes_read += (int64_t) n_bytes;
            stats_.n_reads++;
            // nobody waits and the graph is between two MoE layers: this read ran under compute
            if (n_waiting == 0 && last_dispatch_il >= 0 && last_dispatch_il != last_moe_layer) {
                stats_.loads_overlapped++;
            }
        }
    }
    cv_loaded.notify_all();
}

void hobbit_runtime::fail(const std::string & msg) {
    if (!has_error.load()) {
        error_msg = msg;
        has_error.store(true, std::memory_order_release);
    }
}

bool hobbit_runtime::mapped_expert_present(int il, int e) {
    for (const expert_proj_layout & p : index.layers[il].proj) {
        if (!p.present) {
            continue;
        }
        const std::string & path = index.parts[p.part];
        struct stat st;
        if (p.part >= (int) part_files.size() || fstat(part_files[p.part].fd, &st) != 0) {
            fail(path + ": cannot stat the model file while running: " + strerror(p.part < (int) part_files.size() ? errno : EBADF));
            return false;
        }
        const uint64_t end = p.offset + (uint64_t) (e + 1) * p.n_bytes;
        if (end > (uint64_t) st.st_size) {
            fail(path + ": truncated while running: expert " + std::to_string(e) + " of layer " + std::to_string(il) +
                 " ends at byte " + std::to_string(end) + ", the file now has " + std::to_string((int64_t) st.st_size));
            return false;
        }
    }
    return true;
}

bool hobbit_runtime::mapping_faulted() const {
    for (const part_file & f : part_files) {
        if (f.guard && f.guard->faulted()) {
            return true;
        }
    }
    return false;
}

int64_t hobbit_runtime::used_pool_bytes() const {
    int64_t n = 0;
    for (const auto & pg : pools) {
        n += pg.pool->n_used() * pg.expert_bytes;
        if (pg.rows) {
            n += (pg.rows->n_page() - pg.rows->n_free()) * (int64_t) pg.rows->page_bytes();
        }
    }
    return n;
}

hobbit_stats hobbit_runtime::stats() const {
    std::lock_guard<std::mutex> lock(mtx);
    return stats_;
}

void hobbit_runtime::reset_stats() {
    std::lock_guard<std::mutex> lock(mtx);
    const hobbit_stats keep = stats_;
    stats_ = {};
    for (pool_group & pg : pools) {
        pg.hits = pg.misses = pg.bytes_read = 0;
    }
    stats_.budget_bytes    = keep.budget_bytes;
    stats_.pool_bytes      = keep.pool_bytes;
    stats_.n_slot          = keep.n_slot;
    stats_.direct_io       = keep.direct_io;
    stats_.n_level         = keep.n_level;
    stats_.mode            = keep.mode;
    stats_.load_bytes_per_s = keep.load_bytes_per_s;
    stats_.map_bytes_per_s = keep.map_bytes_per_s;
    stats_.peak_pool_bytes = used_pool_bytes();
}

bool hobbit_runtime::error(std::string & msg) const {
    std::lock_guard<std::mutex> lock(mtx);
    msg = error_msg;
    if (!has_error.load()) {
        for (size_t part = 0; part < part_files.size(); ++part) {
            if (part_files[part].guard && part_files[part].guard->faulted()) {
                msg = index.parts[part] + ": truncated while running: a read of its mapped weights past the file's new end";
                return true;
            }
        }
    }
    return has_error.load();
}

void hobbit_runtime::clear_error() {
    std::lock_guard<std::mutex> lock(mtx);
    error_msg.clear();
    has_error.store(false);
    // a fault left zero pages in the mapping: the file's own pages again (where it is whole now,
    // the next run reads the model; where it is still cut, the size check or the guard fails it)
    for (part_file & f : part_files) {
        if (f.guard) {
            f.guard->restore(f.fd, 0, MADV_RANDOM);
        }
    }
}

bool hobbit_runtime::pool_stats(int pool, hobbit_pool_stats & out) const {
    std::lock_guard<std::mutex> lock(mtx);
    if (pool < 0 || pool >= (int) pools.size()) {
        return false;
    }
    const pool_group & pg = pools[pool];
    out = {};
    out.hits         = pg.hits;
    out.misses       = pg.misses;
    out.bytes_read   = pg.bytes_read;
    out.expert_bytes = pg.expert_bytes;
    out.n_slot       = pg.pool->n_slot();
    out.n_layer      = pg.n_layer;
    out.level        = pg.level;
    out.type         = pg.type;
    return true;
}

void hobbit_runtime::trace_begin(int lookahead, bool keep_inputs) {
    if (lookahead < 0 || lookahead > 4) {
        throw hobbit_error(HOBBIT_STATUS_ERROR_INVALID, "trace lookahead must be 0..4, got " + std::to_string(lookahead));
    }
    std::vector<router_weights> routers;
    if (lookahead > 0 && model != nullptr) {
        routers = load_routers(model, moe_layers);
    }
    auto rec = std::make_unique<trace_recorder>(moe_layers, index.info.n_expert, index.info.n_expert_used,
                                                index.info.n_embd, lookahead, std::move(routers), keep_inputs);
    std::lock_guard<std::mutex> lock(mtx);
    recorder = std::move(rec);
}

int64_t hobbit_runtime::trace_size(int & n_moe_layer, int & lookahead) const {
    std::lock_guard<std::mutex> lock(mtx);
    n_moe_layer = (int) moe_layers.size();
    lookahead = recorder ? recorder->lookahead() : 0;
    return recorder ? recorder->n_tokens() : 0;
}

void hobbit_runtime::trace_copy(int64_t n, int32_t * experts, float * weights, float * probs, int32_t * predicted,
                                float * inputs) const {
    std::lock_guard<std::mutex> lock(mtx);
    if (recorder) {
        recorder->copy(std::min(n, recorder->n_tokens()), experts, weights, probs, predicted, inputs);
    }
}

void hobbit_runtime::trace_end() {
    std::lock_guard<std::mutex> lock(mtx);
    recorder.reset();
}

void hobbit_runtime::new_sequence() {
    std::lock_guard<std::mutex> lock(mtx);
    for (pool_group & pg : pools) {
        pg.policy->reset();
    }
}
