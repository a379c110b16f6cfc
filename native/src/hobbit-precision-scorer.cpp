#include "hobbit-precision-scorer.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>

void precision_scores(const float * weights, int k, float * scores) {
    std::vector<int> rank(k);
    std::iota(rank.begin(), rank.end(), 0);
    // stable: equal weights keep the router's order, so the first selected ranks first
    std::stable_sort(rank.begin(), rank.end(), [&](int a, int b) { return std::fabs(weights[a]) > std::fabs(weights[b]); });
    float total = 0.0f;
    for (int i = 0; i < k; ++i) {
        total += std::fabs(weights[i]);
    }
    float above = 0.0f;
    for (int i = 0; i < k; ++i) {
        // a router that gives every weight 0 says nothing: every expert counts as important
        scores[rank[i]] = total > 0.0f ? above / total : 0.0f;
        above += std::fabs(weights[rank[i]]);
    }
}

void precision_levels(const precision_thresholds & th, const float * weights, int k, int * levels) {
    if (th.n_level <= 1 && !th.skip_cached) {
        std::fill(levels, levels + k, 0);
        return;
    }
    std::vector<float> scores(k);
    precision_scores(weights, k, scores.data());
    for (int i = 0; i < k; ++i) {
        const float s = scores[i];
        int level;
        if (s <= th.t1 || s == 0.0f) {
            level = 0; // the first expert has score 0 and always stays high
        } else if (th.n_level == 3 && s <= th.t_mid) {
            level = 1;
        } else if (s <= th.t2) {
            level = th.n_level - 1;
        } else {
            level = PRECISION_SKIP;
        }
        levels[i] = level;
    }
}

std::vector<bool> least_popular_experts(const std::vector<int> & count, float share) {
    std::vector<bool> low(count.size(), false);
    std::vector<int> order;
    int64_t total = 0;
    for (size_t e = 0; e < count.size(); ++e) {
        if (count[e] > 0) {
            order.push_back((int) e);
            total += count[e];
        }
    }
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return count[a] < count[b]; });
    const double limit = (double) share * (double) total;
    int64_t covered = 0;
    for (int e : order) {
        if ((double) (covered + count[e]) > limit) {
            break;
        }
        covered += count[e];
        low[e] = true;
    }
    return low;
}
