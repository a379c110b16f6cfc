#include "hobbit-cache-policy.h"

#include <algorithm>
#include <climits>
#include <list>
#include <random>

namespace {

// the candidate slot whose expert has the lowest rank(expert id), ties to the least recently used
template <typename Rank>
int lowest_rank_victim(const std::vector<int> & candidates, const std::vector<int> & owner,
                       const std::vector<uint64_t> & last_use, Rank rank) {
    int best = candidates.front();
    auto best_rank = rank(owner[best]);
    for (int slot : candidates) {
        const int id = owner[slot];
        const auto r = rank(id);
        if (r < best_rank || (r == best_rank && last_use[id] < last_use[owner[best]])) {
            best = slot;
            best_rank = r;
        }
    }
    return best;
}

// eq. 3 of HOBBIT; records are kept per (layer, expert), not per slot, so an expert
// evicted and loaded again keeps its history within the sequence
class weighted_policy : public cache_policy_i {
public:
    weighted_policy(int n_slot, int n_layer, int n_expert, const cache_policy_weights & w)
            : w(w), n_layer(n_layer), n_expert(n_expert), owner(n_slot, -1),
              last_use((size_t) n_layer * n_expert, 0), uses(last_use.size(), 0), high_uses(last_use.size(), 0) {}

    void on_insert(int slot, int layer, int expert) override {
        owner[slot] = layer * n_expert + expert;
        last_use[owner[slot]] = ++clock;
    }

    void on_access(int slot, bool high) override {
        const int id = owner[slot];
        last_use[id] = ++clock;
        uses[id]++;
        high_uses[id] += high ? 1 : 0;
    }

    void on_layer(int layer) override { current_layer = layer; }

    int choose_victim(const std::vector<int> & candidates) override {
        return lowest_rank_victim(candidates, owner, last_use, [&](int id) { return priority(id); });
    }

    void reset() override {
        // recency survives (it orders the cache content); frequencies are per sequence
        std::fill(uses.begin(), uses.end(), 0);
        std::fill(high_uses.begin(), high_uses.end(), 0);
    }

private:
    double priority(int id) const {
        const double T = (double) clock + 1.0;
        // FLD: the paper prints (l_t - l_i + l_n) % l_n, which would rank the next layer's
        // experts lowest; we use the forward distance (l_i - l_t), so the layer just
        // computed (needed again only at the next token) ranks lowest, as its text says
        const int layer = id / n_expert;
        const int dist  = ((layer - current_layer) % n_layer + n_layer) % n_layer;
        const double p_fld = 1.0 - (double) dist / n_layer;
        return w.lru * (double) last_use[id] / T + w.lfu * (double) uses[id] / T +
               w.lhu * (double) high_uses[id] / T + w.fld * p_fld;
    }

    cache_policy_weights w;
    int n_layer, n_expert;
    int current_layer = 0;
    uint64_t clock = 0;
    std::vector<int> owner;           // slot -> layer * n_expert + expert
    std::vector<uint64_t> last_use;   // per expert: clock of the last insert or use
    std::vector<uint64_t> uses;       // per expert: uses this sequence
    std::vector<uint64_t> high_uses;  // per expert: high-precision uses this sequence
};

// ARC (Megiddo & Modha, FAST 2003), the replacement Fate runs per layer (§4.4). T1 holds the
// experts referenced once since they came in, T2 those referenced again; B1 and B2 remember
// (without slots) what was evicted from each. A reference to a B1 ghost says T1 was too small
// and moves the target p for |T1| up, one to a B2 ghost moves it down; the victim is T1's
// least recent while |T1| exceeds p, else T2's. The pool offers only its evictable slots, so
// the victim is the least recent candidate of the preferred list (of the other when it has
// none). A loaded expert's first use is the reference that brought it in (a prefetch brings
// it in unreferenced): only a later use promotes it to T2. Records span sequences, like
// recency: ARC has no sequence-level state.
class arc_policy : public cache_policy_i {
public:
    arc_policy(int n_slot, int n_layer, int n_expert)
            : n_expert(n_expert), capacity(n_slot), owner(n_slot, -1), where((size_t) n_layer * n_expert, list::none),
              slot_of(where.size(), -1), last_use(where.size(), 0), fresh(where.size(), false), ghost_at(where.size()) {}

