// hobbit-runtime-loads.cpp - The runtime's predictions for the cache's background loads: the next layers'
// predicted experts (HOBBIT's stacked gates) and a prompt's next layer whole (Fate's cross-layer prefetch); the
// bytes the pools use.

#include "hobbit-runtime.h"

#include "hobbit-error.h"
#include "hobbit-neuron-reads.h"
#include "hobbit-substitution.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cfloat>
#include <chrono>
#include <climits>
#include <cstdint>
#include <cmath>
#include <cstring>
#include <map>
#include <numeric>

void hobbit_runtime::prefetch_next_layer_whole(int il, const ggml_tensor * x, std::vector<load_task> & loads) {
    const auto it = std::find(moe_layers.begin(), moe_layers.end(), il);
    if (it == moe_layers.end() || it + 1 == moe_layers.end()) {
        return;
    }
    const int next = *(it + 1);
    const int n_expert = index.info.n_expert;
    std::vector<int> order(n_expert);
    std::iota(order.begin(), order.end(), 0);
    const bool share_low = thresholds.prefill_low_share > 0.0f;
    std::vector<bool> low(n_expert, false);
    if (predictor && (params.prefill_popular_first || share_low) && x != nullptr) {
        // Fate §4.5: the pools rarely hold a whole layer; what they hold should be what most
        // of the prompt's tokens will select, and the first loads done are the longest computations
        const std::vector<int> count = predicted_expert_counts(*predictor, il, (const float *) x->data,
                                                               x->nb[1] / sizeof(float), (int) x->ne[1],
                                                               index.info.n_expert_used, n_expert);
        if (!count.empty() && params.prefill_popular_first) {
            std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return count[a] > count[b]; });
        }
        if (!count.empty() && share_low) {
            low = least_popular_experts(count, thresholds.prefill_low_share); // loaded low, as the dispatch will want them
        }
    }
    cache->prefetch_layer_whole(next, order, low, loads);
}

void hobbit_runtime::prefetch_next_layers(int il, const float * x, std::vector<load_task> & loads) {
    std::vector<layer_prediction> predictions;
    predictor->predict(il, x, params.prefetch_layers, predictions);
    std::vector<predicted_layer> wanted;
    for (const layer_prediction & lp : predictions) {
        const int k = (int) lp.experts.size();
        std::vector<int> want(k);
        // the precision a predicted expert is fetched at comes from the same score rule, on the
        // predicted top-k; a candidate past it (a widened prediction) would enter the selection
        // last, at the level of the weakest selected
        const int k_sel = std::min(k, index.info.n_expert_used);
        precision_levels(thresholds, lp.weights.data(), k_sel, want.data());
        std::fill(want.begin() + k_sel, want.end(), want[k_sel - 1]);
        for (int i = 0; placed(lp.il) && i < k; ++i) {
            // as read_selection: a placement fixes the level, the skip rule acts only with skip_cached
            if (!(want[i] == PRECISION_SKIP && thresholds.skip_cached)) {
                want[i] = placed(lp.il)[lp.experts[i]];
            }
        }
        // with substitution, only the predicted top-score experts (importance-driven scheduling
        // §5.2): a low-score one that misses is served by a cached expert of similar score
        int n_fetch = k;
        if (params.substitute_alpha > 0.0f && k > k_sel) {
            n_fetch = 0;
            while (n_fetch < k_sel && top_score(lp.weights[n_fetch], lp.weights[k_sel], params.substitute_alpha)) {
                n_fetch++;
            }
        }
        predicted_layer pl;
        pl.il = lp.il;
        pl.experts.assign(lp.experts.begin(), lp.experts.begin() + n_fetch);
        pl.levels.assign(want.begin(), want.begin() + n_fetch);
        wanted.push_back(std::move(pl));
    }
    cache->prefetch_predicted(wanted, loads);
}

int64_t hobbit_runtime::used_pool_bytes() const {
    int64_t n = cache->used_slot_bytes();
    std::lock_guard<std::mutex> lock(mtx);
    for (const auto & rows : row_caches) {
        if (rows) {
            n += (rows->n_page() - rows->n_free()) * (int64_t) rows->page_bytes();
        }
    }
    return n;
}
