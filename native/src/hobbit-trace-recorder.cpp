#include "hobbit-trace-recorder.h"

#include <algorithm>
#include <cstring>

trace_recorder::trace_recorder(std::vector<int> moe_layers_, int n_expert, int n_expert_used, int n_embd, int lookahead,
                               std::vector<router_weights> routers_, bool keep_inputs)
        : moe_layers(std::move(moe_layers_)), n_expert(n_expert), n_used(n_expert_used), n_embd(n_embd),
          lookahead_(lookahead), keep_inputs(keep_inputs), routers(std::move(routers_)), logs(moe_layers.size()) {
    position.assign(moe_layers.empty() ? 0 : moe_layers.back() + 1, -1);
    for (size_t i = 0; i < moe_layers.size(); ++i) {
        position[moe_layers[i]] = (int) i;
    }
    if (routers.size() != moe_layers.size()) {
        lookahead_ = 0; // a router is missing (cannot happen for supported archs): record no predictions
    }
}

// element (i0, i1) of a 2-d view, whatever its strides
template <typename T>
static T at(const ggml_tensor * t, int64_t i0, int64_t i1) {
    return *(const T *) ((const char *) t->data + i0*t->nb[0] + i1*t->nb[1]);
}

void trace_recorder::record(int il, const ggml_tensor * sel, const ggml_tensor * weights, const ggml_tensor * probs,
                            const ggml_tensor * x) {
    if (il < 0 || il >= (int) position.size() || position[il] < 0) {
        return;
    }
    const int pos = position[il];
    layer_log & log = logs[pos];
    const int64_t n_tokens = sel->ne[1];
    std::vector<int> top;
    for (int64_t t = 0; t < n_tokens; ++t) {
        for (int k = 0; k < n_used; ++k) {
            log.experts.push_back(at<int32_t>(sel, k, t));
            // weights are [1, n_used, n_tokens]
            log.weights.push_back(*(const float *) ((const char *) weights->data + k*weights->nb[1] + t*weights->nb[2]));
        }
        for (int e = 0; e < n_expert; ++e) {
            log.probs.push_back(*(const float *) ((const char *) probs->data + e*probs->nb[1] + t*probs->nb[2]));
        }
        const float * xt = (const float *) ((const char *) x->data + t*x->nb[1]);
        if (keep_inputs) {
            log.inputs.insert(log.inputs.end(), xt, xt + n_embd);
        }
        for (int d = 1; d <= lookahead_; ++d) {
            if (pos + d >= (int) routers.size()) {
                log.predicted.insert(log.predicted.end(), n_used, -1);
                continue;
            }
            router_top_k(routers[pos + d], n_embd, xt, n_used, top);
            log.predicted.insert(log.predicted.end(), top.begin(), top.end());
        }
    }
}

int64_t trace_recorder::n_tokens() const {
    int64_t n = INT64_MAX;
    for (const layer_log & log : logs) {
        n = std::min<int64_t>(n, (int64_t) log.experts.size() / n_used);
    }
    return logs.empty() ? 0 : n;
}

void trace_recorder::copy(int64_t n, int32_t * experts, float * weights, float * probs, int32_t * predicted,
                          float * inputs) const {
    const int64_t L = (int64_t) logs.size();
    for (int64_t t = 0; t < n; ++t) {
        for (int64_t l = 0; l < L; ++l) {
            const layer_log & log = logs[l];
            if (experts) {
                memcpy(experts + (t*L + l)*n_used, log.experts.data() + t*n_used, n_used * sizeof(int32_t));
            }
            if (weights) {
                memcpy(weights + (t*L + l)*n_used, log.weights.data() + t*n_used, n_used * sizeof(float));
            }
            if (probs) {
                memcpy(probs + (t*L + l)*n_expert, log.probs.data() + t*n_expert, n_expert * sizeof(float));
            }
            if (predicted && lookahead_ > 0) {
                const int64_t w = (int64_t) lookahead_ * n_used;
                memcpy(predicted + (t*L + l)*w, log.predicted.data() + t*w, w * sizeof(int32_t));
            }
            if (inputs) {
                float * row = inputs + (t*L + l)*n_embd;
                if (keep_inputs) {
                    memcpy(row, log.inputs.data() + t*n_embd, n_embd * sizeof(float));
                } else {
                    std::fill(row, row + n_embd, 0.0f);
                }
            }
        }
    }
}