    void on_insert(int slot, int layer, int expert) override {
        const int id = layer * n_expert + expert;
        // the slot's last occupant is evicted only if it still lives there: a pool clears a
        // slot whose load was dropped without telling the policy, and that expert may have
        // come back in another slot (or this one)
        const int old = owner[slot];
        if (old >= 0 && old != id && slot_of[old] == slot) {
            evict(old);
        }
        owner[slot] = id;
        slot_of[id] = slot;
        if (where[id] == list::b1) {  // evicted from T1 too early: T1 deserves more room
            p = std::min((double) capacity, p + std::max(1.0, (double) b2.size() / (double) b1.size()));
            forget(id);
            enter(id, list::t2);
        } else if (where[id] == list::b2) {  // evicted from T2 too early: T2 deserves more room
            p = std::max(0.0, p - std::max(1.0, (double) b1.size() / (double) b2.size()));
            forget(id);
            enter(id, list::t2);
        } else if (where[id] == list::none) {
            enter(id, list::t1);
        }
        fresh[id] = true;
        // directory bounds: |T1| + |B1| <= c, everything <= 2c
        while (n_t1 + (int) b1.size() > capacity && !b1.empty()) {
            forget(b1.front());
        }
        while (n_t1 + n_t2 + (int) (b1.size() + b2.size()) > 2 * capacity && !b2.empty()) {
            forget(b2.front());
        }
    }

    void on_access(int slot, bool) override {
        const int id = owner[slot];
        if (fresh[id]) {
            fresh[id] = false;  // the reference that loaded it
        } else if (where[id] == list::t1) {
            n_t1--;
            where[id] = list::t2;
            n_t2++;
        }
        last_use[id] = ++clock;
    }

    void on_layer(int) override {}

    int choose_victim(const std::vector<int> & candidates) override {
        const list preferred = n_t1 > 0 && (double) n_t1 > p ? list::t1 : list::t2;
        int best = -1, fallback = -1;
        for (int slot : candidates) {
            int & pick = where[owner[slot]] == preferred ? best : fallback;
            if (pick < 0 || last_use[owner[slot]] < last_use[owner[pick]]) {
                pick = slot;
            }
        }
        return best >= 0 ? best : fallback;
    }

    void reset() override {}

private:
    enum class list : uint8_t { none, t1, t2, b1, b2 };

    void enter(int id, list l) {
        where[id] = l;
        (l == list::t1 ? n_t1 : n_t2)++;
        last_use[id] = ++clock;
    }

    void evict(int id) {
        slot_of[id] = -1;
        const bool from_t1 = where[id] == list::t1;
        (from_t1 ? n_t1 : n_t2)--;
        std::list<int> & ghosts = from_t1 ? b1 : b2;
        where[id] = from_t1 ? list::b1 : list::b2;
        ghost_at[id] = ghosts.insert(ghosts.end(), id);
    }

    void forget(int id) {
        (where[id] == list::b1 ? b1 : b2).erase(ghost_at[id]);
        where[id] = list::none;
    }

    int n_expert;
    int capacity;                                  // c: the pool's slots
    double p = 0.0;                                // target size of T1
    int n_t1 = 0, n_t2 = 0;
    uint64_t clock = 0;
    std::vector<int> owner;                        // slot -> layer * n_expert + expert
    std::vector<list> where;                       // per expert
    std::vector<int> slot_of;                      // per expert: its slot while in T1 / T2, else -1
    std::vector<uint64_t> last_use;                // per expert: recency within T1 / T2
    std::vector<bool> fresh;                       // per expert: loaded, its loading reference not yet seen
    std::list<int> b1, b2;                         // ghosts, least recently evicted first
    std::vector<std::list<int>::iterator> ghost_at;
};

// Fiddler's placement (§3) as a replacement rule: a profile of calibration text says how often
// each expert is selected, and the least popular cached expert is evicted (ties: the least
// recently used). Warmed most popular first, the pools keep the popular experts for the whole
// session; the unpopular ones share what is left. Static: nothing the run sees changes the ranks.
class popularity_policy : public cache_policy_i {
public:
    popularity_policy(int n_slot, int n_layer, int n_expert, const float * popularity)
            : n_expert(n_expert), owner(n_slot, -1), popularity(popularity, popularity + (size_t) n_layer * n_expert),
              last_use((size_t) n_layer * n_expert, 0) {}

