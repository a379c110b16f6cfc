#include "hobbit-cache-sim.h"

#include "hobbit-error.h"
#include "hobbit-expert-cache.h"
#include "hobbit-expert-pool.h"
#include "hobbit-substitution.h"

#include <algorithm>
#include <numeric>
#include <string>
#include <vector>

namespace {

// the runtime around a simulated cache: nothing runs in place, a load completes as it is queued (so
// no read is ever waiting to be dropped), and nothing fails but a step wider than the pool
struct sim_env : cache_env {
    bool has_failed = false;
    bool runs_in_place(int, int, int) const override { return false; }
    std::vector<bool> balanced_in_place(int, const wave_selection &, const std::vector<int> &,
                                        const std::function<bool(int)> &) const override { return {}; }
    bool prepare_in_place(int, int) override { return true; }
    std::vector<load_task> drop_queued(const std::function<bool(const load_task &)> &) override { return {}; }
    bool failed() const override { return has_failed; }
    void fail(const std::string &) override { has_failed = true; }
};

} // namespace

cache_sim_result cache_simulate(const cache_sim_trace & tr, int n_slot, bool belady, cache_policy_kind kind,
                                const cache_policy_weights & weights, uint64_t seed, double low_miss_cost,
                                float substitute_alpha) {
    const int K = tr.n_expert_used;
    // the runtime's cache for a uniform model: one level, one pool shared by every MoE layer
    expert_cache_setup setup;
    setup.n_layer       = tr.n_layer;
    setup.n_expert      = tr.n_expert;
    setup.n_expert_used = K;
    setup.n_level       = 1;
    cache_pool_setup pool;
    pool.n_slot       = n_slot;
    pool.expert_bytes = 1;
    for (int l = 0; l < tr.n_layer; ++l) {
        setup.moe_layers.push_back(l);
        pool.layers.push_back(l);
    }
    setup.pools          = { pool };
    setup.policy         = kind;
    setup.policy_weights = weights;
    setup.seed           = seed;
    setup.popularity     = tr.popularity;
    if (belady) {
        setup.make_policy = [&](int n) {
            return cache_policy_make_belady(tr.experts, (int64_t) tr.n_tokens * tr.n_layer, tr.n_layer, tr.n_expert, K, n);
        };
    }
    sim_env env;
    expert_cache cache(setup, env);

    const int n_prefetch = belady || tr.predicted == nullptr ? 0 : std::min(tr.prefetch_layers, tr.n_lookahead);
    const bool substitute = substitute_alpha > 0.0f && tr.scores != nullptr && !belady;
    const precision_thresholds one_level; // every selection wants the one level
    cache_sim_result r;
    std::vector<int32_t> ids(K);
    std::vector<float> unused_weights(K, 0.0f);
    std::vector<load_task> loads;
    for (int t = 0; t < tr.n_tokens && !env.has_failed; ++t) {
        if (tr.seq_start && tr.seq_start[t]) {
            cache.new_sequence();
        }
        for (int l = 0; l < tr.n_layer; ++l) {
            const int64_t step = (int64_t) t * tr.n_layer + l;
            ids.assign(tr.experts + step * K, tr.experts + (step + 1) * K);
            const float * scores = tr.scores != nullptr ? tr.scores + step * tr.n_expert : nullptr;
            if (substitute) {
                // as the runtime's decode does, against the cache as it is
                const std::vector<bool> cached = cache.cached_experts(l);
                const substitution_plan plan = plan_substitution(std::vector<float>(scores, scores + tr.n_expert),
                    std::vector<int>(ids.begin(), ids.end()), unused_weights, substitute_alpha,
                    [&](int e) { return (bool) cached[e]; });
                ids.assign(plan.ids.begin(), plan.ids.end());
                r.substituted += plan.n_substituted;
            }
            wave_selection sel = read_selection_of(ids.data(), nullptr, K, 1, tr.n_expert, one_level, nullptr);
            if (tr.high_precision != nullptr) {
                // HOBBIT's one mixed pool: a selection served low is counted so by the policies (LHU)
                sel.counted_low.assign(tr.n_expert, false);
                for (int k = 0; k < K; ++k) {
                    if (ids[k] >= 0 && ids[k] < tr.n_expert && tr.high_precision[step * K + k] == 0) {
                        sel.counted_low[ids[k]] = true;
                    }
                }
            }
            const std::vector<std::vector<float>> token_scores =
                scores != nullptr && cache.reads_scores() ? std::vector<std::vector<float>>{ { scores, scores + tr.n_expert } }
                                                          : std::vector<std::vector<float>>{};
            cache.serve_wave(l, 0, -1, 0, sel, token_scores, loads);
            for (int e : sel.order) {
                const bool loaded = std::any_of(loads.begin(), loads.end(), [&](const load_task & task) { return task.expert == e; });
                r.accesses++;
                r.hits        += !loaded;
                r.misses_high += loaded && (sel.counted_low.empty() || !sel.counted_low[e]);
                r.misses_low  += loaded && !sel.counted_low.empty() && sel.counted_low[e];
            }
            // the next layers' guesses (the runtime's decode prefetch), each at the one level
            std::vector<predicted_layer> predicted;
            for (int p = 1; p <= n_prefetch && l + p < tr.n_layer; ++p) {
                const int32_t * guess = tr.predicted + (step * tr.n_lookahead + (p - 1)) * K;
                predicted_layer pl;
                pl.il = l + p;
                for (int k = 0; k < K; ++k) {
                    if (guess[k] >= 0 && guess[k] < tr.n_expert) {
                        pl.experts.push_back(guess[k]);
                        pl.levels.push_back(0);
                    }
                }
                predicted.push_back(std::move(pl));
            }
            const size_t n_demand = loads.size();
            cache.prefetch_predicted(predicted, loads);
            r.prefetched += (int64_t) (loads.size() - n_demand);
            for (const load_task & task : loads) {
                cache.load_done(task, true, 0); // at once
            }
            loads.clear();
            cache.wait_for_pins(l);
        }
    }
    r.prefetch_used = cache.counters().prefetch_used;
    r.miss_penalty  = (double) r.misses_high + (double) r.misses_low * low_miss_cost;
    return r;
}

