// hobbit-predictor.h - which experts the next layers will want, so they can be
// loaded while the current layer computes.
//
// One interface, one implementation per predictor. Here: HOBBIT's stacked gating (§3.3,
// Fate's cross-layer gate): hidden states change little from one layer to the next, so
// the routers of the next p MoE layers, applied to the current layer's router input,
// name most of the experts they will pick. Their weights are stacked into one matrix per
// layer, so all p predictions cost one pass over it.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

struct router_weights {
    int il = -1;               // layer the router belongs to
    std::vector<float> w;      // [n_expert][n_embd], row-major
};

// what one later layer's router picks on the current input
struct layer_prediction {
    int il = -1;
    std::vector<int>   experts; // its top-k, best first
    std::vector<float> weights; // their softmax gate values over the top-k (what eq. 2 scores)
};

struct predictor_i {
    virtual ~predictor_i() = default;

    // x: the router input of layer il for one token ([n_embd] floats); out: predictions
    // for the next min(depth, max_depth) MoE layers, nearest first
    virtual void predict(int il, const float * x, int depth, std::vector<layer_prediction> & out) = 0;
};

// the k experts router r ranks highest on input x ([n_embd] floats), best first; the
// gate (softmax or sigmoid) is monotonic in the logits, so the top logits are the top experts
void router_top_k(const router_weights & r, int n_embd, const float * x, int k, std::vector<int> & out);

// Fate §4.5: how many of a wide ubatch's tokens the MoE layer after il is predicted to route
// to each of its n_expert experts (the top k of its router on each token's input to il). x:
// n_tokens rows of n_embd floats, row_stride floats apart. Empty when nothing is predicted
// from il (the last MoE layer).
std::vector<int> predicted_expert_counts(predictor_i & predictor, int il, const float * x, size_t row_stride,
                                         int n_tokens, int k, int n_expert);

// routers: the router of every MoE layer in layer order; predicts the top n_predict
// experts of up to max_depth next MoE layers
std::unique_ptr<predictor_i> predictor_make_stacked_gates(const std::vector<router_weights> & routers, int n_embd,
                                                          int n_predict, int max_depth);