    void on_insert(int slot, int layer, int expert) override {
        owner[slot] = layer * n_expert + expert;
        last_use[owner[slot]] = ++clock;
    }
    void on_access(int slot, bool) override { last_use[owner[slot]] = ++clock; }
    void on_layer(int) override {}
    int choose_victim(const std::vector<int> & candidates) override {
        return lowest_rank_victim(candidates, owner, last_use, [&](int id) { return popularity[id]; });
    }
    void reset() override {}

private:
    int n_expert;
    uint64_t clock = 0;
    std::vector<int> owner;          // slot -> layer * n_expert + expert
    std::vector<float> popularity;   // per expert, from the profile
    std::vector<uint64_t> last_use;  // per expert: clock of the last insert or use
};

// LFU with a prior and aging: an expert ranks by how often this run selected it, plus a prior from a
// profile of calibration text (each layer's row scaled to FREQUENCY_PRIOR_TOKENS tokens' selections),
// the counts halved whenever they have grown by FREQUENCY_AGING uses per expert. On a model whose
// routers favour some experts, the favourites stay (Fiddler's placement) and the run's own text
// takes over as it goes (LFU): on the hardened Mixtral-depth model's held-out text the hit ratio
// of 120 slots for 256 experts went from LRU's 0.50 to 0.60 (docs/BENCHMARKS.md). The prior orders
// the first evictions and the warm-up; ties (and no profile, no uses): the least recently used.
// Records span sequences: the aging forgets.
class frequency_policy : public cache_policy_i {
public:
    frequency_policy(int n_slot, int n_layer, int n_expert, int n_expert_used, const float * profile)
            : owner(n_slot, -1), n_expert(n_expert), uses((size_t) n_layer * n_expert, 0.0),
              prior(uses.size(), 0.0), last_use(uses.size(), 0),
              aging_uses((uint64_t) FREQUENCY_AGING * uses.size()) {
        if (profile == nullptr) {
            return;
        }
        for (int il = 0; il < n_layer; ++il) {
            const float * row = profile + (size_t) il * n_expert;
            double sum = 0.0;
            for (int e = 0; e < n_expert; ++e) {
                sum += row[e];
            }
            for (int e = 0; sum > 0.0 && e < n_expert; ++e) {
                prior[(size_t) il * n_expert + e] = FREQUENCY_PRIOR_TOKENS * n_expert_used * row[e] / sum;
            }
        }
    }

    void on_insert(int slot, int layer, int expert) override {
        owner[slot] = layer * n_expert + expert;
        last_use[owner[slot]] = ++clock;
    }

    void on_access(int slot, bool) override {
        const int id = owner[slot];
        last_use[id] = ++clock;
        uses[id] += 1.0;
        if (++since_aging >= aging_uses) {
            for (double & u : uses) {
                u *= 0.5;
            }
            since_aging = 0;
        }
    }

    void on_layer(int) override {}

    int choose_victim(const std::vector<int> & candidates) override {
        return lowest_rank_victim(candidates, owner, last_use, [&](int id) { return uses[id] + prior[id]; });
    }

    void reset() override {}

private:
    // the profile counts as this many tokens' selections (enough to order a cold cache; a few
    // hundred tokens of the run outweigh it)
    static constexpr double FREQUENCY_PRIOR_TOKENS = 8.0;
    // the counts are halved after this many uses per expert of the table
    static constexpr uint64_t FREQUENCY_AGING = 32;

    std::vector<int> owner;          // slot -> layer * n_expert + expert
    int n_expert;
    std::vector<double> uses;        // per expert: selections served from this pool, aged
    std::vector<double> prior;       // per expert: the profile's share of FREQUENCY_PRIOR_TOKENS tokens' selections
    std::vector<uint64_t> last_use;  // per expert: clock of the last insert or use
    uint64_t aging_uses;
    uint64_t since_aging = 0;
    uint64_t clock = 0;
};

// importance-driven scheduling's eviction (§5.3): the expert whose router score, averaged over
// the last `history` tokens that ran its layer, is lowest goes first. Every expert's score
// counts, selected or not (its Figure 11: a high-scoring expert is likely reused, as a top-k
// or as a substitute). The paper's shield, no eviction of what the current layer selected,
// is the pool's pinning of the layer being computed. Ties (and experts not yet scored): the
// least recently used first.
class score_policy : public cache_policy_i {
public:
    score_policy(int n_slot, int n_layer, int n_expert, int history)
            : n_expert(n_expert), history(std::max(1, history)), owner(n_slot, -1),
              ring((size_t) n_layer * n_expert * this->history, 0.0f), sum((size_t) n_layer * n_expert, 0.0),
              seen(n_layer, 0), last_use(sum.size(), 0) {}

