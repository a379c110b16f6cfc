#include "hobbit-neuron-reads.h"

#include "ggml.h"

#include <cmath>
#include <cstring>

bool neuron_keep(const float * g, int n_ff, float theta, float limit, neuron_bits & keep) {
    keep = neuron_bits(n_ff);
    int n = 0;
    for (int i = 0; i < n_ff; ++i) {
        const float silu = g[i] / (1.0f + expf(-g[i]));
        if (std::fabs(silu) >= theta) {
            keep.set(i);
            n++;
        }
    }
    // the graph's rule (patch 0007): a share kept above the limit runs whole
    if ((float) n / n_ff >= limit + 1e-6f) {
        keep = neuron_bits(n_ff, true);
        return true;
    }
    return false;
}

void neuron_ranges(const neuron_bits & rows, int proj, uint64_t row_bytes, std::vector<load_range> & out) {
    for (int i = 0; i < rows.size();) {
        if (!rows.test(i)) {
            ++i;
            continue;
        }
        int j = i;
        while (j < rows.size() && rows.test(j)) {
            ++j;
        }
        out.push_back({ proj, (uint64_t) i * row_bytes, (uint64_t) j * row_bytes });
        i = j;
    }
}

void neuron_down_q8_0(const void * w, uint64_t row_stride, int n_ff, const float * act, float * out,
                      int64_t b0, int64_t b1) {
    // ggml's block_q8_0: an f16 scale, then 32 signed bytes
    constexpr int QK = 32;
    constexpr size_t BLOCK = sizeof(ggml_fp16_t) + QK;
    memset(out + b0 * QK, 0, (size_t) (b1 - b0) * QK * sizeof(float));
    for (int f = 0; f < n_ff; ++f) {
        const float a = act[f];
        // a neuron left out is 0 (SiLU(0) times its up row); its rows may not have been read
        if (!(a > 0.0f || a < 0.0f)) {
            continue;
        }
        const uint8_t * row = (const uint8_t *) w + (size_t) f * row_stride;
        for (int64_t b = b0; b < b1; ++b) {
            const uint8_t * blk = row + (size_t) b * BLOCK;
            ggml_fp16_t d16;
            memcpy(&d16, blk, sizeof(d16));
            const float s = a * ggml_fp16_to_fp32(d16);
            const int8_t * q = (const int8_t *) (blk + sizeof(ggml_fp16_t));
            float * o = out + b * QK;
            for (int i = 0; i < QK; ++i) {
                o[i] += s * (float) q[i];
            }
        }
    }
}
