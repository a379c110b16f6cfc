#include "hobbit-runtime.h"

#include "hobbit-error.h"

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstring>

// the names of hobbit.h's enum hobbit_policy, in its order
static std::string policy_name(int policy) {
    static const char * names[] = { "lru", "lfu", "lhu", "fld", "random", "weighted" };
    return policy >= 0 && policy < 6 ? names[policy] : "?";
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
    if (info.n_split > 1) {
        throw hobbit_error(HOBBIT_STATUS_ERROR_FORMAT, path + ": split GGUF files (" + std::to_string(info.n_split) +
            " parts) cannot be offloaded yet; the index covers one file");
    }
    if (info.n_layer_moe == 0) {
        throw hobbit_error(HOBBIT_STATUS_ERROR_NOT_MOE, path + ": the model has no routed experts (a dense model); nothing to offload");
    }
    const std::vector<pool_plan_group> plan = pool_plan_make(index, params.budget_bytes);
    cache_policy_kind policy_kind;
    if (!cache_policy_parse(policy_name(params.policy), policy_kind)) {
        throw hobbit_error(HOBBIT_STATUS_ERROR_INVALID, "unknown cache policy " + std::to_string((int) params.policy));
    }
    const cache_policy_weights weights = { params.policy_weights.lru, params.policy_weights.lfu,
                                           params.policy_weights.lhu, params.policy_weights.fld };
    group_of_layer.assign(info.n_layer, -1);
    for (int il = 0; il < info.n_layer; ++il) {
        if (index.layers[il].has_experts()) {
            moe_layers.push_back(il);
        }
    }
    for (size_t g = 0; g < plan.size(); ++g) {
        for (int il : plan[g].layers) {
            group_of_layer[il] = (int) g;
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

    int64_t n_slot_total = 0;
    for (const pool_plan_group & g : plan) {
        pool_group pg;
        pg.expert_bytes = g.expert_bytes;
        pg.pool   = std::make_unique<expert_pool>(index.layers[g.layers.front()], info.n_layer, info.n_expert, info.n_expert_used, g.n_slot);
        pg.policy = cache_policy_make(policy_kind, g.n_slot, info.n_layer, info.n_expert, weights, params.seed);
        pg.n_layer = (int) g.layers.size();
        stats_.pool_bytes += g.n_slot * g.expert_bytes;
        n_slot_total += g.n_slot;
        groups.push_back(std::move(pg));
    }
    if (params.prefetch_layers > 0 && model != nullptr) {
        predictor = predictor_make_next_layer_gate(load_routers(model, moe_layers), info.n_embd, info.n_expert_used);
    }
    io = std::make_unique<io_scheduler>(index, params.direct_io, params.n_io_threads,
        [this](const load_task & t, const std::string & err, uint64_t n, int64_t us) { on_load_done(t, err, n, us); });

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
        const expert_pool & pool = *groups[group_of_layer[il]].pool;
        lo.n_pool = 1; // one precision for now; mixed precision adds a pool per level
        for (int p = 0; p < LLAMA_MOE_PROJ_COUNT; ++p) {
            lo.pools[0].w[p] = pool.weights(p);
        }
        lo.pools[0].n_slot = pool.n_slot();
        // experts run in place only when a ubatch selects more pairs than there are slots,
        // and never from a repacked pool: the mapped original would take other kernels
        // than stock, so such a ubatch runs in waves instead (n_waves)
        lo.inplace_min_pairs = pool.repacked() ? INT32_MAX : pool.n_slot() + 1;
        lo.dispatch    = &hobbit_runtime::dispatch_op;
    }
    offload_desc.n_layer  = info.n_layer;
    offload_desc.layers   = layers.data();
    offload_desc.ctx      = this;
    offload_desc.free_ctx = [](void * ctx) { delete (hobbit_runtime *) ctx; };

    stats_.budget_bytes = params.budget_bytes;
    stats_.n_slot       = (int32_t) n_slot_total;
    stats_.direct_io    = io->direct_io();
}

hobbit_runtime::~hobbit_runtime() {
    io.reset(); // stop the I/O thread before the pool it writes into goes away
}

void hobbit_runtime::dispatch_op(ggml_tensor * dst, int ith, int nth, void * ud) {
    (void) nth;
    if (ith != 0) {
        return;
    }
    const auto * d = (const dispatch_ud *) ud;
    d->rt->dispatch(dst, d->il, d->wave);
}

int32_t hobbit_runtime::n_waves_op(void * ctx, int32_t n_tokens) {
    const auto * d = (const dispatch_ud *) ctx;
    return d->rt->n_waves(d->il, n_tokens);
}

int hobbit_runtime::n_waves(int il, int n_tokens) const {
    // a pool whose experts may not run in place serves a wide ubatch in several waves
    const expert_pool & pool = *groups[group_of_layer[il]].pool;
    const int n_expert = index.info.n_expert;
    if (!pool.repacked() || pool.n_slot() >= n_expert) {
        return 1;
    }
    const int64_t distinct = std::min<int64_t>((int64_t) n_tokens * index.info.n_expert_used, n_expert);
    return (int) std::min<int64_t>(LLAMA_MOE_MAX_WAVES, (distinct + pool.n_slot() - 1) / pool.n_slot());
}

int hobbit_runtime::take_slot(int g) {
    const expert_pool & pool = *groups[g].pool;
    std::vector<int> candidates;
    for (int s = 0; s < pool.n_slot(); ++s) {
        const pool_slot & slot = pool.slots[s];
        if (slot.state == slot_state::empty) {
            return s;
        }
        if (slot.state == slot_state::ready && slot.pins == 0) {
            candidates.push_back(s);
        }
    }
    return candidates.empty() ? -1 : groups[g].policy->choose_victim(candidates);
}

void hobbit_runtime::dispatch(ggml_tensor * dst, int il, int wave) {
    const ggml_tensor * sel = dst->src[0];
    const int n_used   = (int) sel->ne[0];
    const int n_tokens = (int) sel->ne[1];
    const int n_expert = index.info.n_expert;
    const int n_plane = (int) dst->ne[2];                       // pools + the in-place plane
    int32_t * out_slot    = (int32_t *) dst->data;               // plane 0: the pool
    int32_t * out_inplace = out_slot + (size_t) (n_plane - 1) * n_used * n_tokens; // last plane

    // selection as ids [n_tokens][n_used] (the top-k view is not contiguous)
    std::vector<int32_t> ids((size_t) n_used * n_tokens);
    std::vector<int> n_pairs(n_expert, 0);
    std::vector<int> order;
    for (int t = 0; t < n_tokens; ++t) {
        for (int k = 0; k < n_used; ++k) {
            const int32_t e = *(const int32_t *) ((const char *) sel->data + t*sel->nb[1] + k*sel->nb[0]);
            ids[(size_t) t*n_used + k] = e;
            if (e >= 0 && e < n_expert && n_pairs[e]++ == 0) {
                order.push_back(e);
            }
        }
    }
    const int g = group_of_layer[il];
    expert_pool & pool = *groups[g].pool;
    cache_policy_i & policy = *groups[g].policy;

    // when the ubatch needs more experts than there are slots, the experts with the most
    // tokens get the slots; the rest run in place (one wave) or in the next waves
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return n_pairs[a] > n_pairs[b]; });
    const bool has_inplace = (int64_t) n_used * n_tokens >= layers[il].inplace_min_pairs;
    const bool last_wave   = wave == n_waves(il, n_tokens) - 1;
    // with no in-place pass and no wave after this one, every expert left must get a slot
    const bool must_fit    = last_wave && !has_inplace;

    std::vector<int> slot_of_expert(n_expert, -1);
    std::vector<load_task> loads;
    std::unique_lock<std::mutex> lock(mtx);

    if (wave == 0) {
        served.assign(n_expert, false);
    }
    // experts already in the pool first: they cost nothing this wave
    std::stable_partition(order.begin(), order.end(), [&](int e) { return pool.find(il, e) >= 0; });

    if (!failed()) {
        // the previous wave's or layer's matmuls are done: their slots may go
        for (const auto & [pg, s] : pinned) {
            groups[pg].pool->slots[s].pins--;
        }
        pinned.clear();
        for (pool_group & pg : groups) {
            pg.policy->on_layer(il);
        }
        if (recorder && wave == 0) {
            recorder->record(il, sel, dst->src[1], dst->src[2], dst->src[3]);
        }

        for (int e : order) {
            if (served[e]) {
                continue;
            }
            int s = pool.find(il, e);
            if (s >= 0) {
                stats_.expert_hits++;
                groups[g].hits++;
                if (pool.slots[s].prefetched) {
                    stats_.prefetch_used++;
                    pool.slots[s].prefetched = false;
                }
                policy.on_access(s, /*high*/ true);
            } else {
                s = take_slot(g);
                while (s < 0 && must_fit && !failed()) {
                    // prefetches stand in the way: drop the queued ones, wait for a running one
                    for (const load_task & t : io->drop_prefetches([g](const load_task & t) { return t.group == g; })) {
                        groups[t.group].pool->clear(t.slot);
                    }
                    s = take_slot(g);
                    if (s >= 0) {
                        break;
                    }
                    const bool prefetch_running = std::any_of(pool.slots.begin(), pool.slots.end(),
                        [](const pool_slot & ps) { return ps.state == slot_state::loading && ps.pins == 0; });
                    if (!prefetch_running) {
                        // every slot is taken by this very ubatch: it is wider than the pool
                        fail("layer " + std::to_string(il) + " selects " + std::to_string(order.size()) +
                             " experts in one ubatch but its pool has " + std::to_string(pool.n_slot()) +
                             " slots; use a smaller n_ubatch or a larger expert cache");
                        break;
                    }
                    cv_loaded.wait(lock);
                    s = take_slot(g);
                }
                if (s < 0) {
                    if (has_inplace) {
                        stats_.expert_inplace++;
                        served[e] = true;
                    }
                    continue; // in place, or a later wave
                }
                stats_.expert_misses++;
                groups[g].misses++;
                pool.assign(s, il, e);
                policy.on_insert(s, il, e);
                policy.on_access(s, /*high*/ true);
                load_task task = { g, s, il, e, /*prefetch*/ false, {}, {} };
                pool.slot_targets(s, task.dst, task.view);
                loads.push_back(task);
            }
            pool.slots[s].pins++;
            pinned.emplace_back(g, s);
            slot_of_expert[e] = s;
            served[e] = true;
        }

        const ggml_tensor * x = dst->src[3]; // router input [n_embd, n_tokens]
        if (predictor && wave == 0 && n_tokens == 1 && x->type == GGML_TYPE_F32 && x->ne[0] == index.info.n_embd) {
            std::vector<std::pair<int, int>> wanted;
            predictor->predict(il, (const float *) x->data, wanted);
            for (const auto & [l, e] : wanted) {
                const int lg = group_of_layer[l];
                expert_pool & lpool = *groups[lg].pool;
                if (lpool.find(l, e) >= 0) {
                    continue;
                }
                const int s = take_slot(lg);
                if (s < 0) {
                    break;
                }
                lpool.assign(s, l, e);
                lpool.slots[s].prefetched = true;
                groups[lg].policy->on_insert(s, l, e);
                load_task task = { lg, s, l, e, /*prefetch*/ true, {}, {} };
                lpool.slot_targets(s, task.dst, task.view);
                loads.push_back(task);
                stats_.prefetch_issued++;
            }
        }
        io->submit(loads);
        stats_.peak_pool_bytes = std::max<int64_t>(stats_.peak_pool_bytes, used_pool_bytes());

        // block until every slot this layer uses holds its expert
        const int64_t t0 = now_us();
        n_waiting++;
        cv_loaded.wait(lock, [&] {
            return failed() || std::all_of(pinned.begin(), pinned.end(), [&](const std::pair<int, int> & gs) {
                return groups[gs.first].pool->slots[gs.second].state == slot_state::ready;
            });
        });
        n_waiting--;
        stats_.stall_us += now_us() - t0;
        last_dispatch_il = il;
    }

    if (failed()) {
        // the abort callback stops the graph before these ids are used; -1 keeps the
        // matmuls harmless until then
        std::fill(out_slot, out_slot + (size_t) n_plane*n_used*n_tokens, -1);
        return;
    }
    for (size_t i = 0; i < ids.size(); ++i) {
        const int32_t e = ids[i];
        const int s = (e >= 0 && e < n_expert) ? slot_of_expert[e] : -1;
        out_slot[i]    = s;
        out_inplace[i] = (s < 0 && has_inplace) ? e : -1;
    }
}

