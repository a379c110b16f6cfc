// hobbit-runtime.h - the expert runtime of one model: pools, policies, predictor, I/O
// threads and the dispatch op that libllama calls after each MoE router (once per wave).
//
// One llama_context at a time: dispatches of concurrent contexts on the same model
// would release each other's pins.
#pragma once

#include "hobbit-cache-policy.h"
#include "hobbit-expert-cache.h"
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

struct hobbit_runtime : private cache_env {
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
    bool failed() const override { return has_error.load(std::memory_order_acquire) || mapping_faulted(); }

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
    static int32_t n_waves_op(void * ctx, int32_t n_tokens);
    // runs on the compute thread, blocking until this wave's experts are in the pools:
    // read the selection, the cache serves the wave, prefetch, submit, wait, write ids
    void dispatch(ggml_tensor * dst, int il, int wave);
    // the cache's loads given their slots' tensors, queued
    void submit(std::vector<load_task> & loads);
    // cache_env: what the cache asks of the runtime (called with the cache's lock held)
    bool runs_in_place(int il, int e, int n_tokens) const override;
    std::vector<bool> balanced_in_place(int il, const wave_selection & sel, const std::vector<int> & misses,
                                        const std::function<bool(int)> & either_way) const override;
    bool prepare_in_place(int il, int e) override;
    std::vector<load_task> drop_queued(const std::function<bool(const load_task &)> & pred) override;
    // importance-driven substitution (hobbit-substitution.h) for a decode ubatch (one token, or
    // a batch of beams or sequences, where an expert another token selects counts as cached:
    // Algorithm 2's batch rule): rewrites the dispatch op's selected ids and gate weights
    // (src[0], src[1]) before the wave reads them; the graph's later ops (the weighted sum,
    // gpt-oss's per-expert bias) read them too
    void substitute_low_scores(int il, ggml_tensor * dst);
    // token's router scores of every expert from the dispatch op's probs ([1, n_expert, n_tokens]),
    // as probabilities (gpt-oss's logits softmaxed)
    std::vector<float> router_scores(const ggml_tensor * probs, int token) const;
    // HOBBIT's adaptive prefetch (§3.3) from layer il's router input x: the next layers' predicted
    // experts at the level the score rule gives them, for the cache to load
    void prefetch_next_layers(int il, const float * x, std::vector<load_task> & loads);
    // a wide ubatch (prefill) needs nearly every expert of the next MoE layer: the cache loads them at
    // high precision while this layer computes, those most of its tokens are predicted to use
    // first (x: this layer's router input, or nullptr: in expert order)
    void prefetch_next_layer_whole(int il, const ggml_tensor * x, std::vector<load_task> & loads);
    // a wide ubatch computing in place: the next MoE layer's experts are read into the page
    // cache (readahead, asynchronous) while this layer computes, if there is room
    void read_ahead_next_layer(int il);
    // expert e of layer il computes in place: its slices are read ahead, exactly (the
    // mapping itself reads no further than the faulting page, advise_mapping_random)
    void read_ahead_in_place(int il, int e);
    // no fault on the model's mapping reads ahead beyond its page (at start-up)
    void advise_mapping_random();
    void open_and_guard_parts(); // part_files: open, stat, guard each part's mapping; the loaded fingerprint
    // does the executor choice look at what the page cache holds (auto, balanced)?
    bool measures_residency() const;
    // what the page cache may hold now beside the pools, or -1 if no limit is known
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
    // every level's pools (one per expert signature, or per layer): their tensors and row caches made
    std::vector<cache_pool_setup> make_pools(const std::vector<int64_t> & budgets);
    void choose_executor(const std::vector<cache_pool_setup> & pools);
    void make_cache(std::vector<cache_pool_setup> pools, cache_policy_kind policy_kind);
    void make_predictor();
    void make_io();
    void describe_layers();
    // fill the free slots of every level's pools in the background, the lowest level first, the most popular
    // experts first when a profile says which (params.warm_low)
    void warm_pools();
    // the static placement's levels of layer il's experts, or nullptr (the thresholds decide)
    const int8_t * placed(int il) const { return placement.empty() ? nullptr : placement[il].data(); }
    const expert_index & level_index(int level) const { return level > 0 ? companions[level - 1] : high ? *high : index; }
    int64_t used_pool_bytes() const; // the cache's slots and the neuron rows' pages in use
    // whether the model file still holds expert e of layer il; if not the run fails: computing
    // it in place would fault on pages past the end of the file (SIGBUS)
    bool mapped_expert_present(int il, int e);
    bool mapping_faulted() const; // a guard caught a SIGBUS in a mapped part
    // before a ubatch: the files as loaded (not cut, not written over); fails the run otherwise
    void check_files_unchanged();
    void fail(const std::string & msg) override; // the first failure sticks
    void on_load_done(const load_task & task, const std::string & error, uint64_t n_bytes, int64_t us);

    expert_index  index;                    // the model: level 0, the high precision, unless high is set
    std::optional<expert_index> high;       // a companion as level 0 (a precision ladder): the model's experts are not read
    std::vector<expert_index> companions;   // levels 1..n_level-1: the same experts at lower precisions
    hobbit_params params;
    precision_thresholds thresholds;        // which level a selection wants (HOBBIT eq. 2)
    std::vector<std::vector<int8_t>> placement; // [n_layer][n_expert]: a static placement's level of each expert (empty: none)
    std::vector<float> popularity;              // [n_layer * n_expert]: a popularity profile (Fiddler), 0 off the MoE layers (empty: none)
    int n_level = 1;

    ggml_backend_dev_t              pool_dev = nullptr; // where the pools live (expert_pool_device)
    std::unique_ptr<expert_cache>   cache;        // what each slot holds, and the decisions
    // per pool of the cache: its slots' tensors, and with neuron reads the rows of up and down
    // read for the experts of its layers (the pool holds their gate projections), or nullptr
    std::vector<std::unique_ptr<expert_pool>>      pool_tensors;
    std::vector<std::unique_ptr<neuron_row_cache>> row_caches;
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
    std::unique_ptr<io_scheduler>   io;   // last: its threads stop before the rest goes

    std::vector<dispatch_ud>             dispatch_uds;
    std::vector<llama_moe_offload_layer> layers;
    llama_moe_offload                    offload_desc = {};

    // guards stats_, recorder, the neuron rows (row_caches, rows_pending, pass_pages); held
    // around no call into the cache (whose lock the cache_env methods are called under)
    mutable std::mutex      mtx;
    std::condition_variable cv_rows;  // neuron row loads done
    bool                    neuron_reads = false; // params.neuron_reads, checked
    int                     rows_pending = 0;     // neuron row loads submitted and not done
    // the last fetch's pass: the row cache and each pair's pages (token-major, nullptr: not in the
    // pass), read by the up and down ops that follow it in the graph
    const neuron_row_cache *       pass_rows = nullptr;
    std::vector<const int32_t *>   pass_pages;
    hobbit_stats            stats_ = {};

    std::atomic<bool> has_error{false};
    mutable std::mutex error_mtx;      // guards error_msg; taken last, around nothing else
    std::string       error_msg;
};
