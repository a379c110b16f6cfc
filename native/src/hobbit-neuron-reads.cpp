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

// the kernels below are plain loops the compiler vectorizes; built for any x86-64 they would use
// SSE2 alone, so they are cloned for AVX2 + FMA too and the loader picks the clone the CPU runs
// (ggml's own kernels choose at run time the same way, in the portable build)
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && defined(__linux__)
#define HOBBIT_SIMD_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define HOBBIT_SIMD_CLONES
#endif

// ggml's block_q8_0: an f16 scale, then 32 signed bytes
static constexpr int    QK    = 32;
static constexpr size_t BLOCK = sizeof(ggml_fp16_t) + QK;
static constexpr int    LANES = 8;

HOBBIT_SIMD_CLONES
void neuron_up_q8_0(const uint8_t * base, uint64_t page_bytes, const int32_t * pages, int n_embd, const float * x,
                    const float * keep, float * out, int f0, int f1) {
    const int64_t n_block = n_embd / QK;
    for (int f = f0; f < f1; ++f) {
        // a neuron left out is 0 whatever its row holds; it may not have been read
        if (keep[f] == 0.0f || pages[f] < 0) {
            out[f] = 0.0f;
            continue;
        }
        const uint8_t * row = base + (size_t) pages[f] * page_bytes;
        float sum = 0.0f;
        for (int64_t b = 0; b < n_block; ++b) {
            const uint8_t * blk = row + (size_t) b * BLOCK;
            ggml_fp16_t d16;
            memcpy(&d16, blk, sizeof(d16));
            const int8_t * q = (const int8_t *) (blk + sizeof(ggml_fp16_t));
            const float * xb = x + b * QK;
            // LANES independent sums: a float reduction in one chain does not vectorize
            float lane[LANES] = {};
            for (int i = 0; i < QK; i += LANES) {
                for (int l = 0; l < LANES; ++l) {
                    lane[l] += (float) q[i + l] * xb[i + l];
                }
            }
            float block_sum = 0.0f;
            for (int l = 0; l < LANES; ++l) {
                block_sum += lane[l];
            }
            sum += ggml_fp16_to_fp32(d16) * block_sum;
        }
        out[f] = sum;
    }
}

HOBBIT_SIMD_CLONES
void neuron_down_q8_0(const uint8_t * base, uint64_t page_bytes, const int32_t * pages, int n_ff, const float * act,
                      float * out, int64_t b0, int64_t b1) {
    memset(out + b0 * QK, 0, (size_t) (b1 - b0) * QK * sizeof(float));
    for (int f = 0; f < n_ff; ++f) {
        const float a = act[f];
        // a neuron left out is 0 (SiLU(0) times its up row); its rows may not have been read
        if (!(a > 0.0f || a < 0.0f)) {
            continue;
        }
        if (pages[f] < 0) {
            continue; // never kept, never read (the fetch reads every kept row)
        }
        const uint8_t * row = base + (size_t) pages[f] * page_bytes;
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
