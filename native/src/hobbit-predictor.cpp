#include "hobbit-predictor.h"

#include <map>

namespace {

class previous_token_predictor : public predictor_i {
public:
    explicit previous_token_predictor(const std::vector<int> & moe_layers) {
        for (size_t i = 0; i + 1 < moe_layers.size(); ++i) {
            next_layer[moe_layers[i]] = moe_layers[i + 1];
        }
    }

    void observe(int il, const std::vector<int32_t> & selected) override {
        last[il] = selected;
    }

    void predict(int il, std::vector<std::pair<int, int>> & out) override {
        const auto nl = next_layer.find(il);
        if (nl == next_layer.end()) {
            return;
        }
        const auto it = last.find(nl->second);
        if (it == last.end()) {
            return;
        }
        for (int32_t e : it->second) {
            out.emplace_back(nl->second, e);
        }
    }

private:
    std::map<int, int> next_layer;              // MoE layer -> the MoE layer after it
    std::map<int, std::vector<int32_t>> last;   // the last selection of each layer
};

} // namespace

std::unique_ptr<predictor_i> predictor_make_previous_token(const std::vector<int> & moe_layers) {
    return std::make_unique<previous_token_predictor>(moe_layers);
}
