// test-precision-scorer.cpp - native unit tests: HOBBIT's eq. 2 and Fate's least popular share.
#include "test-common.h"

#include "hobbit-precision-scorer.h"

// HOBBIT eq. 2 and the thresholds, by hand
void test_precision_scorer() {
    float scores[4];
    const float w[4] = { 0.1f, 0.5f, -0.3f, 0.1f }; // ranks: 1, 2, then 0 and 3 in router order
    precision_scores(w, 4, scores);
    CHECK(scores[1] == 0.0f);
    CHECK(std::fabs(scores[2] - 0.5f) < 1e-6f);
    CHECK(std::fabs(scores[0] - 0.8f) < 1e-6f);
    CHECK(std::fabs(scores[3] - 0.9f) < 1e-6f);

    int levels[4];
    precision_thresholds one;  // one level: everything high, nothing skipped
    precision_levels(one, w, 4, levels);
    CHECK(levels[0] == 0 && levels[1] == 0 && levels[2] == 0 && levels[3] == 0);

    precision_thresholds two;
    two.n_level = 2; two.t1 = 0.6f; two.t2 = 0.85f;
    precision_levels(two, w, 4, levels);
    CHECK(levels[1] == 0 && levels[2] == 0 && levels[0] == 1 && levels[3] == PRECISION_SKIP);

    precision_thresholds three;
    three.n_level = 3; three.t1 = 0.4f; three.t_mid = 0.6f; three.t2 = 0.95f;
    precision_levels(three, w, 4, levels);
    CHECK(levels[1] == 0 && levels[2] == 1 && levels[0] == 2 && levels[3] == 2);

    // t1 = 0 still keeps the first expert high; t2 = 0 skips every other one
    precision_thresholds strict;
    strict.n_level = 2; strict.t1 = 0.0f; strict.t2 = 0.0f;
    precision_levels(strict, w, 4, levels);
    CHECK(levels[1] == 0 && levels[0] == PRECISION_SKIP && levels[2] == PRECISION_SKIP && levels[3] == PRECISION_SKIP);

    const float zero[2] = { 0.0f, 0.0f };
    precision_levels(two, zero, 2, levels);
    CHECK(levels[0] == 0 && levels[1] == 0);

    // skip_cached: the skip rule acts on one level too (every kept selection at level 0)
    precision_thresholds one_skipping;
    one_skipping.t2 = 0.85f; one_skipping.skip_cached = true;
    precision_levels(one_skipping, w, 4, levels);
    CHECK(levels[1] == 0 && levels[2] == 0 && levels[0] == 0 && levels[3] == PRECISION_SKIP);

    // Fate §4.5: a prompt's least popular experts, fewest tokens first, while their tokens
    // make up at most the share: 10 selections, a fifth is 2: experts 2 and 4 (one token
    // each; ties by id), not expert 3 (3 tokens), never the unselected 0
    const std::vector<int> count = { 0, 5, 1, 3, 1 };
    CHECK((least_popular_experts(count, 0.2f) == std::vector<bool>{ false, false, true, false, true }));
    CHECK((least_popular_experts(count, 0.1f) == std::vector<bool>{ false, false, true, false, false }));
    CHECK((least_popular_experts(count, 0.0f) == std::vector<bool>(5, false)));
    CHECK((least_popular_experts(count, 1.0f) == std::vector<bool>{ false, true, true, true, true }));
    printf("ok precision scorer\n");
}
