// hobbit-runtime-loads.cpp - The runtime's predictions for the cache's background loads: the next layers'
// predicted experts (HOBBIT's stacked gates) and a prompt's next layer whole (Fate's cross-layer prefetch); the
// bytes the pools use; a prompt's next layer read ahead where it computes in place.

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

// a wide ubatch (prefill) needs nearly every expert of the next MoE layer: the cache loads them at
// high precision while this layer computes, those most of its tokens are predicted to use
// first (x: this layer's router input, or nullptr: in expert order)
void hobbit_runtime::prefetch_next_layer_whole(int il, const ggml_tensor * x, std::vector<load_task> & loads) {
    const auto it = std::find(plan.moe_layers.begin(), plan.moe_layers.end(), il);
    if (it == plan.moe_layers.end() || it + 1 == plan.moe_layers.end()) {
        return;
    }
    const int next = *(it + 1);
    const int n_expert = levels.index.info.n_expert;
    std::vector<int> order(n_expert);
    std::iota(order.begin(), order.end(), 0);
    const bool share_low = plan.thresholds.prefill_low_share > 0.0f;
    std::vector<bool> low(n_expert, false);
    if (predictor && (params.prefill_popular_first || share_low) && x != nullptr) {
        // Fate §4.5: the pools rarely hold a whole layer; what they hold should be what most
        // of the prompt's tokens will select, and the first loads done are the longest computations
        const std::vector<int> count = predicted_expert_counts(*predictor, il, (const float *) x->data,
                                                               x->nb[1] / sizeof(float), (int) x->ne[1],
                                                               levels.index.info.n_expert_used, n_expert);
        if (!count.empty() && params.prefill_popular_first) {
            std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return count[a] > count[b]; });
        }
        if (!count.empty() && share_low) {
            low = least_popular_experts(count, plan.thresholds.prefill_low_share); // loaded low, as the dispatch will want them
        }
    }
    cache->prefetch_layer_whole(next, order, low, loads);
}

// HOBBIT's adaptive prefetch (§3.3) from layer il's router input x: the next layers' predicted
// experts at the level the score rule gives them, for the cache to load
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
        const int k_sel = std::min(k, levels.index.info.n_expert_used);
        precision_levels(plan.thresholds, lp.weights.data(), k_sel, want.data());
        std::fill(want.begin() + k_sel, want.end(), want[k_sel - 1]);
        for (int i = 0; plan.placed(lp.il) && i < k; ++i) {
            // as read_selection: a placement fixes the level, the skip rule acts only with skip_cached
            if (!(want[i] == PRECISION_SKIP && plan.thresholds.skip_cached)) {
                want[i] = plan.placed(lp.il)[lp.experts[i]];
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

// a wide ubatch computing in place: the next MoE layer's experts are read into the page
// cache (readahead, asynchronous) while this layer computes, if there is room
void hobbit_runtime::read_ahead_next_layer(int il) {
    const auto it = std::find(plan.moe_layers.begin(), plan.moe_layers.end(), il);
    if (it == plan.moe_layers.end() || it + 1 == plan.moe_layers.end()) {
        return;
    }
    const int next = *(it + 1);
    // the page cache holds this layer's experts while they compute: only with room for both
    const int64_t layer_bytes = (int64_t) levels.index.layers[next].n_bytes() * levels.index.info.n_expert;
    const int64_t room = page_cache_room();
    if (room >= 0 && (int64_t) levels.index.layers[il].n_bytes() * levels.index.info.n_expert + layer_bytes > room) {
        return;
    }
    files.read_ahead_layer(next);
}


int64_t hobbit_runtime::used_pool_bytes() const {
    int64_t n = cache->used_slot_bytes();
    std::lock_guard<std::mutex> lock(mtx);
    for (const auto & rows : neurons.caches) {
        if (rows) {
            n += (rows->n_page() - rows->n_free()) * (int64_t) rows->page_bytes();
        }
    }
    return n;
}
