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
        router_top_k(next, n_embd, x, n_predict, top);
        for (int e : top) {
            out.emplace_back(next.il, e);
        }
    }

private:
    std::vector<router_weights> routers;
    std::map<int, size_t> position; // layer -> index in routers
    int n_embd;
    int n_predict;
    std::vector<int> top;
};

} // namespace

void router_top_k(const router_weights & r, int n_embd, const float * x, int k, std::vector<int> & out) {
    const int n_expert = (int) (r.w.size() / n_embd);
    std::vector<float> logits(n_expert);
    for (int e = 0; e < n_expert; ++e) {
        const float * row = r.w.data() + (size_t) e * n_embd;
        float acc = 0.0f;
        for (int i = 0; i < n_embd; ++i) {
            acc += row[i] * x[i];
        }
        logits[e] = acc;
    }
    out.resize(n_expert);
    std::iota(out.begin(), out.end(), 0);
    k = std::min(k, n_expert);
    std::partial_sort(out.begin(), out.begin() + k, out.end(), [&](int a, int b) { return logits[a] > logits[b]; });
    out.resize(k);
}

std::unique_ptr<predictor_i> predictor_make_next_layer_gate(std::vector<router_weights> routers, int n_embd, int n_predict) {
    return std::make_unique<next_layer_gate_predictor>(std::move(routers), n_embd, n_predict);
}
