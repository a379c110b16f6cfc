// hobbit-cache-policy.h - which cached expert to evict when a slot is needed.
//
// One interface; the policies are the corners and mixes of HOBBIT's eq. 3 (§3.4):
//     priority = w_lru * R/T + w_lfu * F/T + w_lhu * H/T + w_fld * p_fld
// R = clock of the expert's last use, F = its uses, H = its high-precision uses (all
// counted since the sequence began), T = the clock now, p_fld = how soon its layer comes
// again. The lowest priority is evicted; ties go to the least recently used. LRU, LFU,
// LHU and FLD are weights (1,0,0,0) ... (0,0,0,1); random ignores everything. ARC (Fate
// §4.4) adapts between recency and frequency by itself. Popularity (Fiddler §3) ranks by a
// profile made before the run: the least often selected on calibration text goes first.
// Score (importance-driven scheduling §5.3) ranks by the router's scores of the last tokens,
// those of unselected experts included: a high score, even unselected, predicts reuse.
// Frequency ranks by the run's own selections, aged, a profile counting as a few tokens' worth
// before them: LFU that starts from Fiddler's placement.
//
// The pool decides which slots may be evicted (not pinned, not loading); the policy only
// ranks them. The runtime and the offline simulator (hobbit-cache-sim) drive the same
// objects and take slots by the same rule (cache_take_slot), so a simulated policy is the
// deployed one. Belady's offline optimum is one more policy, made from the trace it replays.
#pragma once

#include "hobbit.h"

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

struct cache_policy_i {
    virtual ~cache_policy_i() = default;

    // slot now holds (layer, expert); counts as recent, not as a use (a prefetch
    // inserts without a use)
    virtual void on_insert(int slot, int layer, int expert) = 0;
    // the expert in slot was selected by the router; high: served at high precision
    virtual void on_access(int slot, bool high) = 0;
    // the layer about to run (FLD ranks experts by how soon their layer comes again)
    virtual void on_layer(int layer) = 0;
    // one token's router scores (probabilities) of every expert of layer, selected or not
    // (the score-history policy averages them; the others ignore them)
    virtual void on_scores(int layer, const float * scores) { (void) layer; (void) scores; }
    // the victim among candidates (never empty)
    virtual int choose_victim(const std::vector<int> & candidates) = 0;
    // a new sequence starts: sequence-level records are cleared
    virtual void reset() = 0;
};

struct cache_policy_weights {
    float lru = 1.0f, lfu = 0.0f, lhu = 0.0f, fld = 0.0f;
};

enum class cache_policy_kind { lru, lfu, lhu, fld, random, weighted, arc, popularity, score, frequency };

// "lru" | "lfu" | "lhu" | "fld" | "random" | "weighted" | "arc" | "popularity" | "score" | "frequency"; false for an
// unknown name
bool cache_policy_parse(const std::string & name, cache_policy_kind & kind);
const char * cache_policy_name(cache_policy_kind kind);
// the kind hobbit.h's enum hobbit_policy names (the same order); false for a value outside it
bool cache_policy_of(int policy, cache_policy_kind & kind);

// weights are used by kind == weighted only; seed by random only; popularity ([n_layer][n_expert],
// copied) by kind == popularity, which returns nullptr without it, and by frequency as its prior
// (optional; n_expert_used scales it); score averages the last score_history tokens' scores (of a layer)
std::unique_ptr<cache_policy_i> cache_policy_make(cache_policy_kind kind, int n_slot, int n_layer, int n_expert,
                                                  const cache_policy_weights & weights = {}, uint64_t seed = 0,
                                                  const float * popularity = nullptr,
                                                  int score_history = HOBBIT_SCORE_HISTORY, int n_expert_used = 1);

// Belady (1966): evicts the expert whose next use lies farthest ahead, the fewest misses
// possible. It knows the future from the trace, experts[step][n_expert_used] (-1 = none),
// step = token * n_layer + layer, and its clock is on_layer: each call is the next step.
std::unique_ptr<cache_policy_i> cache_policy_make_belady(const int32_t * experts, int64_t n_step, int n_layer,
                                                         int n_expert, int n_expert_used, int n_slot);

// how a slot may be used by a new expert
enum class slot_use { empty, evictable, busy };

// the slot a new expert takes among n_slot: the first empty one, else the victim choose()
// picks among the evictable ones (default: the policy's); -1 if every slot is busy (pinned
// or loading). use(s) says which; candidates is scratch space.
template <typename SlotUse, typename Choose>
int cache_take_slot(int n_slot, SlotUse use, Choose choose, std::vector<int> & candidates) {
    candidates.clear();
    for (int s = 0; s < n_slot; ++s) {
        const slot_use u = use(s);
        if (u == slot_use::empty) {
            return s;
        }
        if (u == slot_use::evictable) {
            candidates.push_back(s);
        }
    }
    return candidates.empty() ? -1 : choose(candidates);
}

template <typename SlotUse>
int cache_take_slot(int n_slot, SlotUse use, cache_policy_i & policy, std::vector<int> & candidates) {
    return cache_take_slot(n_slot, use, [&](const std::vector<int> & c) { return policy.choose_victim(c); }, candidates);
}

// A prompt's ubatch sweeps every MoE layer in order and the next ubatch sweeps them again: a
// cyclic scan, which a recency rule serves with no hit at all once the pool is smaller than
// a sweep (it evicts exactly what the sweep reaches next). Belady's answer for a scan is to
// evict what it reaches last. The victim among candidates: one of those whose layer the
// sweep reaches last, ahead(slot) = how many MoE layers the sweep passes before that slot's
// layer comes again; the policy chooses among them (its records stay as they were).
int sweep_victim(const std::vector<int> & candidates, const std::function<int(int)> & ahead, cache_policy_i & policy);
