// hobbit-runtime.h - the expert runtime of one model: pools, policies, predictor, I/O
// threads and the dispatch op that libllama calls after each MoE router (once per wave).
//
// One llama_context at a time: dispatches of concurrent contexts on the same model
// would release each other's pins.
#pragma once

#include "hobbit-cache-policy.h"
#include "hobbit-expert-pool.h"
#include "hobbit-slot-table.h"
#include "hobbit-executor-choice.h"
#include "hobbit-expert-store.h"
#include "hobbit-io-scheduler.h"
#include "hobbit-mapping-guard.h"
#include "hobbit-neuron-bits.h"
#include "hobbit-neuron-rows.h"
#include "hobbit-pool-plan.h"
#include "hobbit-precision-scorer.h"
#include "hobbit-predictor.h"
#include "hobbit-trace-recorder.h"
#include "hobbit-wave-plan.h"

#include "hobbit.h"
#include "llama.h"

#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <ctime>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

// every MoE layer's router as floats, whatever its type and wherever it lives (the predictor's
// and a trace's input)
std::vector<router_weights> load_routers(const llama_model * model, const std::vector<int> & moe_layers);

// the runtime's clock for its timings (dispatch and waits), in microseconds
inline int64_t runtime_clock_us() {
    return std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

struct hobbit_runtime {
    // throws hobbit_error (bad or split file, dense model, budget below the minimum)
    hobbit_runtime(const llama_model * model, const std::string & path, const hobbit_params & params);
    ~hobbit_runtime();

    const llama_moe_offload * offload() const { return &offload_desc; }

    hobbit_stats stats() const;
    void reset_stats();

    bool pool_stats(int pool, hobbit_pool_stats & out) const;

    // routing trace (hobbit-trace-recorder); throws hobbit_error on a bad lookahead
    void    trace_begin(int lookahead, bool keep_inputs);
    int64_t trace_size(int & n_moe_layer, int & lookahead) const;
    void    trace_copy(int64_t n, int32_t * experts, float * weights, float * probs, int32_t * predicted,
                       float * inputs) const;
    void    trace_end();

    void new_sequence();

    bool error(std::string & msg) const;
    void clear_error();
    const char * pool_device_name() const { return ggml_backend_dev_name(pool_dev); }
    bool failed() const { return has_error.load(std::memory_order_acquire) || mapping_faulted(); }

private:
    struct dispatch_ud {
        hobbit_runtime * rt;
        int il;
        int wave;
    };

    static void    dispatch_op(ggml_tensor * dst, int ith, int nth, void * ud);
    // CORM's neuron mask of a pass: what it kept, counted (args: kept share per pair, dispatch ids)
    static void    neuron_count_op(ggml_tensor * dst, int ith, int nth, void * ud);
    // neuron-granular reads (hobbit-neuron-reads.h): after the gate projection, the rows of up and
    // down its activations keep are read into the neuron row cache (args: gate pre-activation,
    // dispatch ids; dst: the keep mask); the up projection over the kept neurons (args: the
    // experts' input, the keep mask, slot ids) and the down projection (args: activation, slot ids)
    // over the rows the fetch left in pass_pages
    static void    neuron_fetch_op(ggml_tensor * dst, int ith, int nth, void * ud);
    static void    neuron_up_op(ggml_tensor * dst, int ith, int nth, void * ud);
    static void    neuron_down_op(ggml_tensor * dst, int ith, int nth, void * ud);
    void fetch_neurons(ggml_tensor * dst, int il); // blocks until the rows are read
    // a load of expert e of layer il into slot s of pool p (with neuron reads its gate projection only)
    load_task slot_load(int p, int s, int il, int e, bool prefetch) const;
    static int32_t n_waves_op(void * ctx, int32_t n_tokens);
    int  n_waves(int il, int n_tokens) const;
    // hits "exact" over several levels (no placement, no prompt share): a ubatch of several tokens is
    // served level by level, each level's waves taking only the pairs whose own score wants it, so
    // that every token's selection is served at its level as decode serves it (one wave would serve
    // an expert at the highest level any of its tokens wants): the rule priced on a prompt-shaped pass
    bool waves_by_level(int n_tokens) const;
    // the waves of one level (of the ubatch, where not served level by level)
    int  waves_of_level(int il, int n_tokens) const;
    // runs on the compute thread, blocking until this wave's experts are in the pools:
    // read the selection, begin_wave, plan_wave, apply_wave, prefetch, submit, wait, write ids
    void dispatch(ggml_tensor * dst, int il, int wave);
    // the previous wave's pins, stale predictions and wrong prefetches' queued reads go; needs mtx
    void begin_wave(int il, int wave, const wave_selection & sel, const ggml_tensor * dst);
    // how a plan may use a slot: by its logical state only (what it was given, its pins, a
    // background load queued this graph), never whether its bytes have arrived
    slot_use use_of(const slot_entry & s) const;
    // a background read into slot s of pool p stops mattering: dropped if still queued (the slot
    // then unread: it keeps its expert, read when first used), else waited out (with lock;
    // nullptr: only while nothing reads into the pools, the warm-up)
    void settle(int p, int s, std::unique_lock<std::mutex> * lock);
    // what the wave (of its level's waves) does for each selected expert, from the pools as they are;
    // changes nothing; needs mtx
    wave_plan plan_wave(int il, int wave, const wave_selection & sel) const;
    // carries the plan out: hits pinned, slots taken and assigned, loads and upgrades
    // queued in loads, counted in the stats; needs mtx, which a wait for a slot releases
    wave_assignment apply_wave(int il, const wave_plan & plan, const wave_selection & sel,
                               std::unique_lock<std::mutex> & lock, std::vector<load_task> & loads);
    // the last wave's expert finds no slot: the predictions unpinned, this graph's background
    // loads into the layer's pools cancelled, then a slot or a failure (this ubatch holds them
    // all); the slot and its level, or -1; needs mtx, which a wait for a running load releases
    int  wait_for_slot(int il, int want, bool exact, const wave_selection & sel, std::unique_lock<std::mutex> & lock, int & level);
    // the cached copy a selection may use: any level, or (exact) only the wanted one; needs mtx
    int  lookup(int il, int e, int want, bool exact, int & level) const;
    // hits "exact" for this expert of the selection: not for a prompt's least popular (any copy at or
    // above the low level serves them)
    bool exact_for(const wave_selection & sel, int e) const;
    // may a selection be served below the precision it wants (every hit policy but "at-least")?
    bool lower_allowed() const;
    // a slot of pool p for a new expert, or -1 if every slot is busy (use_of); settled with
    // lock (nullptr: only while nothing reads into the pools, the warm-up); needs mtx
    int  take_slot(int p, std::unique_lock<std::mutex> * lock);
    // a slot for an expert of layer il at level want if one is free, else at the nearest
    // higher precision, else (allow_lower) lower; level set to the level found; needs mtx
    int  take_slot_near(int il, int want, bool exact, bool allow_lower, int & level, std::unique_lock<std::mutex> & lock);
    // the slot of (il, e) at the highest precision cached, or -1; level set; needs mtx
    int  find_cached(int il, int e, int & level) const;
    // the layer's pools (one per level) hold up to this many experts at once
    int  layer_capacity(int il) const;
    // queue a load of (il, e) into a free or evictable slot of pool p; the slot, or -1 if none; needs mtx
    int  queue_background_load(int p, int il, int e, bool prefetch, std::vector<load_task> & loads,
                               std::unique_lock<std::mutex> * lock);
    // HOBBIT's adaptive prefetch (§3.3) from layer il's router input x; needs mtx
    void prefetch_next_layers(int il, const float * x, std::vector<load_task> & loads, std::unique_lock<std::mutex> & lock);
    // importance-driven substitution (hobbit-substitution.h) for a decode ubatch (one token, or
    // a batch of beams or sequences, where an expert another token selects counts as cached:
    // Algorithm 2's batch rule): rewrites the dispatch op's selected ids and gate weights
    // (src[0], src[1]) before the wave reads them; the graph's later ops (the weighted sum,
    // gpt-oss's per-expert bias) read them too
    void substitute_low_scores(int il, ggml_tensor * dst);
    // token's router scores of every expert from the dispatch op's probs ([1, n_expert, n_tokens]),
    // as probabilities (gpt-oss's logits softmaxed)
    std::vector<float> router_scores(const ggml_tensor * probs, int token) const;
    // a wide ubatch (prefill) needs nearly every expert of the next MoE layer: load them at
    // high precision while this layer computes, as many as the next layer's pool has room for,
    // those most of its tokens are predicted to use first (x: this layer's router input, or
    // nullptr: in expert order); needs mtx
    void prefetch_next_layer_whole(int il, const ggml_tensor * x, std::vector<load_task> & loads,
                                   std::unique_lock<std::mutex> & lock);
    // a wide ubatch computing in place: the next MoE layer's experts are read into the page
    // cache (readahead, asynchronous) while this layer computes, if there is room; needs mtx
    void read_ahead_next_layer(int il);
    // expert e of layer il computes in place: its slices are read ahead, exactly (the
    // mapping itself reads no further than the faulting page, advise_mapping_random)
    void read_ahead_in_place(int il, int e);
    // no fault on the model's mapping reads ahead beyond its page (at start-up)
    void advise_mapping_random();
    void open_and_guard_parts(); // part_files: open, stat, guard each part's mapping; the loaded fingerprint
    // predicted experts stay pinned until their layer runs (or a new graph starts); needs mtx
    void pin_predicted(int p, int s, int il);
    void release_predicted(const std::function<bool(int p, int s, int il)> & pred);
    // would a miss of expert e of layer il used by n_tokens run in place (executor choice)? needs mtx
    bool runs_in_place(int il, int e, int n_tokens) const;
    // balanced mode: which of a wave's misses (those either_way says may run in place or
    // load) run in place, by Algorithm 2's split ([n_expert]); needs mtx
    std::vector<bool> balanced_in_place(int il, const wave_selection & sel, const std::vector<int> & misses,
                                        const std::function<bool(int)> & either_way) const;
    // does the executor choice look at what the page cache holds (auto, balanced)?
    bool measures_residency() const;
    // what the page cache may hold now beside the pools, or -1 if no limit is known; needs mtx
    int64_t page_cache_room() const;
    // share of expert e of layer il resident in the page cache (its slices of the mapped model)
    double resident(int il, int e) const;
    // set-up, in the constructor's order (each a step of it; hobbit-runtime.cpp)
    void open_levels(const std::string & path);
    cache_policy_kind parse_policy() const;
    void find_moe_layers(const std::string & path);
    void check_neuron_options(const std::string & path);
    void take_placement(const std::string & path);
    void take_popularity(const std::string & path, cache_policy_kind policy_kind);
    std::vector<const expert_index *> levels_in_order() const;
    std::vector<int64_t> level_budgets() const;
    void choose_pool_device();
    int64_t make_pools(const std::vector<int64_t> & budgets, cache_policy_kind policy_kind);
    void choose_executor();
    void make_predictor();
    void make_io();
    void describe_layers();
    // fill the free slots of every level's pools in the background, the lowest level first, the most popular
    // experts first when a profile says which (params.warm_low)
    void warm_pools();
    // the static placement's levels of layer il's experts, or nullptr (the thresholds decide)
    const int8_t * placed(int il) const { return placement.empty() ? nullptr : placement[il].data(); }
    const expert_index & level_index(int level) const { return level > 0 ? companions[level - 1] : high ? *high : index; }
    int64_t used_pool_bytes() const; // needs mtx
    // whether the model file still holds expert e of layer il; if not the run fails: computing
    // it in place would fault on pages past the end of the file (SIGBUS); needs mtx
    bool mapped_expert_present(int il, int e);
    bool mapping_faulted() const; // a guard caught a SIGBUS in a mapped part
    // before a ubatch: the files as loaded (not cut, not written over); fails the run otherwise
    void check_files_unchanged();
    void fail(const std::string & msg); // the first failure sticks; needs mtx
    void on_load_done(const load_task & task, const std::string & error, uint64_t n_bytes, int64_t us);

    expert_index  index;                    // the model: level 0, the high precision, unless high is set
    std::optional<expert_index> high;       // a companion as level 0 (a precision ladder): the model's experts are not read
    std::vector<expert_index> companions;   // levels 1..n_level-1: the same experts at lower precisions
    hobbit_params params;
    precision_thresholds thresholds;        // which level a selection wants (HOBBIT eq. 2)
    std::vector<std::vector<int8_t>> placement; // [n_layer][n_expert]: a static placement's level of each expert (empty: none)
    std::vector<float> popularity;              // [n_layer * n_expert]: a popularity profile (Fiddler), 0 off the MoE layers (empty: none)
    bool policy_reads_scores = false;           // the score-history policy: begin_wave feeds it every token's router scores
    int n_level = 1;

    // per level, one pool per expert signature (shapes and types of the projections): the
    // layers of a Q4_K_M model whose down projection is Q6_K share one pool, the Q4_K ones another
    struct pool_group {
        std::unique_ptr<expert_pool>    pool;   // the slots' tensors
        slot_table                      slots;  // what each slot holds
        std::unique_ptr<cache_policy_i> policy;
        int     level = 0;
        int     type  = -1;                     // ggml type of the down projection
        int64_t expert_bytes = 0;
        int     n_layer = 0;                    // MoE layers served
        int64_t hits = 0, misses = 0, bytes_read = 0;
        // neuron reads: the rows of up and down read for the experts of these layers (the pool
        // holds their gate projections)
        std::unique_ptr<neuron_row_cache> rows;
    };
    ggml_backend_dev_t              pool_dev = nullptr; // where the pools live (expert_pool_device)
    std::vector<pool_group>         pools;
    std::vector<std::vector<int>>   pool_of;    // [level][n_layer]: index in pools, -1 for dense layers
    std::unique_ptr<predictor_i>    predictor;
    executor_choice                 executor;   // load a missed expert, or compute it in place
    std::vector<bool>               inplace_ok; // [n_layer]: the layer's experts may run on the mapped model
    std::unique_ptr<trace_recorder> recorder;     // while a trace is recorded
    const llama_model *             model = nullptr;
    // each file of the model, open: the size and identity checks ask the files this process
    // maps (fstat), whatever their paths name now (a model replaced by rename is intact here)
    struct part_file {
        int             fd = -1;
        off_t           size = 0;     // when last found unchanged
        struct timespec mtime = {};
        std::unique_ptr<mapping_guard> guard; // over the part's whole mapping (none when it is not mapped)
    };
    std::vector<part_file>          part_files;
    std::vector<uintptr_t>          part_base;  // where each part's mapping starts (0: not one mapping of the file)
    std::string                     loaded_fingerprint; // of the experts as loaded (expert_index::fingerprint)
    std::vector<int>                moe_layers;
    std::vector<int>                moe_rank;   // [n_layer]: a layer's index among moe_layers (-1: dense)
    std::unique_ptr<io_scheduler>   io;   // last: its threads stop before the rest goes

    std::vector<dispatch_ud>             dispatch_uds;
    std::vector<llama_moe_offload_layer> layers;
    llama_moe_offload                    offload_desc = {};

    mutable std::mutex      mtx;      // guards pools, predictor, recorder, stats_, pinned, n_waiting, last_dispatch_il
    std::condition_variable cv_loaded;
    std::vector<std::pair<int, int>> pinned; // (pool, slot) pinned by the last dispatch
    struct predicted_pin {
        int pool, slot, layer;
        int64_t graph;               // the graph (token step) it was predicted in
    };
    std::vector<predicted_pin> predicted_pins;
    int                     upgrades_this_graph = 0;
    // prefetches queued this graph (pool, slot, layer): busy until their layer's turn (begin_wave)
    std::vector<std::array<int, 3>> prefetched_this_graph;
    int64_t                 graph_seq = 0; // counts graphs: a dispatch of a layer not after the last one starts a new one
    std::vector<bool>       served;   // experts of the current layer's ubatch served by an earlier wave
    int                     n_waiting = 0;
    bool                    neuron_reads = false; // params.neuron_reads, checked
    int                     rows_pending = 0;     // neuron row loads submitted and not done
    // the last fetch's pass: the row cache and each pair's pages (token-major, nullptr: not in the
    // pass), read by the up and down ops that follow it in the graph
    const neuron_row_cache *       pass_rows = nullptr;
    std::vector<const int32_t *>   pass_pages;
    int                     last_dispatch_il = -1; // layer of the latest dispatch
    int                     last_moe_layer   = -1; // after its dispatch the graph is about to end
    int                     sweep_rank       = -1; // a prompt's wide ubatch: the MoE rank of the layer it is at
                                                   // (slots taken in sweep order, sweep_victim); -1 decoding
    hobbit_stats            stats_ = {};

    std::atomic<bool> has_error{false};
    std::string       error_msg;      // guarded by mtx
};
