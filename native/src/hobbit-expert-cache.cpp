// hobbit-expert-cache.cpp - the expert cache's slots and decisions: a wave planned and applied,
// slots taken, settled or looked up, background loads (prefetch, upgrades, warm-up) and their pins.

#include "hobbit-expert-cache.h"

#include "hobbit-precision-scorer.h"

#include <algorithm>
#include <chrono>
#include "ggml.h"

#include <cassert>
#include <climits>
#include <cstdint>

expert_cache::expert_cache(const expert_cache_setup & setup, cache_env & env)
        : env(env), n_layer_(setup.n_layer), n_expert_(setup.n_expert), n_expert_used_(setup.n_expert_used), n_level_(setup.n_level),
          hit_policy(setup.hit_policy), skip_cached(setup.skip_cached), level_waves(setup.level_waves),
          policy_reads_scores(setup.policy == cache_policy_kind::score), inplace_ok(setup.inplace_ok),
          wave_limit(setup.wave_limit) {
    GGML_ASSERT(n_level_ >= 1 && n_level_ <= HOBBIT_MAX_LEVELS && !setup.moe_layers.empty());
    inplace_ok.resize(n_layer_, false);
    wave_limit.resize(n_layer_, INT_MAX);
    moe_rank.assign(n_layer_, -1);
    for (size_t i = 0; i < setup.moe_layers.size(); ++i) {
        moe_rank[setup.moe_layers[i]] = (int) i;
    }
    last_moe_layer = setup.moe_layers.back();
    n_moe_layer    = (int) setup.moe_layers.size();
    pool_of_.assign(n_level_, std::vector<int>(n_layer_, -1));
    for (const cache_pool_setup & ps : setup.pools) {
        pool_group pg;
        pg.slots        = slot_table(n_layer_, n_expert_, ps.n_slot);
        pg.policy       = setup.make_policy ? setup.make_policy(ps.n_slot)
                                            : cache_policy_make(setup.policy, ps.n_slot, n_layer_, n_expert_,
                                                                setup.policy_weights, setup.seed, setup.popularity,
                                                                HOBBIT_SCORE_HISTORY, setup.n_expert_used);
        pg.level        = ps.level;
        pg.type         = ps.type;
        pg.expert_bytes = ps.expert_bytes;
        pg.n_layer      = (int) ps.layers.size();
        for (int il : ps.layers) {
            pool_of_[ps.level][il] = (int) pools.size();
        }
        pools.push_back(std::move(pg));
    }
    inplace_min_pairs_.assign(n_layer_, INT32_MAX);
    for (int il : setup.moe_layers) {
        for (int l = 0; l < n_level_; ++l) {
            GGML_ASSERT(pool_of_[l][il] >= 0 && "every MoE layer has a pool at every level");
        }
        inplace_min_pairs_[il] = !inplace_ok[il] ? INT32_MAX : setup.inplace_any_width ? 0 : layer_capacity(il) + 1;
    }
}

// ---- the waves of a ubatch (from the setup: no lock) ----

int expert_cache::layer_capacity(int il) const {
    int n = 0;
    for (int l = 0; l < n_level_; ++l) {
        n += pools[pool_of_[l][il]].slots.size();
    }
    return std::min(n, wave_limit[il]);
}

bool expert_cache::waves_by_level(int n_tokens) const {
    return n_tokens > 1 && level_waves;
}

int expert_cache::n_waves(int il, int n_tokens) const {
    return (waves_by_level(n_tokens) ? n_level_ : 1) * waves_of_level(il, n_tokens);
}

int expert_cache::waves_of_level(int il, int n_tokens) const {
    // a layer whose experts may not run in place (a repacked pool, a high companion) serves a
    // wide ubatch in several waves
    const int capacity = layer_capacity(il);
    if (inplace_ok[il] || capacity >= n_expert_) {
        return 1;
    }
    const int64_t distinct = std::min<int64_t>((int64_t) n_tokens * n_expert_used_, n_expert_);
    const int64_t most = LLAMA_MOE_MAX_WAVES / (waves_by_level(n_tokens) ? n_level_ : 1);
    return (int) std::min<int64_t>(most, (distinct + capacity - 1) / capacity);
}

