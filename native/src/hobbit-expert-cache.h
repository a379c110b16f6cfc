// hobbit-expert-cache.h - the expert cache: per precision level, slot tables shared by the
// layers of one expert signature, their eviction policies and counters, and the decision of
// what each selected expert of a wave gets (a hit, a load, in place, skipped, a wait, later).
//
// As llama.cpp's KV cache plans a ubatch's cells (find_slot) before writing them
// (apply_ubatch), a wave is planned from the slots as they are (plan_wave, which changes
// nothing) and the plan then carried out (apply_wave: pins, slots taken, loads out as tasks).
// The cache holds no tensors and does no I/O: its loads come out as load_tasks (the runtime
// gives them their target tensors and queues them), and load_done says when one completes. What
// it asks of the world around it (may a miss run in place, drop a queued read, has the run
// failed) comes through a cache_env.
//
// The lock is the cache's own: every public method takes it; the private ones run under it.
// cache_env's methods are called with it held, so they must not call back into the cache.
// waves_of_level and n_waves read only what the constructor fixed and take no lock.
#pragma once

#include "hobbit-cache-policy.h"
#include "hobbit-io-scheduler.h"
#include "hobbit-slot-table.h"
#include "hobbit-wave-plan.h"

#include "hobbit.h"

#include <array>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

// what the cache's decisions need from outside it: the executor's choice, the I/O queue, the
// run's failure. Called with the cache's lock held.
class cache_env {
public:
    virtual ~cache_env() = default;
    // would a miss of expert e of layer il used by n_tokens run in place (computed on the mapped model)?
    virtual bool runs_in_place(int il, int e, int n_tokens) const = 0;
    // balanced mode: which of a wave's misses (those either_way says may run in place or load)
    // run in place ([n_expert]); empty: the executor is not balanced
    virtual std::vector<bool> balanced_in_place(int il, const wave_selection & sel, const std::vector<int> & misses,
                                                const std::function<bool(int)> & either_way) const = 0;
    // expert e of layer il is about to compute in place (its bytes read ahead); false: the model
    // file no longer holds it and the run has failed
    virtual bool prepare_in_place(int il, int e) = 0;
    // the queued background reads pred accepts, taken off the I/O queue (they will not run)
    virtual std::vector<load_task> drop_queued(const std::function<bool(const load_task &)> & pred) = 0;
    virtual bool failed() const = 0;
    virtual void fail(const std::string & msg) = 0; // the first failure sticks
};

// one pool of the plan: the slots of one precision level for the layers of one expert signature
struct cache_pool_setup {
    int              level = 0;
    int              type  = -1;   // ggml type of the down projection (reported)
    int64_t          expert_bytes = 0; // of one slot
    int              n_slot = 0;
    std::vector<int> layers;       // MoE layers served
};

// what a cache is made of; fixed for its life
struct expert_cache_setup {
    int n_layer  = 0;
    int n_expert = 0;
    int n_expert_used = 0;
    int n_level  = 1;
    std::vector<int> moe_layers;
    std::vector<cache_pool_setup> pools;
    cache_policy_kind    policy = cache_policy_kind::lru;
    // another policy than a kind names (the simulator's Belady, made from the trace it replays), made per pool
    std::function<std::unique_ptr<cache_policy_i>(int n_slot)> make_policy;
    cache_policy_weights policy_weights = {};
    uint64_t             seed = 0;
    const float *        popularity = nullptr; // [n_layer * n_expert] a profile (Fiddler), or nullptr; copied
    int                  hit_policy = HOBBIT_HIT_FOUND;
    bool                 skip_cached = false;  // HOBBIT's T2 skips cached experts too
    bool                 level_waves = false;  // hits exact over several levels: a wide ubatch served level by level
    std::vector<bool>    inplace_ok;           // [n_layer] the layer's misses may run in place
    // where in place is allowed: a ubatch of any width has an in-place pass (cooperative, auto,
    // balanced), or only one wider than the layer's pools (gpu-centric)
    bool                 inplace_any_width = false;
    // [n_layer] the most experts one wave may hold (neuron reads: what the row cache's pages hold
    // whole); empty: no limit but the slots
    std::vector<int>     wave_limit;
};

// what the cache counted since it was made (or reset)
struct cache_counters {
    int64_t hits = 0, misses = 0, inplace = 0;
    int64_t served[HOBBIT_MAX_LEVELS] = {};
    int64_t skipped = 0, upgrades = 0, warm_loads = 0;
    int64_t prefetch_issued = 0, prefetch_used = 0, prefetch_wasted = 0;
    int64_t loads_overlapped = 0; // completed while nobody waited, the graph between two MoE layers

    void write_to(hobbit_stats & s) const; // as the C API reports them
};

