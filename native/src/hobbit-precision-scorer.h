// hobbit-precision-scorer.h - HOBBIT's token-level dynamic loading (§3.2): at which
// precision a selected expert is worth serving, from the router's weights alone.
//
// The k experts one token selects are ranked by |gate weight|, normalized to sum 1. The
// unimportance score of the i-th is the sum of the weights ranked above it (eq. 2): 0 for
// the first, close to 1 for an expert that adds little. A score <= t1 wants the high
// precision (level 0), <= t_mid the middle one (three levels only), <= t2 the lowest;
// above t2 a missed expert is skipped. The first expert is always high.
#pragma once

#include <vector>

constexpr int PRECISION_SKIP = -1;

struct precision_thresholds {
    int   n_level = 1;    // 1: one precision, every selection level 0, nothing skipped
    float t1      = 0.6f;
    float t_mid   = 0.75f;
    float t2      = 0.9f;
};

// wanted level (0 = high .. n_level-1, or PRECISION_SKIP) of each of one token's k
// selections, given their gate weights (any sign or scale); levels[i] belongs to weights[i]
void precision_levels(const precision_thresholds & th, const float * weights, int k, int * levels);

// the unimportance score (eq. 2) of each of one token's k selections
void precision_scores(const float * weights, int k, float * scores);
