#include "hobbit-predictor.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <numeric>

namespace {

float dot(const float * a, const float * b, int n) {
    float acc = 0.0f;
    for (int i = 0; i < n; ++i) {
        acc += a[i] * b[i];
    }
    return acc;
}

class stacked_gate_predictor : public predictor_i {
public:
    stacked_gate_predictor(const std::vector<router_weights> & routers, int n_embd, int n_predict, int max_depth)
            : n_embd(n_embd), n_predict(n_predict) {
        const int n_router = (int) routers.size();
        for (int i = 0; i < n_router; ++i) {
            stack & s = stacks[routers[i].il];
            for (int d = 1; d <= max_depth && i + d < n_router; ++d) {
                const router_weights & next = routers[i + d];
                s.layers.push_back(next.il);
                s.n_expert.push_back((int) (next.w.size() / n_embd));
                s.w.insert(s.w.end(), next.w.begin(), next.w.end());
            }
        }
    }

    void predict(int il, const float * x, int depth, std::vector<layer_prediction> & out) override {
        const auto it = stacks.find(il);
        if (it == stacks.end() || depth <= 0) {
            return;
        }
        const stack & s = it->second;
        const int n_layer = std::min<int>(depth, (int) s.layers.size());
        int n_rows = 0;
        for (int d = 0; d < n_layer; ++d) {
            n_rows += s.n_expert[d];
        }
        // every gate of the stack in one pass over its rows
        logits.resize(n_rows);
        for (int r = 0; r < n_rows; ++r) {
            logits[r] = dot(s.w.data() + (size_t) r * n_embd, x, n_embd);
        }
        int first = 0;
        for (int d = 0; d < n_layer; ++d) {
            const int n_expert = s.n_expert[d];
            const float * l = logits.data() + first;
            layer_prediction p;
            p.il = s.layers[d];
            p.experts.resize(n_expert);
            std::iota(p.experts.begin(), p.experts.end(), 0);
            const int k = std::min(n_predict, n_expert);
            std::partial_sort(p.experts.begin(), p.experts.begin() + k, p.experts.end(),
                              [&](int a, int b) { return l[a] > l[b]; });
            p.experts.resize(k);
            // softmax over the top-k: the normalized gate weights a top-k router would give
            float total = 0.0f;
            for (int e : p.experts) {
                p.weights.push_back(std::exp(l[e] - l[p.experts[0]]));
                total += p.weights.back();
            }
            for (float & w : p.weights) {
                w /= total;
            }
            out.push_back(std::move(p));
            first += n_expert;
        }
    }

private:
    struct stack {
        std::vector<int>   layers;   // the next MoE layers, nearest first
        std::vector<int>   n_expert; // experts of each
        std::vector<float> w;        // their router rows, one after the other
    };
    std::map<int, stack> stacks;     // by the layer whose input they are applied to
    int n_embd;
    int n_predict;
    std::vector<float> logits;
};

} // namespace

std::vector<int> predicted_expert_counts(predictor_i & predictor, int il, const float * x, size_t row_stride,
                                         int n_tokens, int k, int n_expert) {
    std::vector<int> counts;
    std::vector<layer_prediction> out;
    for (int t = 0; t < n_tokens; ++t) {
        out.clear();
        predictor.predict(il, x + (size_t) t * row_stride, 1, out);
        if (out.empty()) {
            return {};
        }
        counts.resize(n_expert, 0);
        // the prediction may be widened past the router's top-k: a token's own selection is its first k
        const std::vector<int> & experts = out[0].experts;
        for (int i = 0; i < std::min<int>(k, (int) experts.size()); ++i) {
            if (experts[i] >= 0 && experts[i] < n_expert) {
                counts[experts[i]]++;
            }
        }
    }
    return counts;
}

void router_top_k(const router_weights & r, int n_embd, const float * x, int k, std::vector<int> & out) {
    const int n_expert = (int) (r.w.size() / n_embd);
    std::vector<float> logits(n_expert);
    for (int e = 0; e < n_expert; ++e) {
        logits[e] = dot(r.w.data() + (size_t) e * n_embd, x, n_embd);
    }
    out.resize(n_expert);
    std::iota(out.begin(), out.end(), 0);
    k = std::min(k, n_expert);
    std::partial_sort(out.begin(), out.begin() + k, out.end(), [&](int a, int b) { return logits[a] > logits[b]; });
    out.resize(k);
}

std::unique_ptr<predictor_i> predictor_make_stacked_gates(const std::vector<router_weights> & routers, int n_embd,
                                                          int n_predict, int max_depth) {
    return std::make_unique<stacked_gate_predictor>(routers, n_embd, n_predict, max_depth);
}
