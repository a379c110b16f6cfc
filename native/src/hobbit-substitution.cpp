#include "hobbit-substitution.h"

#include <algorithm>
#include <cmath>
#include <numeric>

substitution_plan plan_substitution(const std::vector<float> & scores, const std::vector<int> & ids,
                                    const std::vector<float> & weights, float alpha,
                                    const std::function<bool(int)> & cached) {
    substitution_plan plan{ ids, weights, 0 };
    const int n_expert = (int) scores.size();
    const int k = (int) ids.size();
    if (alpha <= 0.0f || k == 0 || k >= n_expert) {
        return plan;
    }
    std::vector<bool> selected(n_expert, false);
    for (int e : ids) {
        if (e >= 0 && e < n_expert) {
            selected[e] = true;
        }
    }
    // β: the best score outside the selection (the (k+1)-th when the router picked the top k)
    float beta = -INFINITY;
    for (int e = 0; e < n_expert; ++e) {
        if (!selected[e]) {
            beta = std::max(beta, scores[e]);
        }
    }
    if (!(beta > 0.0f)) {
        return plan; // the thresholds are ratios of β: no positive score, no band
    }
    // the low-score selections that miss, lowest score first (they are replaced first)
    std::vector<int> missing; // positions in ids
    for (int j = 0; j < k; ++j) {
        const int e = ids[j];
        if (e >= 0 && e < n_expert && !top_score(scores[e], beta, alpha) && !cached(e)) {
            missing.push_back(j);
        }
    }
    std::stable_sort(missing.begin(), missing.end(), [&](int a, int b) { return scores[ids[a]] < scores[ids[b]]; });
    // the alternatives: unselected, cached, in [(1 - alpha) β, β], best first
    std::vector<int> alternatives;
    for (int e = 0; e < n_expert; ++e) {
        if (!selected[e] && scores[e] >= (1.0f - alpha) * beta && scores[e] <= beta && cached(e)) {
            alternatives.push_back(e);
        }
    }
    std::stable_sort(alternatives.begin(), alternatives.end(), [&](int a, int b) { return scores[a] > scores[b]; });
    const int n = (int) std::min(missing.size(), alternatives.size());
    if (n == 0) {
        return plan;
    }
    // how the weights relate to the scores: w = c s for one c per token; normalized when they sum to 1
    float w_sum = 0.0f, s_sum = 0.0f;
    for (int j = 0; j < k; ++j) {
        w_sum += weights[j];
        s_sum += ids[j] >= 0 && ids[j] < n_expert ? scores[ids[j]] : 0.0f;
    }
    const bool normalized = std::fabs(w_sum - 1.0f) < 1e-3f;
    const float c = s_sum > 0.0f ? w_sum / s_sum : 1.0f;
    for (int i = 0; i < n; ++i) {
        const int j = missing[i];
        plan.ids[j] = alternatives[i];
        plan.weights[j] = c * scores[alternatives[i]];
    }
    plan.n_substituted = n;
    if (normalized) {
        float total = 0.0f;
        for (int j = 0; j < k; ++j) {
            total += scores[plan.ids[j]];
        }
        for (int j = 0; j < k; ++j) {
            plan.weights[j] = scores[plan.ids[j]] / total;
        }
    }
    return plan;
}

std::vector<substitution_plan> plan_batch_substitution(const std::vector<std::vector<float>> & scores,
                                                       const std::vector<std::vector<int>> & ids,
                                                       const std::vector<std::vector<float>> & weights, float alpha,
                                                       const std::function<bool(int)> & cached) {
    const int n_expert = scores.empty() ? 0 : (int) scores[0].size();
    std::vector<int> users(n_expert, 0);  // tokens of the batch selecting each expert
    for (const std::vector<int> & token : ids) {
        for (int e : token) {
            if (e >= 0 && e < n_expert) {
                users[e]++;
            }
        }
    }
    std::vector<substitution_plan> plans;
    for (size_t t = 0; t < ids.size(); ++t) {
        const auto own = [&](int e) { return (int) std::count(ids[t].begin(), ids[t].end(), e); };
        plans.push_back(plan_substitution(scores[t], ids[t], weights[t], alpha,
                                          [&](int e) { return users[e] > own(e) || cached(e); }));
        for (size_t j = 0; j < ids[t].size(); ++j) {
            if (plans.back().ids[j] != ids[t][j]) {
                users[ids[t][j]]--;
                users[plans.back().ids[j]]++;
            }
        }
    }
    return plans;
}
