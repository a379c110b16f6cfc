// hobbit-runtime-waves.cpp - The runtime's dispatch: a ubatch's selections read and served wave by wave by the
// expert cache, what the cache asks of the runtime (where a missed expert may run in place, the I/O queue),
// substitution of low-score misses, and completed loads.

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
#include <deque>
#include <map>
#include <numeric>

bool hobbit_runtime::runs_in_place(int il, int e, int n_tokens) const {
    return executor.inplace_ok[il] && executor.in_place(n_tokens, measures_residency() ? resident(il, e) : 0.0,
                                               (int64_t) levels.index.layers[il].n_bytes() * levels.index.info.n_expert,
                                               page_cache_room());
}

// does the executor choice look at what the page cache holds (auto, balanced)?
bool hobbit_runtime::measures_residency() const {
    return executor.mode == HOBBIT_MODE_AUTO || executor.mode == HOBBIT_MODE_BALANCED;
}

std::vector<bool> hobbit_runtime::balanced_in_place(int il, const wave_selection & sel, const std::vector<int> & misses,
                                                    const std::function<bool(int)> & either_way) const {
    if (executor.mode != HOBBIT_MODE_BALANCED) {
        return {};
    }
    std::vector<bool> in_place(levels.index.info.n_expert, false);
    // under a tight cap the page cache has no room for what in place faults in: every miss loads
    if (!page_cache_holds_two_layers((int64_t) levels.index.layers[il].n_bytes() * levels.index.info.n_expert, page_cache_room())) {
        return in_place;
    }
    std::vector<int> experts;
    std::vector<miss_cost> costs;
    for (int e : misses) {
        if (either_way(e)) {
            experts.push_back(e);
            costs.push_back(executor.cost(sel.n_pairs[e], (int64_t) levels.index.layers[il].n_bytes(), resident(il, e)));
        }
    }
    const std::vector<bool> split = balance_misses(costs);
    for (size_t i = 0; i < experts.size(); ++i) {
        in_place[experts[i]] = split[i];
    }
    return in_place;
}

// what the page cache may hold now beside the pools, or -1 if no limit is known
int64_t hobbit_runtime::page_cache_room() const {
    // pool memory is committed as slots are first written and stays; what is not yet
    // committed is still free for the page cache
    if (params.page_cache_room_bytes < 0) {
        return -1;
    }
    std::lock_guard<std::mutex> lock(mtx);
    return params.page_cache_room_bytes + stats_.pool_bytes - stats_.peak_pool_bytes;
}

// the share of expert e of layer il resident in the page cache (its slices of the mapped model)
double hobbit_runtime::resident(int il, int e) const {
    uint64_t total = 0;
    double resident_bytes = 0.0;
    for (int p = 0; p < LLAMA_MOE_PROJ_COUNT; ++p) {
        const ggml_tensor * t = llama_model_get_expert_tensor(files.model(), il, (llama_moe_proj) p);
        if (t == nullptr || t->data == nullptr) {
            continue;
        }
        const size_t n = t->nb[2];
        resident_bytes += resident_share((const char *) t->data + (size_t) e * n, n) * n;
        total += n;
    }
    return total > 0 ? resident_bytes / total : 0.0;
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
    return d->rt->cache->n_waves(d->il, n_tokens);
}

bool hobbit_runtime::prepare_in_place(int il, int e) {
    // a file cut while running: computing the expert in place would fault on pages past its end (SIGBUS)
    const std::string missing = files.expert_missing(il, e);
    if (!missing.empty()) {
        fail(missing);
        return false;
    }
    files.read_ahead_expert(il, e); // exactly its slices (the mapping reads no further than a fault's page)
    return true;
}

std::vector<load_task> hobbit_runtime::drop_queued(const std::function<bool(const load_task &)> & pred) {
    const std::deque<load_task> dropped = io->drop_prefetches(pred);
    return std::vector<load_task>(dropped.begin(), dropped.end());
}

