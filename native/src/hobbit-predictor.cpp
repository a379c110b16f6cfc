#include "hobbit-predictor.h"

#include <algorithm>
#include <map>
#include <numeric>

namespace {

class next_layer_gate_predictor : public predictor_i {
public:
    next_layer_gate_predictor(std::vector<router_weights> routers, int n_embd, int n_predict)
            : routers(std::move(routers)), n_embd(n_embd), n_predict(n_predict) {
        for (size_t i = 0; i < this->routers.size(); ++i) {
            position[this->routers[i].il] = i;
        }
    }

    void predict(int il, const float * x, std::vector<std::pair<int, int>> & out) override {
        const auto pos = position.find(il);
        if (pos == position.end() || pos->second + 1 >= routers.size()) {
            return;
        }
        const router_weights & next = routers[pos->second + 1];
        const int n_expert = (int) (next.w.size() / n_embd);

        // gating is monotonic in the logits (softmax or sigmoid), so the top logits
        // are the top experts
        std::vector<float> logits(n_expert);
        for (int e = 0; e < n_expert; ++e) {
            const float * row = next.w.data() + (size_t) e * n_embd;
            float acc = 0.0f;
            for (int i = 0; i < n_embd; ++i) {
                acc += row[i] * x[i];
            }
            logits[e] = acc;
        }
        std::vector<int> order(n_expert);
        std::iota(order.begin(), order.end(), 0);
        const int k = std::min(n_predict, n_expert);
        std::partial_sort(order.begin(), order.begin() + k, order.end(), [&](int a, int b) { return logits[a] > logits[b]; });
        for (int i = 0; i < k; ++i) {
            out.emplace_back(next.il, order[i]);
        }
    }

private:
    std::vector<router_weights> routers;
    std::map<int, size_t> position; // layer -> index in routers
    int n_embd;
    int n_predict;
};

} // namespace

std::unique_ptr<predictor_i> predictor_make_next_layer_gate(std::vector<router_weights> routers, int n_embd, int n_predict) {
    return std::make_unique<next_layer_gate_predictor>(std::move(routers), n_embd, n_predict);
}
