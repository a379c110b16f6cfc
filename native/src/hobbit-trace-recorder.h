// hobbit-trace-recorder.h - records what the routers chose, token by token and layer by
// layer, for `hobbitpy trace` and the offline cache simulator.
//
// Per token and MoE layer: the selected experts, their gate weights, the router's full
// probabilities, and for 1..lookahead layers ahead the experts that layer's router picks
// on this layer's router input (what a prefetcher at this layer could know). The router
// inputs themselves (n_embd floats per token and layer, more than all the rest) are kept
// only when asked: CORM's neuron statistics are computed from them (`trace --neurons`).
#pragma once

#include "hobbit-predictor.h"

#include "ggml.h"

#include <cstdint>
#include <vector>

class trace_recorder {
public:
    // routers: every MoE layer's router in layer order (moe_layers[i] owns routers[i])
    trace_recorder(std::vector<int> moe_layers, int n_expert, int n_expert_used, int n_embd, int lookahead,
                   std::vector<router_weights> routers, bool keep_inputs);

    // one MoE layer's dispatch arguments for a ubatch (see llama_moe_offload_layer)
    void record(int il, const ggml_tensor * selected, const ggml_tensor * weights, const ggml_tensor * probs,
                const ggml_tensor * router_input);

    // tokens recorded in every MoE layer
    int64_t n_tokens() const;
    int lookahead() const { return lookahead_; }

    // copies the first n tokens: experts/weights [n][n_moe_layer][k], probs [n][n_moe_layer][n_expert],
    // predicted [n][n_moe_layer][lookahead][k] (-1 past the last layer), inputs [n][n_moe_layer][n_embd]
    // (zeros unless kept); any pointer may be NULL
    void copy(int64_t n, int32_t * experts, float * weights, float * probs, int32_t * predicted, float * inputs) const;
    bool keeps_inputs() const { return keep_inputs; }

private:
    struct layer_log {
        std::vector<int32_t> experts;   // [token][k]
        std::vector<float>   weights;   // [token][k]
        std::vector<float>   probs;     // [token][n_expert]
        std::vector<int32_t> predicted; // [token][lookahead][k]
        std::vector<float>   inputs;    // [token][n_embd], when kept
    };
    std::vector<int> moe_layers;
    std::vector<int> position;          // layer -> index in moe_layers, -1 if dense
    int n_expert, n_used, n_embd, lookahead_;
    bool keep_inputs;
    std::vector<router_weights> routers;
    std::vector<layer_log> logs;
};