// ---- a wave ----

wave_assignment expert_cache::serve_wave(int il, int wave, int level_of_wave, int wave_of_level, const wave_selection & sel,
                                         const std::vector<std::vector<float>> & token_scores, std::vector<load_task> & loads) {
    std::unique_lock<std::mutex> lock(mtx);
    begin_wave_locked(il, wave, sel, token_scores);
    if (wave_of_level == 0 && level_of_wave > 0) {
        served.assign(n_expert_, false); // a level's waves serve their pairs of experts an earlier level served too
    }
    counts.skipped += wave_of_level == 0 ? sel.n_skipped_pairs : 0;
    sweep_rank = is_prompt_ubatch(sel.n_pair(), n_expert_) ? moe_rank[il] : -1; // a prompt sweeps every layer in order
    const wave_plan plan = plan_wave_locked(il, wave_of_level, sel);
    return apply_wave_locked(il, plan, sel, lock, loads);
}

void expert_cache::begin_wave(int il, int wave, const wave_selection & sel, const std::vector<std::vector<float>> & token_scores) {
    std::lock_guard<std::mutex> lock(mtx);
    begin_wave_locked(il, wave, sel, token_scores);
}

wave_plan expert_cache::plan_wave(int il, int wave, const wave_selection & sel) const {
    std::lock_guard<std::mutex> lock(mtx);
    return plan_wave_locked(il, wave, sel);
}

wave_assignment expert_cache::apply_wave(int il, const wave_plan & plan, const wave_selection & sel,
                                         std::vector<load_task> & loads) {
    std::unique_lock<std::mutex> lock(mtx);
    return apply_wave_locked(il, plan, sel, lock, loads);
}