    void on_insert(int slot, int layer, int expert) override {
        owner[slot] = layer * n_expert + expert;
        last_use[owner[slot]] = ++clock;
    }
    void on_access(int slot, bool) override { last_use[owner[slot]] = ++clock; }
    void on_layer(int) override {}
    void on_scores(int layer, const float * scores) override {
        // a ring of the last `history` scores per expert; the sum is kept alongside
        const int at = (int) (seen[layer]++ % history);
        for (int e = 0; e < n_expert; ++e) {
            const size_t id = (size_t) layer * n_expert + e;
            float & old = ring[id * history + at];
            sum[id] += (double) scores[e] - old;
            old = scores[e];
        }
    }
    int choose_victim(const std::vector<int> & candidates) override {
        return lowest_rank_victim(candidates, owner, last_use, [&](int id) { return sum[id]; });
    }
    void reset() override {} // the history spans sequences: it is the recent tokens'

private:
    int n_expert;
    int history;
    uint64_t clock = 0;
    std::vector<int> owner;           // slot -> layer * n_expert + expert
    std::vector<float> ring;          // [layer * n_expert + expert][history]: the last scores
    std::vector<double> sum;          // per expert: the sum of its ring (the average times history)
    std::vector<uint64_t> seen;       // per layer: tokens scored
    std::vector<uint64_t> last_use;   // per expert: clock of the last insert or use
};

class random_policy : public cache_policy_i {
public:
    explicit random_policy(uint64_t seed) : rng(seed) {}
    void on_insert(int, int, int) override {}
    void on_access(int, bool) override {}
    void on_layer(int) override {}
    int choose_victim(const std::vector<int> & candidates) override {
        return candidates[std::uniform_int_distribution<size_t>(0, candidates.size() - 1)(rng)];
    }
    void reset() override {}

private:
    std::mt19937_64 rng;
};

class belady_policy : public cache_policy_i {
public:
    belady_policy(const int32_t * experts, int64_t n_step, int n_layer, int n_expert, int n_expert_used, int n_slot)
            : n_expert(n_expert), owner(n_slot, -1), uses((size_t) n_layer * n_expert) {
        for (int64_t step = 0; step < n_step; ++step) {
            const int layer = (int) (step % n_layer);
            for (int k = 0; k < n_expert_used; ++k) {
                const int32_t e = experts[step * n_expert_used + k];
                if (e >= 0 && e < n_expert && (uses[layer * n_expert + e].empty() || uses[layer * n_expert + e].back() != step)) {
                    uses[layer * n_expert + e].push_back(step);
                }
            }
        }
    }
    void on_insert(int slot, int layer, int expert) override { owner[slot] = layer * n_expert + expert; }
    void on_access(int, bool) override {}
    void on_layer(int) override { step++; }
    int choose_victim(const std::vector<int> & candidates) override {
        // the first of the candidates whose next use is the latest (or never)
        int best = candidates.front();
        int64_t best_next = -1;
        for (int slot : candidates) {
            const std::vector<int64_t> & u = uses[owner[slot]];
            const auto it = std::lower_bound(u.begin(), u.end(), step + 1);
            const int64_t next = it == u.end() ? INT64_MAX : *it;
            if (next > best_next) {
                best = slot;
                best_next = next;
            }
        }
        return best;
    }
    void reset() override {} // the optimum looks across sequences too

private:
    int n_expert;
    int64_t step = -1;
    std::vector<int> owner;                  // slot -> layer * n_expert + expert
    std::vector<std::vector<int64_t>> uses;  // per expert: the steps that select it, ascending
};

} // namespace

std::unique_ptr<cache_policy_i> cache_policy_make_belady(const int32_t * experts, int64_t n_step, int n_layer,
                                                         int n_expert, int n_expert_used, int n_slot) {
    return std::make_unique<belady_policy>(experts, n_step, n_layer, n_expert, n_expert_used, n_slot);
}

