// test-substitution.cpp - native unit tests: importance-driven substitution.
#include "test-common.h"

#include "hobbit-cache-sim.h"
#include "hobbit-substitution.h"

// importance-driven substitution (Algorithm 1): a low-score selection that misses is replaced
// by the best cached unselected expert within (1 - alpha) of β, the (k+1)-th score
void test_substitution() {
    // scores of 6 experts; the router picked 0 (0.40) and 1 (0.21); β = 0.20 (expert 2)
    const std::vector<float> scores = { 0.40f, 0.21f, 0.20f, 0.15f, 0.13f, 0.11f };
    const std::vector<int> ids = { 0, 1 };
    const std::vector<float> normalized = { 0.40f / 0.61f, 0.21f / 0.61f };
    auto cached = [](std::initializer_list<int> es) {
        return [es](int e) { return std::find(es.begin(), es.end(), e) != es.end(); };
    };
    // alpha 0.3: top-score from 0.26 (expert 0 kept even though missing), expert 1 low-score;
    // alternatives in [0.14, 0.20]: 2 and 3 when cached, the best (2) taken
    substitution_plan p = plan_substitution(scores, ids, normalized, 0.3f, cached({ 2, 3 }));
    CHECK(p.n_substituted == 1 && p.ids == std::vector<int>({ 0, 2 }));
    CHECK(std::fabs(p.weights[0] - 0.40f / 0.60f) < 1e-6f && std::fabs(p.weights[1] - 0.20f / 0.60f) < 1e-6f);
    // only expert 4 cached: 0.13 is below (1 - 0.3) β = 0.14, nothing to substitute with
    p = plan_substitution(scores, ids, normalized, 0.3f, cached({ 4 }));
    CHECK(p.n_substituted == 0 && p.ids == ids && p.weights == normalized);
    // the low-score selection is cached: kept
    p = plan_substitution(scores, ids, normalized, 0.3f, cached({ 1, 2 }));
    CHECK(p.n_substituted == 0 && p.ids == ids);
    // raw scores as weights (not normalized): the substitute gets its own score, the others stay
    const std::vector<float> raw = { 0.40f, 0.21f };
    p = plan_substitution(scores, ids, raw, 0.3f, cached({ 3 }));
    CHECK(p.n_substituted == 1 && p.ids == std::vector<int>({ 0, 3 }));
    CHECK(p.weights[0] == 0.40f && std::fabs(p.weights[1] - 0.15f) < 1e-6f);
    // alpha 1.5: both are low-score (below 0.50); two misses, one alternative: the lower (1) replaced
    p = plan_substitution(scores, ids, normalized, 1.5f, cached({ 5 }));
    CHECK(p.n_substituted == 1 && p.ids == std::vector<int>({ 0, 5 }));
    // alpha 0: off
    p = plan_substitution(scores, ids, normalized, 0.0f, cached({ 2, 3 }));
    CHECK(p.n_substituted == 0 && p.ids == ids);
    // the simulator replays it against its cache: token 1's low-score pick (expert 1, 0.50 <
    // 1.3 x 0.45) misses, and expert 0 (0.45, cached) serves it instead
    const int32_t experts[2] = { 0, 1 };
    const float trace_scores[8] = { 0.5f, 0.3f, 0.1f, 0.1f,  0.45f, 0.5f, 0.03f, 0.02f };
    cache_sim_trace tr = { 2, 1, 4, 1, experts, nullptr, nullptr, trace_scores };
    const cache_sim_result plain = cache_simulate(tr, 1, false, cache_policy_kind::lru, {}, 0, 1.0);
    const cache_sim_result subst = cache_simulate(tr, 1, false, cache_policy_kind::lru, {}, 0, 1.0, 0.3f);
    CHECK(plain.misses_high == 2 && plain.hits == 0 && plain.substituted == 0);
    CHECK(subst.misses_high == 1 && subst.hits == 1 && subst.substituted == 1);
    // a batch of two tokens, nothing cached: token 0 picks 0 and 1; token 1 picks 0 and 3, whose
    // 3 is low-score (0.20 < 1.3 x 0.19) and in band of expert 1 (0.19), which token 0 reads
    // anyway: served by 1. Alone, token 1 keeps 3 (nothing cached to take instead)
    const std::vector<std::vector<float>> batch_scores = { { 0.40f, 0.30f, 0.10f, 0.10f, 0.05f, 0.05f },
                                                           { 0.40f, 0.19f, 0.05f, 0.20f, 0.08f, 0.08f } };
    const std::vector<std::vector<int>> batch_ids = { { 0, 1 }, { 0, 3 } };
    const std::vector<std::vector<float>> batch_weights = { { 0.4f / 0.7f, 0.3f / 0.7f }, { 0.4f / 0.6f, 0.2f / 0.6f } };
    const std::vector<substitution_plan> bp = plan_batch_substitution(batch_scores, batch_ids, batch_weights, 0.3f, cached({}));
    CHECK(bp.size() == 2 && bp[0].n_substituted == 0 && bp[1].n_substituted == 1);
    CHECK(bp[1].ids == std::vector<int>({ 0, 1 }) && std::fabs(bp[1].weights[1] - 0.19f / 0.59f) < 1e-6f);
    CHECK(plan_substitution(batch_scores[1], batch_ids[1], batch_weights[1], 0.3f, cached({})).n_substituted == 0);
    // a token's own low-score selection that another token reads anyway is kept (expert 1 here)
    const std::vector<std::vector<int>> both_one = { { 0, 1 }, { 0, 1 } };
    const std::vector<std::vector<float>> both_scores = { batch_scores[0], { 0.40f, 0.20f, 0.05f, 0.19f, 0.08f, 0.08f } };
    const std::vector<substitution_plan> kept = plan_batch_substitution(both_scores, both_one, batch_weights, 0.3f, cached({}));
    CHECK(kept[1].n_substituted == 0 && kept[1].ids == std::vector<int>({ 0, 1 }));
    printf("ok substitution\n");
}
