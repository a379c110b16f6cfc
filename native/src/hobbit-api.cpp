// hobbit-api.cpp - the C boundary: catches every exception, returns hobbit_status.
#include "hobbit.h"

#include "hobbit-cache-sim.h"
#include "hobbit-error.h"
#include "hobbit-params.h"
#include "hobbit-pool-plan.h"
#include "hobbit-runtime.h"

#include "llama.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

static void write_error(char * err, size_t err_size, const std::string & msg) {
    if (err != nullptr && err_size > 0) {
        snprintf(err, err_size, "%s", msg.c_str());
    }
}

// runs f, turning an exception into a status and a message in err (prefix names the file
// for exceptions that do not): no C++ exception crosses the C API
template <typename F>
static hobbit_status guarded(F && f, char * err, size_t err_size, const std::string & prefix = "") {
    try {
        f();
        return HOBBIT_STATUS_OK;
    } catch (const hobbit_error & e) {
        write_error(err, err_size, e.what());
        return e.status;
    } catch (const std::exception & e) {
        write_error(err, err_size, prefix + e.what());
        return HOBBIT_STATUS_ERROR_INTERNAL;
    }
}

// params for the load armed on this thread, and why the last attach failed
static thread_local hobbit_params g_pending_params;
static thread_local std::string   g_pending_level_paths[HOBBIT_MAX_LEVELS]; // owned copies of params.level_paths
static thread_local std::vector<int8_t> g_pending_expert_levels;           // owned copy of params.expert_levels
static thread_local std::string   g_attach_error;

static const llama_moe_offload * hobbit_attach(const llama_model * model, const char * path, void * user_data) {
    (void) user_data;
    g_attach_error.clear();
    try {
        auto * rt = new hobbit_runtime(model, path, g_pending_params);
        return rt->offload();
    } catch (const std::exception & e) {
        g_attach_error = e.what();
        fprintf(stderr, "hobbitpy: %s\n", e.what());
        return nullptr;
    }
}