void hobbit_runtime::submit(std::vector<load_task> & loads) {
    for (load_task & t : loads) {
        if (t.ranges.empty()) { // a whole expert into its slot's tensors (rows come with their own targets)
            pools.tensors[t.group]->slot_targets(t.slot, t.dst, t.view);
        }
    }
    io->submit(loads);
}

// a token's router scores of every expert from the dispatch op's probs ([1, n_expert, n_tokens]),
// as probabilities (gpt-oss's logits softmaxed)
std::vector<float> hobbit_runtime::router_scores(const ggml_tensor * probs, int token) const {
    const int n_expert = levels.index.info.n_expert;
    std::vector<float> scores(n_expert);
    for (int e = 0; e < n_expert; ++e) {
        scores[e] = *(const float *) ((const char *) probs->data + e * probs->nb[1] + token * probs->nb[2]);
    }
    // gpt-oss routes on its logits and softmaxes over the selected ones only (llama.cpp's
    // SOFTMAX_WEIGHT): the scores the thresholds compare are the softmax over all of them
    if (strcmp(levels.index.info.arch, "gpt-oss") == 0) {
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

// importance-driven substitution (hobbit-substitution.h) for a decode ubatch (one token, or
// a batch of beams or sequences, where an expert another token selects counts as cached:
// Algorithm 2's batch rule): rewrites the dispatch op's selected ids and gate weights
// (src[0], src[1]) before the wave reads them; the graph's later ops (the weighted sum,
// gpt-oss's per-expert bias) read them too
void hobbit_runtime::substitute_low_scores(int il, ggml_tensor * dst) {
    ggml_tensor * sel = dst->src[0];   // [n_used, n_tokens] I32 (a view: not contiguous)
    ggml_tensor * wts = dst->src[1];   // [1, n_used, n_tokens] F32
    const ggml_tensor * probs = dst->src[2]; // [1, n_expert, n_tokens] F32
    const int n_expert = levels.index.info.n_expert;
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
    const std::vector<bool> cached = cache->cached_experts(il);
    const std::vector<substitution_plan> plans = plan_batch_substitution(scores, ids, weights, params.substitute_alpha,
        [&](int e) { return (bool) cached[e]; });
    std::lock_guard<std::mutex> lock(mtx);
    for (int t = 0; t < n_tokens; ++t) {
        for (int j = 0; j < k; ++j) {
            *id_at(j, t)     = plans[t].ids[j];
            *weight_at(j, t) = plans[t].weights[j];
        }
        stats_.n_substituted += plans[t].n_substituted;
    }
}

// runs on the compute thread, blocking until this wave's experts are in the pools: read the
// selection, the cache serves the wave, prefetch, submit, wait, write the id planes
void hobbit_runtime::dispatch(ggml_tensor * dst, int il, int wave) {
    const int64_t t_enter = runtime_clock_us();
    const int n_expert = levels.index.info.n_expert;
    // decode's ubatches (one token, or a batch of beams or sequences), never a prompt's wide one
    // (a prompt of a few tokens is served as decoding would serve them one by one)
    if (params.substitute_alpha > 0.0f && wave == 0 &&
        !is_prompt_ubatch((size_t) dst->src[0]->ne[0] * dst->src[0]->ne[1], n_expert)) {
        substitute_low_scores(il, dst);
    }
    // hits "exact" level by level: the waves of each level in turn, wave = level * per_level + wave of the level
    const int n_ubatch_tokens = (int) dst->src[0]->ne[1];
    const int per_level = cache->waves_of_level(il, n_ubatch_tokens);
    const int level_of_wave = cache->waves_by_level(n_ubatch_tokens) ? wave / per_level : -1;
    const int wave_of_level = wave % per_level;
    const wave_selection sel = read_selection(dst->src[0], dst->src[1], n_expert, plan.thresholds, plan.placed(il), level_of_wave);
    const int n_tokens = sel.n_tokens;
    const size_t n_pair = sel.n_pair();
    const int n_plane = (int) dst->ne[2]; // one plane per level + the in-place plane
    int32_t * out         = (int32_t *) dst->data;
    int32_t * out_inplace = out + (size_t) (n_plane - 1) * n_pair;

    if (wave == 0 && il == plan.moe_layers.front() && !failed()) {
        const std::string changed = files.changed(); // once a ubatch: an fstat of each part
        if (!changed.empty()) {
            fail(changed);
        }
    }
    wave_assignment a(n_expert);
    if (!failed()) {
        if (wave == 0) {
            std::lock_guard<std::mutex> lock(mtx);
            if (recorder) {
                recorder->record(il, dst->src[0], dst->src[1], dst->src[2], dst->src[3]);
            }
        }
        // the score-history policy sees every token's scores of this layer, selected or not
        std::vector<std::vector<float>> token_scores;
        const ggml_tensor * probs = dst->src[2];
        if (cache->reads_scores() && wave == 0 && probs != nullptr && probs->type == GGML_TYPE_F32 &&
            probs->ne[1] == n_expert && probs->ne[2] == sel.n_tokens) {
            for (int t = 0; t < sel.n_tokens; ++t) {
                token_scores.push_back(router_scores(probs, t));
            }
        }
        std::vector<load_task> loads;
        a = cache->serve_wave(il, wave, level_of_wave, wave_of_level, sel, token_scores, loads);

        const ggml_tensor * x = dst->src[3]; // router input [n_embd, n_tokens]
        const bool x_rows = x->type == GGML_TYPE_F32 && x->ne[0] == levels.index.info.n_embd && x->ne[1] == n_tokens &&
                            x->nb[0] == sizeof(float);
        if (predictor && wave == 0 && n_tokens == 1 && x_rows) {
            prefetch_next_layers(il, (const float *) x->data, loads);
        }
        if (wave == 0 && is_prompt_ubatch(n_pair, n_expert)) {
            if (!a.any_inplace) {
                prefetch_next_layer_whole(il, x_rows ? x : nullptr, loads);
            } else {
                read_ahead_next_layer(il);
            }
        }
        submit(loads);
        const int64_t used = used_pool_bytes();
        {
            std::lock_guard<std::mutex> lock(mtx);
            stats_.peak_pool_bytes = std::max<int64_t>(stats_.peak_pool_bytes, used);
        }

        // block until every slot this layer uses holds its expert
        const int64_t waited = cache->wait_for_pins(il);
        std::lock_guard<std::mutex> lock(mtx);
        stats_.stall_us += waited;
        stats_.dispatch_us += runtime_clock_us() - t_enter - waited; // the id planes below are a copy: not counted
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
        for (int l = 0; l < levels.n_level; ++l) {
            out[(size_t) l*n_pair + i] = (valid && a.level_of[e] == l) ? a.slot_of[e] : -1;
        }
        out_inplace[i] = (valid && a.inplace[e]) ? e : -1;
    }
}

void hobbit_runtime::on_load_done(const load_task & task, const std::string & error, uint64_t n_bytes, int64_t us) {
    const bool rows = !task.ranges.empty(); // neuron rows into a slot that holds the expert
    if (!error.empty()) {
        fail(error); // before the cache wakes its waiters: they find the run failed
    }
    {
        std::lock_guard<std::mutex> lock(mtx);
        stats_.io_us += us;
        neurons.pending -= rows ? 1 : 0;
        if (error.empty()) {
            stats_.bytes_read += (int64_t) n_bytes;
            stats_.demand_bytes_read += task.prefetch ? 0 : (int64_t) n_bytes;
            stats_.background_bytes_read += task.prefetch ? (int64_t) n_bytes : 0;
            stats_.n_reads++;
        }
    }
    cache->load_done(task, error.empty(), n_bytes);
    neurons.done.notify_all();
}