// one pool's counters and shape
struct cache_pool_counters {
    int64_t hits = 0, misses = 0, bytes_read = 0, expert_bytes = 0;
    int     n_slot = 0, n_layer = 0, level = 0, type = -1;
};

// one predicted layer's experts for the decode prefetch, in the predictor's order, with the level
// each would be served at (PRECISION_SKIP: skipped if missed)
struct predicted_layer {
    int il = -1;
    std::vector<int> experts;
    std::vector<int> levels;
};

class expert_cache {
public:
    expert_cache(const expert_cache_setup & setup, cache_env & env);
    expert_cache(const expert_cache &) = delete;
    expert_cache & operator=(const expert_cache &) = delete;

    int n_pool() const { return (int) pools.size(); }
    int pool_of(int level, int il) const { return pool_of_[level][il]; } // -1 for a dense layer
    int n_level() const { return n_level_; }
    bool reads_scores() const { return policy_reads_scores; } // the score-history policy: serve_wave wants every token's scores

    // lock-free, from the setup: the waves a ubatch of n_tokens takes at layer il, all levels' and one level's
    int  n_waves(int il, int n_tokens) const;
    int  waves_of_level(int il, int n_tokens) const;
    bool waves_by_level(int n_tokens) const;
    int  layer_capacity(int il) const; // experts one wave of layer il holds
    // a ubatch of layer il with at least this many (token, expert) pairs has an in-place pass
    int32_t inplace_min_pairs(int il) const { return inplace_min_pairs_[il]; }

    // one wave of a dispatch: the previous wave's pins go (begin_wave), the wave is planned and
    // applied. level_of_wave >= 0: one level's waves of a ubatch served level by level (sel holds
    // that level's pairs), wave_of_level its wave among them. token_scores: every token's router
    // scores (reads_scores(), wave 0), else empty. Loads out in loads
    wave_assignment serve_wave(int il, int wave, int level_of_wave, int wave_of_level, const wave_selection & sel,
                               const std::vector<std::vector<float>> & token_scores, std::vector<load_task> & loads);
    // the parts of serve_wave, for tests: begin_wave, then the plan of a wave (changes nothing), then its application
    void begin_wave(int il, int wave, const wave_selection & sel, const std::vector<std::vector<float>> & token_scores);
    wave_plan plan_wave(int il, int wave, const wave_selection & sel) const;
    wave_assignment apply_wave(int il, const wave_plan & plan, const wave_selection & sel, std::vector<load_task> & loads);
    // block until every slot the last wave pinned holds its expert (or the run failed); then this
    // layer is the latest dispatched. The time waited, in microseconds
    int64_t wait_for_pins(int il);

    // HOBBIT's adaptive prefetch (§3.3): the predicted layers' experts loaded and pinned until their
    // layer runs, one layer deeper only while everything predicted so far is cached
    void prefetch_predicted(const std::vector<predicted_layer> & predictions, std::vector<load_task> & loads);
    // a wide ubatch: layer next's experts loaded in this order (low[e]: at the lowest level), as many as
    // its pools have room for beside what is pinned
    void prefetch_layer_whole(int next, const std::vector<int> & order, const std::vector<bool> & low,
                              std::vector<load_task> & loads);
    // fill the free slots of levels deepest up to 0 in the background, the deepest first, in this order
    // of (layer, expert); placed(il): a static placement's levels of layer il (an expert only at its
    // own), or nullptr
    void warm(const std::vector<std::pair<int, int>> & order, const std::function<const int8_t *(int)> & placed,
              int deepest, std::vector<load_task> & loads);

    // a load has finished (error: it failed; its slot is emptied): counted, waiters woken
    void load_done(const load_task & task, bool ok, uint64_t n_bytes);
    // a dispatch waits for reads the cache does not own (neuron rows): loads completing meanwhile
    // ran under a wait, not under compute (+1 before the wait, -1 after)
    void waiting_elsewhere(int delta);

    // cached at any level: [n_expert] for layer il (substitution's "cached")
    std::vector<bool> cached_experts(int il) const;
    // the (layer, expert) slot s of pool p holds
    std::pair<int, int> slot_owner(int p, int s) const;
    int64_t used_slot_bytes() const; // slots that hold or are loading an expert
    cache_counters counters() const;
    bool pool_counters(int p, cache_pool_counters & out) const;
    void reset_counters();
    void new_sequence(); // the policies' sequence-level records reset

private:
    struct pool_group {
        slot_table                      slots;
        std::unique_ptr<cache_policy_i> policy;
        int     level = 0;
        int     type  = -1;
        int64_t expert_bytes = 0;
        int     n_layer = 0;
        int64_t hits = 0, misses = 0, bytes_read = 0;
    };
    struct predicted_pin {
        int pool, slot, layer;
        int64_t graph; // the graph (token step) it was predicted in
    };

