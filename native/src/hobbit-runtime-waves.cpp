// hobbit-runtime-waves.cpp - The runtime's dispatch: a ubatch's selections served wave by wave (begin_wave, the
// plan of plan_wave applied by apply_wave), where a missed expert runs (in place or loaded), substitution of
// low-score misses, and completed loads.

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

bool hobbit_runtime::waves_by_level(int n_tokens) const {
    return n_tokens > 1 && n_level > 1 && params.hit_policy == HOBBIT_HIT_EXACT && placement.empty() &&
           thresholds.prefill_low_share == 0.0f && !neuron_reads;
}

int hobbit_runtime::n_waves(int il, int n_tokens) const {
    return (waves_by_level(n_tokens) ? n_level : 1) * waves_of_level(il, n_tokens);
}

int hobbit_runtime::waves_of_level(int il, int n_tokens) const {
    // a layer whose experts may not run in place (a repacked pool, a high companion) serves a
    // wide ubatch in several waves
    const int n_expert = index.info.n_expert;
    const int capacity = layer_capacity(il);
    if (inplace_ok[il] || capacity >= n_expert) {
        return 1;
    }
    const int64_t distinct = std::min<int64_t>((int64_t) n_tokens * index.info.n_expert_used, n_expert);
    const int64_t most = LLAMA_MOE_MAX_WAVES / (waves_by_level(n_tokens) ? n_level : 1);
    return (int) std::min<int64_t>(most, (distinct + capacity - 1) / capacity);
}

void hobbit_runtime::begin_wave(int il, int wave, const wave_selection & sel, const ggml_tensor * dst) {
    if (wave == 0) {
        served.assign(index.info.n_expert, false);
    }
    // the previous wave's or layer's matmuls are done: their slots may go
    for (const auto & [p, s] : pinned) {
        pools[p].slots.unpin(s);
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
        pools[pp.pool].slots.unpin(pp.slot);
        return true;
    }), predicted_pins.end());
    // a prefetch for this layer whose expert was not selected was a wrong guess: its read is
    // dropped if still queued (the slot keeps the expert, unread, as if the read had run: what
    // the cache holds is the same whatever the disk's timing). The warm-up's and upgrades'
    // reads are not guesses: they stay
    if (wave == 0) {
        for (const load_task & t : io->drop_prefetches([&](const load_task & t) {
                 return t.layer == il && pools[t.group].slots[t.slot].prefetched && sel.n_pairs[t.expert] == 0; })) {
            pools[t.group].slots.drop_read(t.slot);
        }
        // this layer's prefetches have had their turn: from here they are cached like any other
        prefetched_this_graph.erase(std::remove_if(prefetched_this_graph.begin(), prefetched_this_graph.end(),
            [&](const std::array<int, 3> & ps) {
                if (ps[2] != il) {
                    return false;
                }
                slot_table & slots = pools[ps[0]].slots;
                if (slots[ps[1]].layer == il && slots[ps[1]].background_graph == graph_seq) {
                    slots.set_background_graph(ps[1], -1);
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
    const int waves  = waves_of_level(il, sel.n_tokens);
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
        for (const slot_entry & s : pools[pool_of[l][il]].slots) {
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
        return first_level(sel.want[e], n_level, exact_for(sel, e), !plan.has_inplace && lower_allowed(),
                           [&](int l) { return room[l] > 0; });
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
            if (use_of(pools[pool_of[c.level][il]].slots[c.slot]) != slot_use::busy) {
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
                   (c.level = first_level(sel.want[e], n_level, exact_for(sel, e), lower_allowed(),
                                          [&](int l) { return after_wait[l] > 0; })) >= 0) {
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
        if (c.how == serve_as::hit && pools[pool_of[level][il]].slots[s].state == slot_state::unread) {
            // its dropped read, now needed: read on demand, counted as the miss it is for the disk
            pool_group & pg = pools[pool_of[level][il]];
            stats_.expert_misses++;
            pg.misses++;
            pg.slots.read_again(s);
            pg.policy->on_access(s, /*high*/ level == 0);
            loads.push_back(slot_load(pool_of[level][il], s, il, e, /*prefetch*/ false));
            if (c.upgrade) {
                upgrade.emplace_back(e, sel.want[e]); // a hit for the plan, whichever way its read went
            }
        } else if (c.how == serve_as::hit) {
            pool_group & pg = pools[pool_of[level][il]];
            stats_.expert_hits++;
            pg.hits++;
            if (pg.slots[s].prefetched) {
                stats_.prefetch_used++;
                pg.slots.set_prefetched(s, false);
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
            pg.slots.assign(s, il, e);
            pg.policy->on_insert(s, il, e);
            pg.policy->on_access(s, /*high*/ level == 0);
            loads.push_back(slot_load(p, s, il, e, /*prefetch*/ false));
            plan_loads = true;
        }
        const int p = pool_of[level][il];
        pools[p].slots.pin(s);
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
        if (pools[pool_of[level][il]].slots.find(il, e) < 0 &&
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
    const int64_t t_enter = runtime_clock_us();
    const int n_expert = index.info.n_expert;
    // decode's ubatches (one token, or a batch of beams or sequences), never a prompt's wide one
    // (a prompt of a few tokens is served as decoding would serve them one by one)
    if (params.substitute_alpha > 0.0f && wave == 0 &&
        !is_prompt_ubatch((size_t) dst->src[0]->ne[0] * dst->src[0]->ne[1], n_expert)) {
        substitute_low_scores(il, dst);
    }
    // hits "exact" level by level: the waves of each level in turn, wave = level * per_level + wave of the level
    const int n_ubatch_tokens = (int) dst->src[0]->ne[1];
    const int per_level = waves_of_level(il, n_ubatch_tokens);
    const int level_of_wave = waves_by_level(n_ubatch_tokens) ? wave / per_level : -1;
    const int wave_of_level = wave % per_level;
    const wave_selection sel = read_selection(dst->src[0], dst->src[1], n_expert, thresholds, placed(il), level_of_wave);
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
        if (wave_of_level == 0 && level_of_wave > 0) {
            served.assign(n_expert, false); // a level's waves serve their pairs of experts an earlier level served too
        }
        stats_.n_skipped += wave_of_level == 0 ? sel.n_skipped_pairs : 0;
        const bool prompt = is_prompt_ubatch(n_pair, n_expert);
        sweep_rank = prompt ? moe_rank[il] : -1; // a prompt sweeps every layer in order (take_slot)
        const wave_plan plan = plan_wave(il, wave_of_level, sel);
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
        const int64_t t0 = runtime_clock_us();
        n_waiting++;
        cv_loaded.wait(lock, [&] {
            return failed() || std::all_of(pinned.begin(), pinned.end(), [&](const std::pair<int, int> & ps) {
                return pools[ps.first].slots[ps.second].state == slot_state::ready;
            });
        });
        n_waiting--;
        const int64_t waited = runtime_clock_us() - t0;
        stats_.stall_us += waited;
        last_dispatch_il = il;
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
                pools[task.group].slots.clear(task.slot);
            }
            fail(error);
        } else {
            if (!rows) { // (rows are read into a slot that holds its expert, ready)
                pools[task.group].slots.loaded(task.slot);
            }
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