hobbit_stats cache_replay(const model_levels & levels, const hobbit_params & params, const cache_replay_trace & tr) {
    const hobbit_model_info & info = levels.index.info;
    const std::string path = levels.index.path;
    const runtime_plan plan = plan_runtime(levels, params, path);
    if (params.prefetch_layers > 0 || params.substitute_alpha > 0.0f || params.mode != HOBBIT_MODE_GPU_CENTRIC ||
        params.neuron_threshold >= 0.0f || plan.neuron_reads) {
        throw hobbit_error(HOBBIT_STATUS_ERROR_INVALID, "a replay serves every miss from the cache without prediction: "
            "gpu-centric mode, no prefetch, no substitution, no neuron options");
    }
    if (tr.n_layer != (int) plan.moe_layers.size() || tr.n_expert != info.n_expert || tr.n_expert_used != info.n_expert_used ||
        tr.n_tokens < 0 || tr.experts == nullptr || tr.weights == nullptr) {
        throw hobbit_error(HOBBIT_STATUS_ERROR_INVALID, path + ": the trace is not of this model's shape (" +
            std::to_string(plan.moe_layers.size()) + " MoE layers, " + std::to_string(info.n_expert) + " experts, top-" +
            std::to_string(info.n_expert_used) + "), or lacks its experts or weights");
    }
    // where a ubatch wider than the pools computes its overflow in place, as the runtime's executor
    // decides it: the pools' buffer types as the runtime would make them
    const bool pools_on_cpu = ggml_backend_dev_type(expert_pool_device()) == GGML_BACKEND_DEVICE_TYPE_CPU;
    expert_cache_setup setup = plan.cache_setup(levels, params);
    setup.inplace_ok = plan_inplace_layers(levels, plan, params, /*model_mapped*/ true, [&](int p) {
        const cache_pool_setup & pool = plan.pools[p].cache;
        const expert_layer_layout & shape = levels.level(pool.level).layers[pool.layers.front()];
        bool repacked = false;
        for (const expert_proj_layout & pl : shape.proj) {
            repacked = repacked || (pl.present && expert_weight_repacked(pl.type, pl.ne[0], pl.ne[1], info.n_expert_used,
                                                                     params.cpu_repack));
        }
        return pools_on_cpu && repacked;
    });
    setup.inplace_any_width = false; // gpu-centric: in place only for what a ubatch has beyond the pools
    sim_env env;
    expert_cache cache(setup, env);
    const int K = tr.n_expert_used;
    const int n_layer = tr.n_layer;
    hobbit_stats st = {};
    st.budget_bytes = params.budget_bytes;
    st.pool_bytes   = plan.pool_bytes;
    st.n_slot       = (int32_t) plan.n_slot;
    st.n_level      = levels.n_level;
    st.mode         = HOBBIT_MODE_GPU_CENTRIC;
    std::vector<load_task> loads;
    const auto complete = [&]() {
        for (const load_task & task : loads) {
            const int64_t bytes = plan.pools[task.group].cache.expert_bytes;
            st.bytes_read            += bytes;
            st.demand_bytes_read     += task.prefetch ? 0 : bytes;
            st.background_bytes_read += task.prefetch ? bytes : 0;
            st.n_reads++;
            cache.load_done(task, true, (uint64_t) bytes);
        }
        loads.clear();
    };
    if (plan.warm_deepest >= 0) {
        cache.warm(plan.warm_order(info.n_expert), [&](int il) { return plan.placed(il); }, plan.warm_deepest, loads);
        complete();
    }
    std::vector<int32_t> ids;
    std::vector<float> wts;
    for (int t0 = 0; t0 < tr.n_tokens && !env.has_failed;) {
        int t1 = t0 + 1;
        while (t1 < tr.n_tokens && tr.ubatch_start != nullptr && !tr.ubatch_start[t1]) {
            t1++;
        }
        const int n = t1 - t0;
        if (tr.seq_start != nullptr && tr.seq_start[t0]) {
            cache.new_sequence();
        }
        for (int i = 0; i < n_layer && !env.has_failed; ++i) {
            const int il = plan.moe_layers[i];
            ids.resize((size_t) n * K);
            wts.resize((size_t) n * K);
            for (int t = 0; t < n; ++t) {
                for (int k = 0; k < K; ++k) {
                    const size_t at = ((size_t) (t0 + t) * n_layer + i) * K + k;
                    ids[(size_t) t * K + k] = tr.experts[at];
                    wts[(size_t) t * K + k] = tr.weights[at];
                }
            }
            // the dispatch's waves: each level's in turn where hits exact serve a ubatch level by level
            const int per_level = cache.waves_of_level(il, n);
            for (int wave = 0; wave < cache.n_waves(il, n) && !env.has_failed; ++wave) {
                const int level_of_wave = cache.waves_by_level(n) ? wave / per_level : -1;
                const wave_selection sel = read_selection_of(ids.data(), wts.data(), K, n, info.n_expert, plan.thresholds,
                                                             plan.placed(il), level_of_wave);
                const wave_assignment a = cache.serve_wave(il, wave, level_of_wave, wave % per_level, sel, {}, loads);
                if (wave == 0 && is_prompt_ubatch(sel.n_pair(), info.n_expert) && !a.any_inplace && i + 1 < n_layer) {
                    // a prompt's next MoE layer, loaded whole in expert order (no predictor to order it)
                    std::vector<int> order(info.n_expert);
                    std::iota(order.begin(), order.end(), 0);
                    cache.prefetch_layer_whole(plan.moe_layers[i + 1], order, std::vector<bool>(info.n_expert, false), loads);
                }
                complete();
                cache.wait_for_pins(il);
            }
        }
        t0 = t1;
    }
    if (env.has_failed) {
        throw hobbit_error(HOBBIT_STATUS_ERROR_BUDGET, path + ": a ubatch of the trace selects more experts than the pools hold");
    }
    cache.counters().write_to(st);
    st.loads_overlapped = 0; // loads complete at once here: none ran under compute
    return st;
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
