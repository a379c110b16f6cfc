// hobbit-precision-scorer.h - HOBBIT's token-level dynamic loading (§3.2): at which
// precision a selected expert is worth serving, from the router's weights alone.
//
// The k experts one token selects are ranked by |gate weight|, normalized to sum 1. The
// unimportance score of the i-th is the sum of the weights ranked above it (eq. 2): 0 for
// the first, close to 1 for an expert that adds little. A score <= t1 wants the high
// precision (level 0), <= t_mid the middle one (three levels only), <= t2 the lowest;
// above t2 a missed expert is skipped (skip_cached: a cached one too, with any number of
// levels). The first expert is always high.
//
// A prompt's experts are weighed by how many of its tokens select them instead (Fate §4.5,
// popularity-aware hybrid quantization): the least popular, whose tokens together make up at
// most prefill_low_share of the selections, are served at the lowest level.
#pragma once

#include <vector>

constexpr int PRECISION_SKIP = -1;

struct precision_thresholds {
    int   n_level = 1;    // 1: one precision, every selection level 0, nothing skipped
    float t1      = 0.6f;
    float t_mid   = 0.75f;
    float t2      = 0.9f;
    float prefill_low_share = 0.0f; // a prompt's least popular experts covering at most this share of its
                                    // selections want the lowest level; 0 = the thresholds decide alone
    bool  skip_cached = false;      // above t2 skipped whether cached or not: where every expert is resident
                                    // (a placement, a budget that holds them all) compute is what a token
                                    // costs, and a skip saves it; the thresholds then act on one level too
};

// wanted level (0 = high .. n_level-1, or PRECISION_SKIP) of each of one token's k
// selections, given their gate weights (any sign or scale); levels[i] belongs to weights[i]
void precision_levels(const precision_thresholds & th, const float * weights, int k, int * levels);

// the unimportance score (eq. 2) of each of one token's k selections
void precision_scores(const float * weights, int k, float * scores);

// Fate §4.5: of one prompt ubatch's experts (count[e] = its tokens that selected expert e),
// the least popular, fewest tokens first (ties: lower id first), taken while their tokens
// together are at most `share` of all the selections: true for those. Unselected experts
// (count 0) are never marked.
std::vector<bool> least_popular_experts(const std::vector<int> & count, float share);