static_assert((int) cache_policy_kind::lru == HOBBIT_POLICY_LRU && (int) cache_policy_kind::lfu == HOBBIT_POLICY_LFU &&
              (int) cache_policy_kind::lhu == HOBBIT_POLICY_LHU && (int) cache_policy_kind::fld == HOBBIT_POLICY_FLD &&
              (int) cache_policy_kind::random == HOBBIT_POLICY_RANDOM &&
              (int) cache_policy_kind::weighted == HOBBIT_POLICY_WEIGHTED &&
              (int) cache_policy_kind::arc == HOBBIT_POLICY_ARC &&
              (int) cache_policy_kind::popularity == HOBBIT_POLICY_POPULARITY &&
              (int) cache_policy_kind::score == HOBBIT_POLICY_SCORE &&
              (int) cache_policy_kind::frequency == HOBBIT_POLICY_FREQUENCY, "cache_policy_kind follows hobbit.h's enum");

bool cache_policy_of(int policy, cache_policy_kind & kind) {
    if (policy < HOBBIT_POLICY_LRU || policy > HOBBIT_POLICY_FREQUENCY) {
        return false;
    }
    kind = (cache_policy_kind) policy;
    return true;
}

bool cache_policy_parse(const std::string & name, cache_policy_kind & kind) {
    for (cache_policy_kind k : { cache_policy_kind::lru, cache_policy_kind::lfu, cache_policy_kind::lhu,
                                 cache_policy_kind::fld, cache_policy_kind::random, cache_policy_kind::weighted,
                                 cache_policy_kind::arc, cache_policy_kind::popularity, cache_policy_kind::score,
                                 cache_policy_kind::frequency }) {
        if (name == cache_policy_name(k)) {
            kind = k;
            return true;
        }
    }
    return false;
}

const char * cache_policy_name(cache_policy_kind kind) {
    switch (kind) {
        case cache_policy_kind::lru:      return "lru";
        case cache_policy_kind::lfu:      return "lfu";
        case cache_policy_kind::lhu:      return "lhu";
        case cache_policy_kind::fld:      return "fld";
        case cache_policy_kind::random:   return "random";
        case cache_policy_kind::weighted: return "weighted";
        case cache_policy_kind::arc:      return "arc";
        case cache_policy_kind::popularity: return "popularity";
        case cache_policy_kind::score:    return "score";
        case cache_policy_kind::frequency: return "frequency";
    }
    return "?";
}

std::unique_ptr<cache_policy_i> cache_policy_make(cache_policy_kind kind, int n_slot, int n_layer, int n_expert,
                                                  const cache_policy_weights & weights, uint64_t seed,
                                                  const float * popularity, int score_history, int n_expert_used) {
    cache_policy_weights w;
    switch (kind) {
        case cache_policy_kind::lru:      w = { 1, 0, 0, 0 }; break;
        case cache_policy_kind::lfu:      w = { 0, 1, 0, 0 }; break;
        case cache_policy_kind::lhu:      w = { 0, 0, 1, 0 }; break;
        case cache_policy_kind::fld:      w = { 0, 0, 0, 1 }; break;
        case cache_policy_kind::weighted: w = weights; break;
        case cache_policy_kind::random:   return std::make_unique<random_policy>(seed);
        case cache_policy_kind::arc:      return std::make_unique<arc_policy>(n_slot, n_layer, n_expert);
        case cache_policy_kind::popularity:
            if (popularity == nullptr) {
                return nullptr; // the caller checks for a profile first
            }
            return std::make_unique<popularity_policy>(n_slot, n_layer, n_expert, popularity);
        case cache_policy_kind::score:    return std::make_unique<score_policy>(n_slot, n_layer, n_expert, score_history);
        case cache_policy_kind::frequency:
            return std::make_unique<frequency_policy>(n_slot, n_layer, n_expert, n_expert_used, popularity);
    }
    return std::make_unique<weighted_policy>(n_slot, n_layer, n_expert, w);
}

int sweep_victim(const std::vector<int> & candidates, const std::function<int(int)> & ahead, cache_policy_i & policy) {
    int farthest = -1;
    for (int s : candidates) {
        farthest = std::max(farthest, ahead(s));
    }
    std::vector<int> last;
    for (int s : candidates) {
        if (ahead(s) == farthest) {
            last.push_back(s);
        }
    }
    return policy.choose_victim(last);
}