void hobbit_runtime::on_load_done(const load_task & task, const std::string & error, uint64_t n_bytes, int64_t us) {
    {
        std::lock_guard<std::mutex> lock(mtx);
        stats_.io_us += us;
        if (!error.empty()) {
            groups[task.group].pool->clear(task.slot);
            fail(error);
        } else {
            groups[task.group].pool->slots[task.slot].state = slot_state::ready;
            stats_.bytes_read += (int64_t) n_bytes;
            groups[task.group].bytes_read += (int64_t) n_bytes;
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

int64_t hobbit_runtime::used_pool_bytes() const {
    int64_t n = 0;
    for (const auto & pg : groups) {
        n += pg.pool->n_used() * pg.expert_bytes;
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
    for (pool_group & pg : groups) {
        pg.hits = pg.misses = pg.bytes_read = 0;
    }
    stats_.budget_bytes    = keep.budget_bytes;
    stats_.pool_bytes      = keep.pool_bytes;
    stats_.n_slot          = keep.n_slot;
    stats_.direct_io       = keep.direct_io;
    stats_.peak_pool_bytes = used_pool_bytes();
}

bool hobbit_runtime::error(std::string & msg) const {
    std::lock_guard<std::mutex> lock(mtx);
    msg = error_msg;
    return has_error.load();
}

void hobbit_runtime::clear_error() {
    std::lock_guard<std::mutex> lock(mtx);
    error_msg.clear();
    has_error.store(false);
}

bool hobbit_runtime::pool_stats(int pool, hobbit_pool_stats & out) const {
    std::lock_guard<std::mutex> lock(mtx);
    if (pool < 0 || pool >= (int) groups.size()) {
        return false;
    }
    const pool_group & pg = groups[pool];
    out = {};
    out.hits         = pg.hits;
    out.misses       = pg.misses;
    out.bytes_read   = pg.bytes_read;
    out.expert_bytes = pg.expert_bytes;
    out.n_slot       = pg.pool->n_slot();
    out.n_layer      = pg.n_layer;
    return true;
}

void hobbit_runtime::trace_begin(int lookahead) {
    if (lookahead < 0 || lookahead > 4) {
        throw hobbit_error(HOBBIT_STATUS_ERROR_INVALID, "trace lookahead must be 0..4, got " + std::to_string(lookahead));
    }
    std::vector<router_weights> routers;
    if (lookahead > 0 && model != nullptr) {
        routers = load_routers(model, moe_layers);
    }
    auto rec = std::make_unique<trace_recorder>(moe_layers, index.info.n_expert, index.info.n_expert_used,
                                                index.info.n_embd, lookahead, std::move(routers));
    std::lock_guard<std::mutex> lock(mtx);
    recorder = std::move(rec);
}

int64_t hobbit_runtime::trace_size(int & n_moe_layer, int & lookahead) const {
    std::lock_guard<std::mutex> lock(mtx);
    n_moe_layer = (int) moe_layers.size();
    lookahead = recorder ? recorder->lookahead() : 0;
    return recorder ? recorder->n_tokens() : 0;
}

void hobbit_runtime::trace_copy(int64_t n, int32_t * experts, float * weights, float * probs, int32_t * predicted) const {
    std::lock_guard<std::mutex> lock(mtx);
    if (recorder) {
        recorder->copy(std::min(n, recorder->n_tokens()), experts, weights, probs, predicted);
    }
}

void hobbit_runtime::trace_end() {
    std::lock_guard<std::mutex> lock(mtx);
    recorder.reset();
}

void hobbit_runtime::new_sequence() {
    std::lock_guard<std::mutex> lock(mtx);
    for (pool_group & pg : groups) {
        pg.policy->reset();
    }
}