    // how a plan may use a slot: by its logical state only (what it was given, its pins, a
    // background load queued this graph), never whether its bytes have arrived
    slot_use use_of(const slot_entry & s) const;
    // a background read into slot s of pool p stops mattering: dropped if still queued (the slot
    // then unread: it keeps its expert, read when first used), else waited out (with lock;
    // nullptr: only while nothing reads into the pools, the warm-up)
    void settle(int p, int s, std::unique_lock<std::mutex> * lock);
    // a slot of pool p for a new expert, or -1 if every slot is busy (use_of); settled with lock
    int  take_slot(int p, std::unique_lock<std::mutex> * lock);
    // a slot for an expert of layer il at level want if one is free, else at the nearest
    // higher precision, else (allow_lower) lower; level set to the level found
    int  take_slot_near(int il, int want, bool exact, bool allow_lower, int & level, std::unique_lock<std::mutex> & lock);
    // the last wave's expert finds no slot: the predictions unpinned, this graph's background
    // loads into the layer's pools made evictable, then a slot or a failure (this ubatch holds them
    // all); the slot and its level, or -1; the lock is released while a running load is waited for
    int  wait_for_slot(int il, int want, bool exact, const wave_selection & sel, std::unique_lock<std::mutex> & lock, int & level);
    // the cached copy a selection may use: any level (at-least: not below want), or (exact) only the wanted one
    int  lookup(int il, int e, int want, bool exact, int & level) const;
    // the slot of (il, e) at the highest precision cached, or -1; level set
    int  find_cached(int il, int e, int & level) const;
    // hits "exact" for this expert of the selection: not for a prompt's least popular
    bool exact_for(const wave_selection & sel, int e) const;
    // does the policy count this access as high precision (HOBBIT's LHU)? the level served, unless the selection says
    static bool counted_high(const wave_selection & sel, int e, int level);
    // may a selection be served below the precision it wants (every hit policy but "at-least")?
    bool lower_allowed() const;
    // queue a load of (il, e) into a free or evictable slot of pool p; the slot, or -1 if none
    // (lock nullptr: the warm-up, before any graph)
    int  queue_background_load(int p, int il, int e, bool prefetch, std::vector<load_task> & loads,
                               std::unique_lock<std::mutex> * lock);
    load_task slot_load(int p, int s, int il, int e, bool prefetch) const;
    // predicted experts stay pinned until their layer runs (or a new graph starts)
    void pin_predicted(int p, int s, int il);
    void release_predicted(const std::function<bool(int p, int s, int il)> & pred);
    void begin_wave_locked(int il, int wave, const wave_selection & sel, const std::vector<std::vector<float>> & token_scores);
    wave_plan plan_wave_locked(int il, int wave, const wave_selection & sel) const;
    wave_assignment apply_wave_locked(int il, const wave_plan & plan, const wave_selection & sel,
                                      std::unique_lock<std::mutex> & lock, std::vector<load_task> & loads);

    cache_env & env;
    // fixed by the setup
    int n_layer_, n_expert_, n_expert_used_, n_level_;
    int hit_policy;
    bool skip_cached, level_waves, policy_reads_scores;
    std::vector<int> moe_rank;              // [n_layer] a layer's index among the MoE layers (-1: dense)
    int last_moe_layer = -1;                // after its dispatch the graph is about to end
    std::vector<bool> inplace_ok;
    std::vector<int32_t> inplace_min_pairs_;
    int n_moe_layer = 0;
    std::vector<int> wave_limit;
    std::vector<std::vector<int>> pool_of_; // [level][n_layer]: index in pools, -1 for dense layers

    // guarded by mtx
    mutable std::mutex      mtx;
    std::condition_variable cv_loaded;
    std::vector<pool_group> pools;
    std::vector<std::pair<int, int>> pinned;        // (pool, slot) pinned by the last wave
    std::vector<predicted_pin>       predicted_pins;
    // prefetches queued this graph (pool, slot, layer): busy until their layer's turn (begin_wave)
    std::vector<std::array<int, 3>>  prefetched_this_graph;
    int     upgrades_this_graph = 0;
    int64_t graph_seq = 0;          // counts graphs: a dispatch of a layer not after the last one starts a new one
    std::vector<bool> served;       // experts of the current layer's ubatch served by an earlier wave
    int     sweep_rank = -1;        // a prompt's wide ubatch: the MoE rank of the layer it is at (sweep_victim); -1 decoding
    int     last_dispatch_il = -1;  // layer of the latest dispatch
    int     n_waiting = 0;          // dispatches waiting for their loads
    cache_counters counts;
};