extern "C" {

enum hobbit_status hobbit_inspect_model(const char * path, struct hobbit_model_info * info, char * err, size_t err_size) {
    if (path == nullptr || info == nullptr) {
        write_error(err, err_size, "hobbit_inspect_model: path and info are required");
        return HOBBIT_STATUS_ERROR_INVALID;
    }
    return guarded([&] { *info = expert_index::from_file(path).info; }, err, err_size, std::string(path) + ": ");
}

enum hobbit_status hobbit_model_fingerprint(const char * path, char * out, size_t out_size, char * err, size_t err_size) {
    if (path == nullptr || out == nullptr || out_size < 17) {
        write_error(err, err_size, "hobbit_model_fingerprint: path and an out buffer of 17 bytes are required");
        return HOBBIT_STATUS_ERROR_INVALID;
    }
    return guarded([&] { snprintf(out, out_size, "%s", expert_index::from_file(path).fingerprint().c_str()); },
                   err, err_size, std::string(path) + ": ");
}

enum hobbit_status hobbit_layer_expert_bytes(const char * path, int64_t * out, int32_t n_max, int32_t * n,
                                             char * err, size_t err_size) {
    if (path == nullptr || out == nullptr || n == nullptr) {
        write_error(err, err_size, "hobbit_layer_expert_bytes: path, out and n are required");
        return HOBBIT_STATUS_ERROR_INVALID;
    }
    return guarded([&] {
        std::vector<int64_t> bytes;
        for (const expert_layer_layout & layer : expert_index::from_file(path).layers) {
            if (layer.has_experts()) {
                bytes.push_back((int64_t) layer.n_bytes());
            }
        }
        if (bytes.size() > (size_t) std::max(n_max, 0)) {
            throw hobbit_error(HOBBIT_STATUS_ERROR_INVALID, std::string(path) + ": " + std::to_string(bytes.size()) +
                               " MoE layers, room for " + std::to_string(n_max));
        }
        std::copy(bytes.begin(), bytes.end(), out);
        *n = (int32_t) bytes.size();
    }, err, err_size, std::string(path) + ": ");
}

enum hobbit_status hobbit_model_parts(const char * path, char * out, size_t out_size, char * err, size_t err_size) {
    if (path == nullptr || out == nullptr) {
        write_error(err, err_size, "hobbit_model_parts: path and out are required");
        return HOBBIT_STATUS_ERROR_INVALID;
    }
    return guarded([&] {
        std::string all;
        for (const std::string & part : expert_index::from_file(path).parts) {
            all += part;
            all += '\0';
        }
        if (all.size() > out_size) {
            throw hobbit_error(HOBBIT_STATUS_ERROR_INVALID, "the names of its files need " + std::to_string(all.size()) +
                               " bytes, the buffer has " + std::to_string(out_size));
        }
        memcpy(out, all.data(), all.size());
    }, err, err_size, std::string(path) + ": ");
}

enum hobbit_status hobbit_tokenize(const struct llama_vocab * vocab, const char * text, int32_t text_len,
                                   int32_t * tokens, int32_t n_tokens_max, bool add_special,
                                   bool parse_special, int32_t * n_tokens, char * err, size_t err_size) {
    return guarded([&] {
        *n_tokens = llama_tokenize(vocab, text, text_len, tokens, n_tokens_max, add_special, parse_special);
    }, err, err_size, "the tokenizer failed: ");
}

enum hobbit_status hobbit_request_offload(const struct hobbit_params * params, char * err, size_t err_size) {
    // checked before anything is copied or armed
    const std::string why = params == nullptr ? "params are required" : params_problem(*params);
    if (!why.empty()) {
        write_error(err, err_size, "hobbit_request_offload: " + why);
        return HOBBIT_STATUS_ERROR_INVALID;
    }
    g_pending_params = *params;
    // the caller's strings may be gone by the time the model loads
    for (int l = 0; l < HOBBIT_MAX_LEVELS; ++l) {
        // level 0 has a file only when the high precision is a companion too (a precision ladder)
        const bool has_file = l < params->n_level && params->level_paths[l] && (l > 0 || params->level_paths[l][0] != '\0');
        g_pending_level_paths[l] = has_file ? params->level_paths[l] : "";
        g_pending_params.level_paths[l] = has_file ? g_pending_level_paths[l].c_str() : nullptr;
    }
    g_pending_expert_levels.assign(params->expert_levels, params->expert_levels + params->n_expert_levels);
    g_pending_params.expert_levels = g_pending_expert_levels.empty() ? nullptr : g_pending_expert_levels.data();
    g_attach_error.clear();
    llama_moe_offload_request_next_load(&hobbit_attach, nullptr);
    return HOBBIT_STATUS_OK;
}

void hobbit_cancel_offload_request(void) {
    llama_moe_offload_request_next_load(nullptr, nullptr);
}

bool hobbit_last_attach_error(char * buf, size_t size) {
    write_error(buf, size, g_attach_error);
    return !g_attach_error.empty();
}

hobbit_runtime * hobbit_runtime_of_model(const struct llama_model * model) {
    const llama_moe_offload * off = model ? llama_model_get_moe_offload(model) : nullptr;
    return off ? (hobbit_runtime *) off->ctx : nullptr;
}

void hobbit_runtime_get_stats(const hobbit_runtime * rt, struct hobbit_stats * stats) {
    *stats = rt->stats();
}

void hobbit_runtime_reset_stats(hobbit_runtime * rt) {
    rt->reset_stats();
}

const char * hobbit_runtime_pool_device(const hobbit_runtime * rt) {
    return rt->pool_device_name();
}

bool hobbit_runtime_get_error(const hobbit_runtime * rt, char * buf, size_t size) {
    std::string msg;
    const bool failed = rt->error(msg);
    write_error(buf, size, msg);
    return failed;
}

void hobbit_runtime_clear_error(hobbit_runtime * rt) {
    rt->clear_error();
}

bool hobbit_runtime_get_pool_stats(const hobbit_runtime * rt, int32_t pool, struct hobbit_pool_stats * stats) {
    return rt != nullptr && stats != nullptr && rt->pool_stats(pool, *stats);
}

enum hobbit_status hobbit_runtime_trace_begin(hobbit_runtime * rt, int32_t lookahead, bool keep_inputs, char * err,
                                              size_t err_size) {
    if (rt == nullptr) {
        write_error(err, err_size, "hobbit_runtime_trace_begin: no runtime");
        return HOBBIT_STATUS_ERROR_INVALID;
    }
    return guarded([&] { rt->trace_begin(lookahead, keep_inputs); }, err, err_size);
}

int64_t hobbit_runtime_trace_size(const hobbit_runtime * rt, int32_t * n_moe_layer, int32_t * lookahead) {
    int n_layer = 0, depth = 0;
    const int64_t n = rt ? rt->trace_size(n_layer, depth) : 0;
    if (n_moe_layer) {
        *n_moe_layer = n_layer;
    }
    if (lookahead) {
        *lookahead = depth;
    }
    return n;
}

void hobbit_runtime_trace_copy(const hobbit_runtime * rt, int64_t n, int32_t * experts, float * weights, float * probs,
                               int32_t * predicted, float * inputs) {
    if (rt != nullptr) {
        rt->trace_copy(n, experts, weights, probs, predicted, inputs);
    }
}

void hobbit_runtime_trace_end(hobbit_runtime * rt) {
    if (rt != nullptr) {
        rt->trace_end();
    }
}

void hobbit_runtime_new_sequence(hobbit_runtime * rt) {
    if (rt != nullptr) {
        rt->new_sequence();
    }
}

enum hobbit_status hobbit_pool_plan_per_layer(int32_t n_layer, int64_t expert_bytes, int32_t n_expert_used,
                                              int32_t n_expert, int64_t budget_bytes, int32_t n_shallow,
                                              int32_t * slots, char * err, size_t err_size) {
    if (slots == nullptr || n_layer < 1 || expert_bytes < 1 || n_expert_used < 1 || n_expert_used > n_expert) {
        write_error(err, err_size, "hobbit_pool_plan_per_layer: inconsistent shape");
        return HOBBIT_STATUS_ERROR_INVALID;
    }
    const int64_t min = (int64_t) n_layer * n_expert_used * expert_bytes;
    if (budget_bytes < min) {
        write_error(err, err_size, "a budget of " + std::to_string(budget_bytes / expert_bytes) + " experts is below the " +
                    std::to_string(n_expert_used) + " a pool per layer needs in each of " + std::to_string(n_layer) +
                    " MoE layers");
        return HOBBIT_STATUS_ERROR_BUDGET;
    }
    const std::vector<int> dealt = pool_plan_deal_per_layer(std::vector<int64_t>(n_layer, expert_bytes), n_expert_used,
                                                            n_expert, budget_bytes, n_shallow);
    std::copy(dealt.begin(), dealt.end(), slots);
    return HOBBIT_STATUS_OK;
}

enum hobbit_status hobbit_simulate_cache(const struct hobbit_sim_trace * trace, const char * policy,
                                         const struct hobbit_policy_weights * weights, int32_t n_slot, uint64_t seed,
                                         double low_miss_cost, float substitute_alpha, struct hobbit_sim_result * result,
                                         char * err, size_t err_size) {
    if (trace == nullptr || policy == nullptr || result == nullptr || trace->experts == nullptr) {
        write_error(err, err_size, "hobbit_simulate_cache: trace, its experts, policy and result are required");
        return HOBBIT_STATUS_ERROR_INVALID;
    }
    if (trace->n_tokens < 0 || trace->n_layer < 1 || trace->n_expert < 1 || trace->n_expert_used < 1 ||
        trace->n_expert_used > trace->n_expert) {
        write_error(err, err_size, "hobbit_simulate_cache: inconsistent trace shape");
        return HOBBIT_STATUS_ERROR_INVALID;
    }
    if (n_slot < trace->n_expert_used) {
        write_error(err, err_size, "hobbit_simulate_cache: " + std::to_string(n_slot) + " slots cannot hold one token's " +
                    std::to_string(trace->n_expert_used) + " experts");
        return HOBBIT_STATUS_ERROR_BUDGET;
    }
    const std::string name = policy;
    const bool belady = name == "belady";
    if (!(substitute_alpha >= 0.0f && substitute_alpha <= 1.0f) || (substitute_alpha > 0.0f && (trace->scores == nullptr || belady))) {
        write_error(err, err_size, "hobbit_simulate_cache: substitute_alpha must be in [0, 1], and above 0 needs the "
                    "trace's scores and a policy other than belady");
        return HOBBIT_STATUS_ERROR_INVALID;
    }
    cache_policy_kind kind = cache_policy_kind::lru;
    if (!belady && !cache_policy_parse(name, kind)) {
        write_error(err, err_size, "unknown cache policy '" + name + "' (lru, lfu, lhu, fld, random, weighted, arc, popularity, score, frequency, belady)");
        return HOBBIT_STATUS_ERROR_INVALID;
    }
    if (!belady && kind == cache_policy_kind::popularity && trace->popularity == nullptr) {
        write_error(err, err_size, "hobbit_simulate_cache: the popularity policy needs the trace's popularity profile");
        return HOBBIT_STATUS_ERROR_INVALID;
    }
    if (!belady && kind == cache_policy_kind::score && trace->scores == nullptr) {
        write_error(err, err_size, "hobbit_simulate_cache: the score policy needs the trace's router scores");
        return HOBBIT_STATUS_ERROR_INVALID;
    }
    cache_policy_weights w;
    if (weights != nullptr) {
        w = { weights->lru, weights->lfu, weights->lhu, weights->fld };
    }
    if (trace->prefetch_layers < 0 || (trace->prefetch_layers > 0 &&
        (trace->predicted == nullptr || trace->prefetch_layers > trace->n_lookahead))) {
        write_error(err, err_size, "hobbit_simulate_cache: prefetch_layers must be 0, or at most the trace's lookahead "
                    "with its guesses given");
        return HOBBIT_STATUS_ERROR_INVALID;
    }
    cache_sim_trace tr = { trace->n_tokens, trace->n_layer, trace->n_expert, trace->n_expert_used,
                           trace->experts, trace->seq_start, trace->high_precision, trace->scores,
                           trace->popularity };
    tr.predicted       = trace->predicted;
    tr.n_lookahead     = trace->n_lookahead;
    tr.prefetch_layers = trace->prefetch_layers;
    return guarded([&] {
        const cache_sim_result r = cache_simulate(tr, n_slot, belady, kind, w, seed, low_miss_cost, substitute_alpha);
        *result = { r.accesses, r.hits, r.misses_high, r.misses_low, r.miss_penalty, r.substituted, r.prefetched,
                    r.prefetch_used };
    }, err, err_size);
}

enum hobbit_status hobbit_replay_trace(const char * model_path, const struct hobbit_params * params,
                                       const struct hobbit_replay_trace * trace, struct hobbit_stats * stats,
                                       char * err, size_t err_size) {
    const std::string why = model_path == nullptr || params == nullptr || trace == nullptr || stats == nullptr
        ? "a model, params, a trace and stats are required" : params_problem(*params);
    if (!why.empty()) {
        write_error(err, err_size, "hobbit_replay_trace: " + why);
        return HOBBIT_STATUS_ERROR_INVALID;
    }
    const cache_replay_trace tr = { trace->n_tokens, trace->n_layer, trace->n_expert, trace->n_expert_used,
                                    trace->experts, trace->weights, trace->ubatch_start, trace->seq_start };
    return guarded([&] { *stats = cache_replay(open_levels(model_path, *params), *params, tr); }, err, err_size);
}

enum hobbit_status hobbit_simulate_neurons(const struct hobbit_neuron_sim * sim, struct hobbit_neuron_sim_result * result,
                                           char * err, size_t err_size) {
    if (sim == nullptr || result == nullptr || sim->experts == nullptr || sim->n_tokens < 0 || sim->n_layer < 1 ||
        sim->n_expert < 1 || sim->n_expert_used < 1 || sim->n_neuron < 1 || sim->neuron_bytes < 1 ||
        sim->budget_bytes < 0 || !(sim->limit >= 0.0 && sim->limit <= 1.0)) {
        write_error(err, err_size, "hobbit_simulate_neurons: a trace with its experts, a shape, neuron bytes, a "
                    "budget and a limit in [0, 1] are required");
        return HOBBIT_STATUS_ERROR_INVALID;
    }
    const neuron_sim_trace tr = { sim->n_tokens, sim->n_layer, sim->n_expert, sim->n_expert_used, sim->n_neuron,
                                  sim->experts, sim->need_w1, sim->need_rest };
    return guarded([&] {
        const neuron_sim_result r = neuron_sim_cache_simulate(tr, sim->neuron_bytes, sim->budget_bytes, sim->limit);
        *result = { r.accesses, r.hits, r.whole, r.bytes_read, r.requests };
    }, err, err_size);
}

bool hobbit_abort_callback(void * rt) {
    return rt != nullptr && ((const hobbit_runtime *) rt)->failed();
}

} // extern "C"
