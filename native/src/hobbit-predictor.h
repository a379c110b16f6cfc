// hobbit-predictor.h - which experts the next layers will want, so they can be
// loaded while the current layer computes.
//
// One interface, one implementation per predictor. Here: the next MoE layer's router
// applied to the current layer's router input (HOBBIT §3.3 with depth 1, Fate's
// cross-layer gate): hidden states change little from one layer to the next, so the
// next router on the current input names most of the experts it will pick.
#pragma once

#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

struct predictor_i {
    virtual ~predictor_i() = default;

    // x: the router input of layer il for one token ([n_embd] floats); appends the
    // experts of later layers worth loading now, most wanted first, as (layer, expert)
    virtual void predict(int il, const float * x, std::vector<std::pair<int, int>> & out) = 0;
};

struct router_weights {
    int il = -1;               // layer the router belongs to
    std::vector<float> w;      // [n_expert][n_embd], row-major
};

// the k experts router r ranks highest on input x ([n_embd] floats), best first; the
// gate (softmax or sigmoid) is monotonic in the logits, so the top logits are the top experts
void router_top_k(const router_weights & r, int n_embd, const float * x, int k, std::vector<int> & out);

// routers: the router of every MoE layer in layer order; predicts the top n_predict
// experts of the next MoE layer
std::unique_ptr<predictor_i> predictor_make_next_layer_gate(std::vector<router_weights> routers, int n_embd, int n_predict);
