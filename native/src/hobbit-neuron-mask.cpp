// CORM's sparse neurons, priced before they are built: a graph evaluation callback
// (llama_context_params.cb_eval) of a stock context that, after each routed expert's gate
// projection (the MUL_MAT_ID on "blk.N.ffn_gate_exps.weight"), zeroes the pre-activation of
// every neuron CORM would not load. SiLU(0) = 0, so such a neuron adds exactly nothing to the
// down projection, as if its rows and column had been skipped: the logits are those of
// CORM's sparse compute, and `hobbitpy eval --neurons` prices them against stock.
//
// Which neurons: |SiLU(W1 x)| > theta, with x the layer's own input (oracle: a perfect
// predictor) or, as CORM predicts one layer ahead, the same token's input to the previous
// MoE layer (predicted). The first MoE layer has nothing before it: it is computed whole. A
// selection whose predicted share exceeds the limit loads the whole expert (CORM §3.6).

#include "hobbit.h"

#include "ggml.h"
#include "ggml-backend.h"

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <vector>

struct hobbit_neuron_mask {
    float theta     = 0.0f;
    bool  predicted = false;
    float limit     = 1.0f;

    std::map<int, std::vector<float>> w1;  // layer -> W1 dequantized [n_expert][n_ff][n_embd] (predicted only)
    std::vector<float> prev_x;             // the previous MoE layer's input [n_tokens][n_embd]
    int     prev_layer  = -1;
    int64_t prev_tokens = 0;

    int64_t n_selections = 0;  // selections seen
    int64_t n_whole      = 0;  // ... computed whole (first MoE layer, over the limit, no prediction)
    double  kept         = 0;  // sum over selections of the share of neurons kept
    bool    failed       = false;  // an allocation failed: nothing masked from then on
    std::mutex mutex;
};

static float silu(float z) {
    return z / (1.0f + std::exp(-z));
}

// the layer of "blk.N.ffn_gate_exps.weight", or -1
static int gate_layer(const ggml_tensor * w) {
    const char * name = w->name;
    if (std::strncmp(name, "blk.", 4) != 0 || std::strstr(name, ".ffn_gate_exps.weight") == nullptr) {
        return -1;
    }
    return std::atoi(name + 4);
}

extern "C" hobbit_neuron_mask * hobbit_neuron_mask_new(float theta, bool predicted, float limit) {
    try {
        auto * m = new hobbit_neuron_mask();
        m->theta = theta;
        m->predicted = predicted;
        m->limit = limit;
        return m;
    } catch (...) {
        return nullptr;
    }
}

extern "C" void hobbit_neuron_mask_free(hobbit_neuron_mask * m) {
    delete m;
}

static const std::vector<float> & dequantized(hobbit_neuron_mask * m, int il, const ggml_tensor * w) {
    std::vector<float> & out = m->w1[il];
    if (out.empty()) {
        const int64_t n_row = w->ne[1] * w->ne[2];
        out.resize((size_t) n_row * w->ne[0]);
        const auto * traits = ggml_get_type_traits(w->type);
        std::vector<uint8_t> host;
        const char * data = (const char *) w->data;
        if (!ggml_backend_buffer_is_host(w->buffer)) {
            host.resize(ggml_nbytes(w));
            ggml_backend_tensor_get(w, host.data(), 0, host.size());
            data = (const char *) host.data();
        }
        for (int64_t r = 0; r < n_row; ++r) {
            const char * row = data + (r % w->ne[1]) * w->nb[1] + (r / w->ne[1]) * w->nb[2];
            if (w->type == GGML_TYPE_F32) {
                std::memcpy(out.data() + r * w->ne[0], row, w->ne[0] * sizeof(float));
            } else {
                traits->to_float(row, out.data() + r * w->ne[0], w->ne[0]);
            }
        }
    }
    return out;
}

static void mask_gate_output(hobbit_neuron_mask * m, ggml_tensor * t, int il);

