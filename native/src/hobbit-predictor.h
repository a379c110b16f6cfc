// hobbit-predictor.h - which experts the next layers will want, so they can be
// loaded while the current layer computes.
//
// One interface, one implementation per predictor (the previous token's choice here;
// HOBBIT's stacked gating and Fate's cross-layer gate plug in the same way).
#pragma once

#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

struct predictor_i {
    virtual ~predictor_i() = default;

    // the router of layer il selected these experts ([n_tokens][n_used], row-major)
    virtual void observe(int il, const std::vector<int32_t> & selected) = 0;

    // experts of later layers worth loading now, most wanted first, as (layer, expert)
    virtual void predict(int il, std::vector<std::pair<int, int>> & out) = 0;
};

// the experts that the next MoE layer selected for the previous token (temporal locality)
std::unique_ptr<predictor_i> predictor_make_previous_token(const std::vector<int> & moe_layers);