void expert_cache::begin_wave_locked(int il, int wave, const wave_selection & sel,
                                     const std::vector<std::vector<float>> & token_scores) {
    if (wave == 0) {
        served.assign(n_expert_, false);
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
        for (const load_task & t : env.drop_queued([&](const load_task & t) {
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
    for (const std::vector<float> & scores : token_scores) {
        for (int l = 0; l < n_level_; ++l) {
            pools[pool_of_[l][il]].policy->on_scores(il, scores.data());
        }
    }
}

wave_plan expert_cache::plan_wave_locked(int il, int wave, const wave_selection & sel) const {
    wave_plan plan;
    plan.has_inplace = (int64_t) sel.n_pair() >= inplace_min_pairs_[il];
    const int waves  = waves_of_level(il, sel.n_tokens);
    plan.last        = wave == waves - 1;
    plan.must_fit    = plan.last && !plan.has_inplace;
    const int skip = n_level_;
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
    std::vector<int> room(n_level_, 0), after_wait(n_level_, 0);
    for (int l = 0; l < n_level_; ++l) {
        for (const slot_entry & s : pools[pool_of_[l][il]].slots) {
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
        return first_level(sel.want[e], n_level_, exact_for(sel, e), !plan.has_inplace && lower_allowed(),
                           [&](int l) { return room[l] > 0; });
    };

    // experts already in a pool first: they cost nothing this wave, and their slots are
    // pinned before any miss looks for a victim
    // --skip-cached: skipped before any lookup, resident or not
    const auto skipped_even_cached = [&](int e) { return sel.want[e] == skip && skip_cached; };
    std::vector<int> order = sel.order;
    const auto cached = std::stable_partition(order.begin(), order.end(), [&](int e) {
        int l;
        return !skipped_even_cached(e) && lookup(il, e, sel.want[e], exact_for(sel, e), l) >= 0;
    });
    // balanced: the misses that could run either way are split once for the wave (Algorithm 2)
    const std::vector<bool> balanced = plan.has_inplace && inplace_ok[il]
        ? env.balanced_in_place(il, sel, std::vector<int>(cached, order.end()), [&](int e) {
              return sel.want[e] != skip && !(sel.share_low[e] && room[n_level_ - 1] > 0) && in_place_serves(e);
          })
        : std::vector<bool>();
    // neuron reads: a wave holds no more experts than the row cache's pages hold whole (its
    // experts' kept rows are read at once); n_waves counted on as many
    const int64_t wave_room = wave_limit[il] < INT_MAX ? layer_capacity(il) : INT64_MAX;
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
            if (use_of(pools[pool_of_[c.level][il]].slots[c.slot]) != slot_use::busy) {
                room[c.level]--; // pinned from now on
            } else {
                after_wait[c.level]--; // loading this expert already
            }
            // only a token's first expert is worth an upgrade: it carries the largest gate
            // weight, so serving it low costs the most quality; and each upgrade is a read
            // and a copy competing with decode for the cores
            c.upgrade = c.level > sel.want[e] && sel.top1[e] && hit_policy == HOBBIT_HIT_UPGRADE;
        } else if (sel.want[e] == skip) {
            c.how = serve_as::skip;
        } else if (sel.share_low[e] && room[n_level_ - 1] > 0) {
            c.how = serve_as::load; // the low copy is the cheap read the share is for, cheaper than in place
            c.level = n_level_ - 1;
            room[c.level]--;
        } else if (in_place_serves(e) && (balanced.empty() ? env.runs_in_place(il, e, sel.n_pairs[e]) : (bool) balanced[e])) {
            c.how = serve_as::in_place; // cooperative: computed on the mapped model instead of loaded
        } else if ((c.level = level_with_room(e)) >= 0) {
            c.how = serve_as::load;
            room[c.level]--;
        } else if (!plan.has_inplace &&
                   (c.level = first_level(sel.want[e], n_level_, exact_for(sel, e), lower_allowed(),
                                          [&](int l) { return after_wait[l] > 0; })) >= 0) {
            c.how = serve_as::wait;
            after_wait[c.level]--;
        } else if (!plan.has_inplace && !plan.last && n_later >= later_room &&
                   (c.level = first_level(sel.want[e], n_level_, false, true, [&](int l) { return room[l] > 0; })) >= 0) {
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

wave_assignment expert_cache::apply_wave_locked(int il, const wave_plan & plan, const wave_selection & sel,
                                                std::unique_lock<std::mutex> & lock, std::vector<load_task> & loads) {
    wave_assignment a(n_expert_);
    std::vector<std::pair<int, int>> upgrade; // (expert, wanted level) hit at a lower precision
    bool plan_loads = false; // a miss of the plan's (not a dropped prefetch's read, which the disk's timing decides)
    const auto serve_in_place = [&](int e) {
        if (!env.prepare_in_place(il, e)) {
            return; // the run has failed: the abort callback stops the graph before it computes
        }
        a.any_inplace = true;
        a.inplace[e]  = true;
        served[e]     = true;
        counts.inplace++;
        counts.served[0] += sel.n_pairs[e];
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
            a.level_of[e] = n_level_;
            counts.skipped += sel.n_pairs[e];
            continue;
        }
        if (c.how == serve_as::in_place) {
            serve_in_place(e);
            continue;
        }
        if (c.how == serve_as::hit && pools[pool_of_[level][il]].slots[s].state == slot_state::unread) {
            // its dropped read, now needed: read on demand, counted as the miss it is for the disk
            pool_group & pg = pools[pool_of_[level][il]];
            counts.misses++;
            pg.misses++;
            pg.slots.read_again(s);
            pg.policy->on_access(s, counted_high(sel, e, level));
            loads.push_back(slot_load(pool_of_[level][il], s, il, e, /*prefetch*/ false));
            if (c.upgrade) {
                upgrade.emplace_back(e, sel.want[e]); // a hit for the plan, whichever way its read went
            }
        } else if (c.how == serve_as::hit) {
            pool_group & pg = pools[pool_of_[level][il]];
            counts.hits++;
            pg.hits++;
            if (pg.slots[s].prefetched) {
                counts.prefetch_used++;
                pg.slots.set_prefetched(s, false);
            }
            pg.policy->on_access(s, counted_high(sel, e, level));
            if (c.upgrade) {
                upgrade.emplace_back(e, sel.want[e]);
            }
        } else {
            // load or wait: the plan counted a free or evictable slot for each load, and only
            // waits (which drop prefetches and free slots) change the pools in between
            s = c.how == serve_as::load ? take_slot(pool_of_[level][il], &lock) : -1;
            if (s < 0 && (plan.must_fit || c.how == serve_as::wait)) {
                s = wait_for_slot(il, sel.want[e], exact_for(sel, e), sel, lock, level);
            }
            if (s < 0) {
                if (plan.has_inplace) {
                    serve_in_place(e);
                }
                continue; // in place, a later wave, or a failure
            }
            const int p = pool_of_[level][il];
            pool_group & pg = pools[p];
            counts.misses++;
            pg.misses++;
            pg.slots.assign(s, il, e);
            pg.policy->on_insert(s, il, e);
            pg.policy->on_access(s, counted_high(sel, e, level));
            loads.push_back(slot_load(p, s, il, e, /*prefetch*/ false));
            plan_loads = true;
        }
        const int p = pool_of_[level][il];
        pools[p].slots.pin(s);
        pinned.emplace_back(p, s);
        a.slot_of[e]  = s;
        a.level_of[e] = level;
        served[e]     = true;
        counts.served[level] += sel.n_pairs[e];
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
        if (pools[pool_of_[level][il]].slots.find(il, e) < 0 &&
            queue_background_load(pool_of_[level][il], il, e, /*prefetch*/ false, loads, &lock) >= 0) {
            counts.upgrades++;
            upgrades_this_graph++;
        }
    }
    return a;
}

int64_t expert_cache::wait_for_pins(int il) {
    std::unique_lock<std::mutex> lock(mtx);
    const auto t0 = std::chrono::steady_clock::now();
    n_waiting++;
    cv_loaded.wait(lock, [&] {
        return env.failed() || std::all_of(pinned.begin(), pinned.end(), [&](const std::pair<int, int> & ps) {
            return pools[ps.first].slots[ps.second].state == slot_state::ready;
        });
    });
    n_waiting--;
    last_dispatch_il = il;
    return std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now() - t0).count();
}

// ---- slots ----

slot_use expert_cache::use_of(const slot_entry & s) const {
    if (s.pins > 0 || s.background_graph == graph_seq) {
        return slot_use::busy;
    }
    return s.state == slot_state::empty ? slot_use::empty : slot_use::evictable;
}

void expert_cache::settle(int p, int s, std::unique_lock<std::mutex> * lock) {
    if (pools[p].slots[s].state != slot_state::loading) {
        return;
    }
    if (!env.drop_queued([&](const load_task & t) { return t.group == p && t.slot == s; }).empty()) {
        pools[p].slots.drop_read(s);
        return;
    }
    if (lock != nullptr) {
        cv_loaded.wait(*lock, [&] { return env.failed() || pools[p].slots[s].state != slot_state::loading; });
    }
}

int expert_cache::take_slot(int p, std::unique_lock<std::mutex> * lock) {
    const slot_table & slots = pools[p].slots;
    cache_policy_i & policy = *pools[p].policy;
    std::vector<int> candidates;
    const auto use = [&](int s) { return use_of(slots[s]); };
    const int n_moe = n_moe_layer;
    // a prompt's ubatch: what the sweep reaches last goes first (the layer just computed)
    const auto ahead = [&](int s) { return (moe_rank[slots[s].layer] - sweep_rank - 1 + n_moe) % n_moe; };
    const int s = sweep_rank < 0 ? cache_take_slot(slots.size(), use, policy, candidates) :
        cache_take_slot(slots.size(), use, [&](const std::vector<int> & c) { return sweep_victim(c, ahead, policy); },
                        candidates);
    if (s >= 0 && slots[s].prefetched) {
        counts.prefetch_wasted++; // evicted before any layer asked for it
    }
    if (s >= 0) {
        settle(p, s, lock);
    }
    return s;
}

int expert_cache::take_slot_near(int il, int want, bool exact, bool allow_lower, int & level,
                                 std::unique_lock<std::mutex> & lock) {
    int s = -1;
    level = first_level(want, n_level_, exact, allow_lower, [&](int l) { return (s = take_slot(pool_of_[l][il], &lock)) >= 0; });
    return level >= 0 ? s : -1;
}

int expert_cache::find_cached(int il, int e, int & level) const {
    for (int l = 0; l < n_level_; ++l) {
        const int s = pools[pool_of_[l][il]].slots.find(il, e);
        if (s >= 0) {
            level = l;
            return s;
        }
    }
    return -1;
}

bool expert_cache::counted_high(const wave_selection & sel, int e, int level) {
    return sel.counted_low.empty() ? level == 0 : !sel.counted_low[e];
}

bool expert_cache::lower_allowed() const {
    return hit_policy != HOBBIT_HIT_AT_LEAST;
}

bool expert_cache::exact_for(const wave_selection & sel, int e) const {
    return hit_policy == HOBBIT_HIT_EXACT && !sel.share_low[e];
}

int expert_cache::lookup(int il, int e, int want, bool exact, int & level) const {
    if (!exact) {
        const int s = find_cached(il, e, level);
        // hits "at-least": a copy below the wanted precision is no hit (want = n_level, skipped if missed: any copy is)
        return s >= 0 && !lower_allowed() && level > want ? -1 : s;
    }
    level = want;
    return want < n_level_ ? pools[pool_of_[want][il]].slots.find(il, e) : -1;
}

int expert_cache::wait_for_slot(int il, int want, bool exact, const wave_selection & sel, std::unique_lock<std::mutex> & lock,
                                int & level) {
    // what stands in the way besides this ubatch's own experts: the predictions (unpinned) and
    // the background loads of this graph into the layer's pools (made evictable: the policy
    // then chooses among them as among the rest)
    release_predicted([](int, int, int) { return true; });
    for (int l = 0; l < n_level_; ++l) {
        slot_table & slots = pools[pool_of_[l][il]].slots;
        for (int s = 0; s < slots.size(); ++s) {
            if (slots[s].pins == 0) {
                slots.set_background_graph(s, -1);
            }
        }
    }
    int s = env.failed() ? -1 : take_slot_near(il, want, exact, lower_allowed(), level, lock);
    if (s < 0 && (exact || !lower_allowed()) && !env.failed()) {
        // every slot of the wanted level is taken by this very ubatch: exactness as far
        // as the pools allow, another level rather than a failed run
        s = take_slot_near(il, want, false, true, level, lock);
    }
    if (s < 0 && !env.failed()) {
        // every slot is taken by this very ubatch: it is wider than the pools
        env.fail("layer " + std::to_string(il) + " selects " + std::to_string(sel.order.size()) +
                 " experts in one ubatch but its pools hold " + std::to_string(layer_capacity(il)) +
                 "; use a smaller n_ubatch or a larger expert cache");
    }
    return s;
}

load_task expert_cache::slot_load(int p, int s, int il, int e, bool prefetch) const {
    return { p, pools[p].level, s, il, e, prefetch, {}, {}, {} }; // the runtime gives it the slot's tensors
}

int expert_cache::queue_background_load(int p, int il, int e, bool prefetch, std::vector<load_task> & loads,
                                        std::unique_lock<std::mutex> * lock) {
    slot_table & slots = pools[p].slots;
    const int s = take_slot(p, lock);
    if (s < 0) {
        return -1;
    }
    slots.assign(s, il, e);
    slots.set_prefetched(s, prefetch);
    // busy until its layer's turn (a prefetch) or for the rest of this graph (an upgrade); the
    // warm-up's (no lock: before any graph) are the pools' first contents, taken like any other
    slots.set_background_graph(s, lock != nullptr ? graph_seq : -1);
    if (prefetch && lock != nullptr) {
        prefetched_this_graph.push_back({ p, s, il });
    }
    pools[p].policy->on_insert(s, il, e);
    loads.push_back(slot_load(p, s, il, e, /*prefetch*/ true));
    return s;
}

void expert_cache::pin_predicted(int p, int s, int il) {
    pools[p].slots.pin(s);
    predicted_pins.push_back({ p, s, il, graph_seq });
}

void expert_cache::release_predicted(const std::function<bool(int p, int s, int il)> & pred) {
    auto keep = predicted_pins.begin();
    for (const predicted_pin & pp : predicted_pins) {
        if (pred(pp.pool, pp.slot, pp.layer)) {
            pools[pp.pool].slots.unpin(pp.slot);
        } else {
            *keep++ = pp;
        }
    }
    predicted_pins.erase(keep, predicted_pins.end());
}

// ---- background loads ----

void expert_cache::prefetch_predicted(const std::vector<predicted_layer> & predictions, std::vector<load_task> & loads) {
    std::unique_lock<std::mutex> lock(mtx);
    for (const predicted_layer & lp : predictions) {
        bool all_cached = true;
        for (size_t i = 0; i < lp.experts.size(); ++i) {
            const int e = lp.experts[i];
            int level = -1;
            int s = find_cached(lp.il, e, level);
            if (s < 0 && env.runs_in_place(lp.il, e, 1)) {
                continue; // it would run in place on the page cache's copy: as good as cached
            }
            if (s < 0) {
                if (lp.levels[i] == PRECISION_SKIP) {
                    continue; // it would be skipped if missed: nothing worth fetching
                }
                all_cached = false;
                level = lp.levels[i];
                s = queue_background_load(pool_of_[level][lp.il], lp.il, e, /*prefetch*/ true, loads, &lock);
                if (s < 0) {
                    continue; // every slot of that pool is pinned
                }
                counts.prefetch_issued++;
            }
            pin_predicted(pool_of_[level][lp.il], s, lp.il);
        }
        // go one layer deeper only while everything predicted so far is already there
        if (!all_cached) {
            break;
        }
    }
}

void expert_cache::prefetch_layer_whole(int next, const std::vector<int> & order, const std::vector<bool> & low,
                                        std::vector<load_task> & loads) {
    std::unique_lock<std::mutex> lock(mtx);
    // no more than each pool holds beside what this layer pinned, or the loads would evict each other
    std::vector<int> room(n_level_, 0);
    for (int l = 0; l < n_level_; ++l) {
        for (const slot_entry & slot : pools[pool_of_[l][next]].slots) {
            room[l] += use_of(slot) != slot_use::busy;
        }
    }
    for (int e : order) {
        const int l = low[e] ? n_level_ - 1 : 0;
        int level = -1;
        if (room[l] <= 0 || find_cached(next, e, level) >= 0 || env.runs_in_place(next, e, 2)) {
            continue;
        }
        const int p = pool_of_[l][next];
        const int s = queue_background_load(p, next, e, /*prefetch*/ true, loads, &lock);
        if (s < 0) {
            room[l] = 0;
            continue;
        }
        counts.prefetch_issued++;
        pin_predicted(p, s, next);
        room[l]--;
    }
}

void expert_cache::warm(const std::vector<std::pair<int, int>> & order, const std::function<const int8_t *(int)> & placed,
                        int deepest, std::vector<load_task> & loads) {
    std::lock_guard<std::mutex> lock(mtx);
    for (int l = std::min(deepest, n_level_ - 1); l >= 0; --l) {
        for (const auto & [il, e] : order) {
            if (placed(il) && placed(il)[e] != l) {
                continue; // a static placement: each expert at its own level only
            }
            const int p = pool_of_[l][il];
            const slot_table & slots = pools[p].slots;
            if (slots.has_empty() && slots.find(il, e) < 0 &&
                queue_background_load(p, il, e, /*prefetch*/ false, loads, nullptr) >= 0) {
                counts.warm_loads++;
            }
        }
    }
}

void expert_cache::load_done(const load_task & task, bool ok, uint64_t n_bytes) {
    {
        std::lock_guard<std::mutex> lock(mtx);
        const bool rows = !task.ranges.empty(); // neuron rows into a slot that holds the expert: its state stays
        if (!ok) {
            if (!rows) {
                pools[task.group].slots.clear(task.slot);
            }
        } else {
            if (!rows) {
                pools[task.group].slots.loaded(task.slot);
            }
            pools[task.group].bytes_read += (int64_t) n_bytes;
            // nobody waits and the graph is between two MoE layers: this read ran under compute
            if (n_waiting == 0 && last_dispatch_il >= 0 && last_dispatch_il != last_moe_layer) {
                counts.loads_overlapped++;
            }
        }
    }
    cv_loaded.notify_all();
}

void expert_cache::waiting_elsewhere(int delta) {
    std::lock_guard<std::mutex> lock(mtx);
    n_waiting += delta;
}

// ---- what the cache holds and counted ----

std::vector<bool> expert_cache::cached_experts(int il) const {
    std::lock_guard<std::mutex> lock(mtx);
    std::vector<bool> cached(n_expert_, false);
    for (int e = 0; e < n_expert_; ++e) {
        int level = -1;
        cached[e] = find_cached(il, e, level) >= 0;
    }
    return cached;
}

std::pair<int, int> expert_cache::slot_owner(int p, int s) const {
    std::lock_guard<std::mutex> lock(mtx);
    return { pools[p].slots[s].layer, pools[p].slots[s].expert };
}

int64_t expert_cache::used_slot_bytes() const {
    std::lock_guard<std::mutex> lock(mtx);
    int64_t n = 0;
    for (const pool_group & pg : pools) {
        n += pg.slots.n_used() * pg.expert_bytes;
    }
    return n;
}

void cache_counters::write_to(hobbit_stats & s) const {
    s.expert_hits      = hits;
    s.expert_misses    = misses;
    s.expert_inplace   = inplace;
    s.prefetch_issued  = prefetch_issued;
    s.prefetch_used    = prefetch_used;
    s.prefetch_wasted  = prefetch_wasted;
    s.loads_overlapped = loads_overlapped;
    s.n_skipped        = skipped;
    s.upgrades         = upgrades;
    s.warm_loads       = warm_loads;
    for (int l = 0; l < HOBBIT_MAX_LEVELS; ++l) {
        s.served[l] = served[l];
    }
}

cache_counters expert_cache::counters() const {
    std::lock_guard<std::mutex> lock(mtx);
    return counts;
}

bool expert_cache::pool_counters(int p, cache_pool_counters & out) const {
    std::lock_guard<std::mutex> lock(mtx);
    if (p < 0 || p >= (int) pools.size()) {
        return false;
    }
    const pool_group & pg = pools[p];
    out = { pg.hits, pg.misses, pg.bytes_read, pg.expert_bytes, pg.slots.size(), pg.n_layer, pg.level, pg.type };
    return true;
}

void expert_cache::reset_counters() {
    std::lock_guard<std::mutex> lock(mtx);
    counts = {};
    for (pool_group & pg : pools) {
        pg.hits = pg.misses = pg.bytes_read = 0;
    }
}

void expert_cache::new_sequence() {
    std::lock_guard<std::mutex> lock(mtx);
    for (pool_group & pg : pools) {
        pg.policy->reset();
    }
}