extern "C" bool hobbit_neuron_mask_apply(struct ggml_tensor * t, bool ask, void * user_data) {
    auto * m = static_cast<hobbit_neuron_mask *>(user_data);
    const bool gate = t->op == GGML_OP_MUL_MAT_ID && gate_layer(t->src[0]) >= 0;
    if (ask || !gate) {
        return gate;
    }
    const ggml_tensor * w   = t->src[0];  // [n_embd, n_ff, n_expert]
    const ggml_tensor * x   = t->src[1];  // [n_embd, 1 or n_used, n_tokens], f32
    const ggml_tensor * ids = t->src[2];  // [n_used, n_tokens], i32
    std::lock_guard<std::mutex> lock(m->mutex);
    if (t->type != GGML_TYPE_F32 || x->type != GGML_TYPE_F32 || !ggml_backend_buffer_is_host(t->buffer) ||
        !ggml_backend_buffer_is_host(x->buffer) || t->ne[0] != w->ne[1] || t->ne[2] != ids->ne[1]) {
        m->failed = true;  // a layout this callback does not know: priced as nothing, which must not pass for a price
    }
    if (m->failed) {
        return true;
    }
    try {
        mask_gate_output(m, t, gate_layer(w));
    } catch (...) {
        m->failed = true;  // no exception may cross into ggml's C: the run goes on whole, and says so
    }
    return true;
}

// the body of hobbit_neuron_mask_apply for one gate projection's output (the mutex held)
static void mask_gate_output(hobbit_neuron_mask * m, ggml_tensor * t, int il) {
    const ggml_tensor * w   = t->src[0];
    const ggml_tensor * x   = t->src[1];
    const ggml_tensor * ids = t->src[2];
    const int64_t n_embd = w->ne[0], n_ff = w->ne[1], n_used = ids->ne[0], n_tokens = ids->ne[1];
    std::vector<int32_t> id((size_t) n_used * n_tokens);
    for (int64_t tok = 0; tok < n_tokens; ++tok) {
        for (int64_t k = 0; k < n_used; ++k) {
            id[tok * n_used + k] = *(const int32_t *) ((const char *) ids->data + k * ids->nb[0] + tok * ids->nb[1]);
        }
    }
    // the previous MoE layer's input of the same tokens, when this graph had one
    const bool have_prev = m->prev_layer >= 0 && m->prev_layer < il && m->prev_tokens == n_tokens;
    std::vector<float> guess(n_ff);
    for (int64_t tok = 0; tok < n_tokens; ++tok) {
        for (int64_t k = 0; k < n_used; ++k) {
            const int32_t e = id[tok * n_used + k];
            if (e < 0 || e >= w->ne[2]) {
                continue;
            }
            float * z = (float *) ((char *) t->data + k * t->nb[1] + tok * t->nb[2]);
            m->n_selections++;
            if (m->predicted && !have_prev) {
                m->n_whole++;
                m->kept += 1.0;
                continue;
            }
            if (m->predicted) {
                const float * xp = m->prev_x.data() + tok * n_embd;
                const float * rows = dequantized(m, il, w).data() + (size_t) e * n_ff * n_embd;
                for (int64_t i = 0; i < n_ff; ++i) {
                    float dot = 0.0f;
                    for (int64_t j = 0; j < n_embd; ++j) {
                        dot += rows[i * n_embd + j] * xp[j];
                    }
                    guess[i] = dot;
                }
            } else {
                std::memcpy(guess.data(), z, n_ff * sizeof(float));
            }
            int64_t n_keep = 0;
            for (int64_t i = 0; i < n_ff; ++i) {
                n_keep += std::fabs(silu(guess[i])) > m->theta;
            }
            if ((double) n_keep / n_ff > m->limit) {
                m->n_whole++;
                m->kept += 1.0;
                continue;  // CORM loads the whole expert
            }
            for (int64_t i = 0; i < n_ff; ++i) {
                if (!(std::fabs(silu(guess[i])) > m->theta)) {
                    z[i] = 0.0f;
                }
            }
            m->kept += (double) n_keep / n_ff;
        }
    }
    if (m->predicted) {  // this layer's input predicts the next MoE layer
        m->prev_x.resize((size_t) n_tokens * n_embd);
        for (int64_t tok = 0; tok < n_tokens; ++tok) {
            std::memcpy(m->prev_x.data() + tok * n_embd, (const char *) x->data + tok * x->nb[2], n_embd * sizeof(float));
        }
        m->prev_layer = il;
        m->prev_tokens = n_tokens;
    }
}

extern "C" bool hobbit_neuron_mask_stats(hobbit_neuron_mask * m, int64_t * n_selections, int64_t * n_whole,
                                         double * kept_share) {
    std::lock_guard<std::mutex> lock(m->mutex);
    if (n_selections) *n_selections = m->n_selections;
    if (n_whole) *n_whole = m->n_whole;
    if (kept_share) *kept_share = m->n_selections > 0 ? m->kept / m->n_selections : 0.0;
    return !m->failed;
}
