// hobbit-runtime.h - the expert runtime of one model: the glue between llama.cpp's graph and the
// expert cache (the dispatch op after each MoE router, once per wave: the selection read, served
// by the cache, its loads queued to the I/O threads, waited for, the id planes written), the
// predictor, the mapped model's files, CORM's neuron ops, and what the C API reports.
// One llama_context at a time: concurrent contexts would release each other's pins.
#pragma once

#include "hobbit-error.h"
#include "hobbit-executor-choice.h"
#include "hobbit-expert-cache.h"
#include "hobbit-expert-pool.h"
#include "hobbit-io-scheduler.h"
#include "hobbit-model-files.h"
#include "hobbit-neuron-rows.h"
#include "hobbit-predictor.h"
#include "hobbit-runtime-plan.h"
#include "hobbit-trace-recorder.h"

#include "hobbit.h"
#include "llama.h"

#include <chrono>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

// every MoE layer's router as floats, whatever its type and wherever it lives (predictor, trace)
std::vector<router_weights> load_routers(const llama_model * model, const std::vector<int> & moe_layers);

// the runtime's clock for its timings (dispatch and waits), in microseconds
inline int64_t runtime_clock_us() {
    return std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

struct hobbit_runtime : private cache_env {
    // throws hobbit_error (bad or split file, dense model, budget below the minimum)
    hobbit_runtime(const llama_model * model, const std::string & path, const hobbit_params & params);
    ~hobbit_runtime();

    const llama_moe_offload * offload() const { return &graph.desc; }
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
    const char * pool_device_name() const { return ggml_backend_dev_name(pools.dev); }
    bool failed() const override { return failure.failed() || files.faulted(); }

private:
    struct dispatch_ud { hobbit_runtime * rt; int il; int wave; }; // a dispatch op's: its layer and wave
    // the graph's ops (hobbit-runtime-waves.cpp, -neurons.cpp)
    static void    dispatch_op(ggml_tensor * dst, int ith, int nth, void * ud);
    static int32_t n_waves_op(void * ctx, int32_t n_tokens);
    static void    neuron_count_op(ggml_tensor * dst, int ith, int nth, void * ud);
    static void    neuron_fetch_op(ggml_tensor * dst, int ith, int nth, void * ud);
    static void    neuron_up_op(ggml_tensor * dst, int ith, int nth, void * ud);
    static void    neuron_down_op(ggml_tensor * dst, int ith, int nth, void * ud);
    void dispatch(ggml_tensor * dst, int il, int wave);
    void fetch_neurons(ggml_tensor * dst, int il); // blocks until the rows are read
    void substitute_low_scores(int il, ggml_tensor * dst);
    std::vector<float> router_scores(const ggml_tensor * probs, int token) const;
    void submit(std::vector<load_task> & loads); // the cache's loads given their slots' tensors, queued
    void on_load_done(const load_task & task, const std::string & error, uint64_t n_bytes, int64_t us);
    // cache_env: what the cache asks of the runtime (called with the cache's lock held)
    bool runs_in_place(int il, int e, int n_tokens) const override;
    std::vector<bool> balanced_in_place(int il, const wave_selection & sel, const std::vector<int> & misses,
                                        const std::function<bool(int)> & either_way) const override;
    bool prepare_in_place(int il, int e) override;
    std::vector<load_task> drop_queued(const std::function<bool(const load_task &)> & pred) override;
    void fail(const std::string & msg) override; // the first failure sticks
    // the predictions the cache's background loads follow (hobbit-runtime-loads.cpp)
    void prefetch_next_layers(int il, const float * x, std::vector<load_task> & loads);
    void prefetch_next_layer_whole(int il, const ggml_tensor * x, std::vector<load_task> & loads);
    void read_ahead_next_layer(int il);
    bool measures_residency() const;
    int64_t page_cache_room() const;
    double resident(int il, int e) const;
    int64_t used_pool_bytes() const; // the cache's slots and the neuron rows' pages in use
    // set-up, in the constructor's order after the plan (hobbit-runtime.cpp)
    void check_model_tensors(const std::string & path);
    void choose_pool_device();
    void make_pools();
    void choose_executor();
    void make_cache();
    void make_predictor();
    void make_io();
    void describe_layers();
    void warm_pools();
    // what llama.cpp's graph reads: per MoE layer its dispatch ops (one per wave), pools and neuron ops
    struct offload_hooks {
        std::vector<dispatch_ud> uds;
        std::vector<llama_moe_offload_layer> layers;
        llama_moe_offload desc = {};
    };

    model_levels                    levels;   // the model's experts at each precision level
    hobbit_params                   params;
    runtime_plan                    plan;     // what the set-up made: layers, thresholds, placement, pools
    expert_pool_set                 pools;    // where the pools live, and their slots' tensors
    std::unique_ptr<expert_cache>   cache;    // what each slot holds, and the decisions
    std::unique_ptr<predictor_i>    predictor;
    executor_choice                 executor; // load a missed expert, or compute it in place
    model_files                     files;    // the mapped model and its parts, open and guarded for the run
    std::unique_ptr<io_scheduler>   io;       // after the pools: its threads stop before they go
    offload_hooks                   graph;
    mutable std::mutex              mtx;      // guards the next three; held around no call into the cache
    hobbit_stats                    stats_ = {};
    std::unique_ptr<trace_recorder> recorder; // while a trace is recorded
    neuron_pass                     neurons;  // neuron-granular reads: the row caches and the last fetch's pass
    run_failure                     failure;
};
