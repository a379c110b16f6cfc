// hobbit-runtime-loads.cpp - The runtime's slots and background loads: a slot taken, settled or looked up, and
// the prefetch of the next layers' predicted experts (HOBBIT's stacked gates, Fate's cross-layer prefetch) with
// their pins.

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

slot_use hobbit_runtime::use_of(const slot_entry & s) const {
    if (s.pins > 0 || s.background_graph == graph_seq) {
        return slot_use::busy;
    }
    return s.state == slot_state::empty ? slot_use::empty : slot_use::evictable;
}

void hobbit_runtime::settle(int p, int s, std::unique_lock<std::mutex> * lock) {
    if (pools[p].slots[s].state != slot_state::loading) {
        return;
    }
    if (!io->drop_prefetches([&](const load_task & t) { return t.group == p && t.slot == s; }).empty()) {
        pools[p].slots.drop_read(s);
        return;
    }
    if (lock != nullptr) {
        cv_loaded.wait(*lock, [&] { return failed() || pools[p].slots[s].state != slot_state::loading; });
    }
}

int hobbit_runtime::take_slot(int p, std::unique_lock<std::mutex> * lock) {
    const slot_table & slots = pools[p].slots;
    cache_policy_i & policy = *pools[p].policy;
    std::vector<int> candidates;
    const auto use = [&](int s) { return use_of(slots[s]); };
    const int n_moe = (int) moe_layers.size();
    // a prompt's ubatch: what the sweep reaches last goes first (the layer just computed)
    const auto ahead = [&](int s) { return (moe_rank[slots[s].layer] - sweep_rank - 1 + n_moe) % n_moe; };
    const int s = sweep_rank < 0 ? cache_take_slot(slots.size(), use, policy, candidates) :
        cache_take_slot(slots.size(), use, [&](const std::vector<int> & c) { return sweep_victim(c, ahead, policy); },
                        candidates);
    if (s >= 0 && slots[s].prefetched) {
        stats_.prefetch_wasted++; // evicted before any layer asked for it
    }
    if (s >= 0) {
        settle(p, s, lock);
    }
    return s;
}

int hobbit_runtime::take_slot_near(int il, int want, bool exact, bool allow_lower, int & level,
                                   std::unique_lock<std::mutex> & lock) {
    int s = -1;
    level = first_level(want, n_level, exact, allow_lower, [&](int l) { return (s = take_slot(pool_of[l][il], &lock)) >= 0; });
    return level >= 0 ? s : -1;
}

int hobbit_runtime::find_cached(int il, int e, int & level) const {
    for (int l = 0; l < n_level; ++l) {
        const int s = pools[pool_of[l][il]].slots.find(il, e);
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
        for (const slot_entry & slot : pools[pool_of[l][next]].slots) {
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

void hobbit_runtime::pin_predicted(int p, int s, int il) {
    pools[p].slots.pin(s);
    predicted_pins.push_back({ p, s, il, graph_seq });
}

void hobbit_runtime::release_predicted(const std::function<bool(int p, int s, int il)> & pred) {
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

bool hobbit_runtime::lower_allowed() const {
    return params.hit_policy != HOBBIT_HIT_AT_LEAST;
}

bool hobbit_runtime::exact_for(const wave_selection & sel, int e) const {
    return params.hit_policy == HOBBIT_HIT_EXACT && !sel.share_low[e];
}

int hobbit_runtime::lookup(int il, int e, int want, bool exact, int & level) const {
    if (!exact) {
        const int s = find_cached(il, e, level);
        // hits "at-least": a copy below the wanted precision is no hit (want = n_level, skipped if missed: any copy is)
        return s >= 0 && !lower_allowed() && level > want ? -1 : s;
    }
    level = want;
    return want < n_level ? pools[pool_of[want][il]].slots.find(il, e) : -1;
}

int hobbit_runtime::wait_for_slot(int il, int want, bool exact, const wave_selection & sel, std::unique_lock<std::mutex> & lock,
                                  int & level) {
    // what stands in the way besides this ubatch's own experts: the predictions (unpinned) and
    // the background loads of this graph into the layer's pools (made evictable: the policy
    // then chooses among them as among the rest)
    release_predicted([](int, int, int) { return true; });
    for (int l = 0; l < n_level; ++l) {
        slot_table & slots = pools[pool_of[l][il]].slots;
        for (int s = 0; s < slots.size(); ++s) {
            if (slots[s].pins == 0) {
                slots.set_background_graph(s, -1);
            }
        }
    }
    int s = failed() ? -1 : take_slot_near(il, want, exact, lower_allowed(), level, lock);
    if (s < 0 && (exact || !lower_allowed()) && !failed()) {
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

int64_t hobbit_runtime::used_pool_bytes() const {
    int64_t n = 0;
    for (const auto & pg : pools) {
        n += pg.slots.n_used() * pg.expert_bytes;
        if (pg.rows) {
            n += (pg.rows->n_page() - pg.rows->n_free()) * (int64_t) pg.rows->page_bytes();
        }
    }
    return n;
}
