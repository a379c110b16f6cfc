// Q2_K quantization, byte for byte ggml's reference quantizer (quantize_row_q2_K_ref in
// ggml-quants.c: what ggml_quantize_chunk runs for Q2_K without an importance matrix), made
// fast enough to prepare a real-size model's low-precision copy in minutes.
//
// ggml searches 16 trial scales for each 16-value sub-block one sub-block at a time, in
// scalar code: about 10-20 M values/s per core here, 25 minutes for a 30B MoE's experts on
// two cores. The same search done for the 16 sub-blocks of a 256-value super-block at once,
// one sub-block per vector lane, is the same arithmetic in the same order per sub-block, so
// every block comes out identical (tests/files/test_prepare.py compares them), and the compiler
// turns each step into a few vector instructions: 8 sub-blocks a register with AVX2, 4 with
// SSE2 or NEON. The file is built with -ffp-contract=off (native/CMakeLists.txt): ggml-base's
// portable x86-64 build fuses no multiply-add, and a fused one rounds differently. (Where
// ggml-base's compiler does fuse them, as GCC's default on aarch64 may, a block can differ
// from ggml's in the last bit of a scale: the same search, as good a fit; not checked there.)
#include "hobbit.h"

#include "ggml.h"

#include <cstdint>
#include <cstring>

namespace {

constexpr int QK_K = 256;
constexpr int SUB = 16;             // values in a Q2_K sub-block
constexpr int LANES = QK_K / SUB;   // sub-blocks in a super-block: one per lane

struct block_q2_K {                 // ggml-common.h
    uint8_t scales[QK_K / 16];      // scale and min of each sub-block, 4 bits each
    uint8_t qs[QK_K / 4];           // the 2-bit values
    ggml_fp16_t d;
    ggml_fp16_t dmin;
};
static_assert(sizeof(block_q2_K) == 84, "Q2_K block layout");

// ggml's nearest_int: round to nearest, ties to even, for |f| < 2^22
inline int nearest_int(float f) {
    float v = f + 12582912.f;
    int32_t i;
    std::memcpy(&i, &v, sizeof i);
    return (i & 0x007fffff) - 0x00400000;
}

#define ALWAYS_INLINE __attribute__((always_inline)) inline  // into each ISA's entry point below

// W sub-blocks' values side by side (GCC's vector extensions); W is one register's floats:
// wider vectors than the ISA has are lowered lane by lane wherever they select
template <int W> struct lanes;
#define HOBBIT_LANES(W)                                                                         \
    template <> struct lanes<W> {                                                               \
        typedef float f __attribute__((vector_size(W * sizeof(float))));                        \
        typedef int32_t i __attribute__((vector_size(W * sizeof(int32_t))));                    \
        static ALWAYS_INLINE f abs(f x) { return (f) ((i) x & 0x7fffffff); }                    \
        static ALWAYS_INLINE i nearest_int(f x) { /* ggml's nearest_int, lane by lane */        \
            f v = x + 12582912.f;                                                               \
            return ((i) v & 0x007fffff) - 0x00400000;                                           \
        }                                                                                       \
        static ALWAYS_INLINE i clamp(i l, int hi) {                                             \
            const i zero = {}, top = zero + hi;                                                 \
            l = l < zero ? zero : l;                                                            \
            return l > top ? top : l;                                                           \
        }                                                                                       \
        static ALWAYS_INLINE f to_float(i l) { return __builtin_convertvector(l, f); }          \
        /* to_float(clamp(nearest_int(x), hi)) in floats: the same numbers for |x| < 2^22 */    \
        static ALWAYS_INLINE f level(f x, float hi) {                                           \
            f r = (x + 12582912.f) - 12582912.f; /* ties to even, as nearest_int */             \
            const f zero = {}, top = zero + hi;                                                 \
            r = r < zero ? zero : r;                                                            \
            return r > top ? top : r;                                                           \
        }                                                                                       \
    };
HOBBIT_LANES(4)
HOBBIT_LANES(8)

// make_qkx2_quants(16, 3, x, |x|, L, &min, Laux, -0.5f, 0.1f, 15, true) for G groups of W
// sub-blocks at once: xt[g][i] holds value i of each sub-block of group g. Writes each
// sub-block's levels (lt, as xt), its scale and its negated min.
//
// Each trial measures from the best fit so far, so a group's 16 trials form one chain of
// dependent additions (ggml's order, kept for its bits): one group alone leaves the core
// waiting on latency. The G groups' chains are independent, and every step below is written
// for all of them before the next, so the core runs them side by side.
template <int W, int G>
ALWAYS_INLINE void search_scales(const typename lanes<W>::f (&xt)[G][SUB], typename lanes<W>::i (&lt)[G][SUB],
                                 typename lanes<W>::f (&scale)[G], typename lanes<W>::f (&the_min)[G]) {
    using V = lanes<W>;
    typedef typename V::f vfloat;
    typedef typename V::i vint;
    constexpr int nmax = 3, nstep = 15;
    constexpr float rmin = -0.5f, rdelta = 0.1f;
    const vfloat zero = {};
    vfloat min[G], max[G], sum_w[G], sum_x[G];
    for (int g = 0; g < G; ++g) {
        min[g] = max[g] = xt[g][0];
        sum_w[g] = V::abs(xt[g][0]);
        sum_x[g] = sum_w[g] * xt[g][0];
    }
    for (int i = 1; i < SUB; ++i)
        for (int g = 0; g < G; ++g) {
            min[g] = xt[g][i] < min[g] ? xt[g][i] : min[g];
            max[g] = xt[g][i] > max[g] ? xt[g][i] : max[g];
            vfloat w = V::abs(xt[g][i]);
            sum_w[g] += w;
            sum_x[g] += w * xt[g][i];
        }
    // a flat sub-block (max == min): ggml returns at once with scale 0 and every level 0; its
    // lane below computes with an infinite iscale, and no trial is taken (its error is never
    // below the 0 of the first pass)
    vint flat[G];
    // the levels of a fit are those of its iscale measured from its min: rather than copy a
    // better trial's levels each time, keep the two and compute the best fit's levels once
    vfloat fit_iscale[G], fit_from[G], best[G];
    vfloat w[G][SUB];  // each value's weight in every fit
    for (int g = 0; g < G; ++g) {
        min[g] = min[g] > 0 ? zero : min[g];
        flat[g] = max[g] == min[g];
        vfloat iscale = nmax / (max[g] - min[g]);
        fit_iscale[g] = iscale;
        fit_from[g] = min[g];
        scale[g] = 1 / iscale;
        best[g] = zero;
    }
    for (int i = 0; i < SUB; ++i)
        for (int g = 0; g < G; ++g) {
            w[g][i] = V::abs(xt[g][i]);
            vfloat l = V::level(fit_iscale[g] * (xt[g][i] - min[g]), nmax);
            vfloat diff = V::abs(scale[g] * l + min[g] - xt[g][i]);
            best[g] += w[g][i] * diff;
        }
    for (int is = 0; is <= nstep; ++is) {
        vfloat iscale[G], l[G][SUB], sum_l[G], sum_l2[G], sum_xl[G];
        for (int g = 0; g < G; ++g) {
            iscale[g] = (rmin + rdelta * is + nmax) / (max[g] - min[g]);
            sum_l[g] = sum_l2[g] = sum_xl[g] = zero;
        }
        for (int i = 0; i < SUB; ++i)
            for (int g = 0; g < G; ++g) {
                l[g][i] = V::level(iscale[g] * (xt[g][i] - min[g]), nmax);
                vfloat wl = w[g][i] * l[g][i];
                sum_l[g] += wl;
                sum_l2[g] += wl * l[g][i];
                sum_xl[g] += wl * xt[g][i];
            }
        vfloat this_scale[G], this_min[G], D[G], error[G];
        for (int g = 0; g < G; ++g) {
            D[g] = sum_w[g] * sum_l2[g] - sum_l[g] * sum_l[g];
            this_scale[g] = (sum_w[g] * sum_xl[g] - sum_x[g] * sum_l[g]) / D[g];
            this_min[g] = (sum_l2[g] * sum_x[g] - sum_l[g] * sum_xl[g]) / D[g];
            vint clip = this_min[g] > 0;
            this_scale[g] = clip ? sum_xl[g] / sum_l2[g] : this_scale[g];
            this_min[g] = clip ? zero : this_min[g];
            error[g] = zero;
        }
        for (int i = 0; i < SUB; ++i)
            for (int g = 0; g < G; ++g) {
                vfloat diff = V::abs(this_scale[g] * l[g][i] + this_min[g] - xt[g][i]);
                error[g] += w[g][i] * diff;
            }
        for (int g = 0; g < G; ++g) {
            vint better = (D[g] > 0) & (error[g] < best[g]);  // ggml skips a trial whose D is not positive
            best[g] = better ? error[g] : best[g];
            fit_iscale[g] = better ? iscale[g] : fit_iscale[g];
            fit_from[g] = better ? min[g] : fit_from[g];
            scale[g] = better ? this_scale[g] : scale[g];
            min[g] = better ? this_min[g] : min[g];
        }
    }
    for (int g = 0; g < G; ++g) {
        for (int i = 0; i < SUB; ++i)
            lt[g][i] = flat[g] ? vint{} : V::clamp(V::nearest_int(fit_iscale[g] * (xt[g][i] - fit_from[g])), nmax);
        the_min[g] = -min[g];
        scale[g] = flat[g] ? zero : scale[g];
    }
}

template <int W> ALWAYS_INLINE void quantize_super_block(const float * x, block_q2_K & y) {
    constexpr int G = LANES / W;  // every sub-block of the super-block searched at once
    float scales[LANES], mins[LANES];
    uint8_t lt[SUB][LANES];  // the search's levels, value i of sub-block j at [i][j]
    {
        typename lanes<W>::f xt[G][SUB];
        for (int g = 0; g < G; ++g)
            for (int j = 0; j < W; ++j)
                for (int i = 0; i < SUB; ++i) xt[g][i][j] = x[SUB * (W * g + j) + i];
        typename lanes<W>::i levels[G][SUB];
        typename lanes<W>::f scale[G], min[G];
        search_scales<W, G>(xt, levels, scale, min);
        for (int g = 0; g < G; ++g)
            for (int j = 0; j < W; ++j) {
                scales[W * g + j] = scale[g][j];
                mins[W * g + j] = min[g][j];
                for (int i = 0; i < SUB; ++i) lt[i][W * g + j] = (uint8_t) levels[g][i][j];
            }
    }

    const float q4scale = 15.f;
    float max_scale = 0, max_min = 0;
    for (int j = 0; j < LANES; ++j) {
        if (scales[j] > max_scale) max_scale = scales[j];
        if (mins[j] > max_min) max_min = mins[j];
    }
    if (max_scale > 0) {
        float iscale = q4scale / max_scale;
        for (int j = 0; j < LANES; ++j) y.scales[j] = (uint8_t) nearest_int(iscale * scales[j]);
        y.d = ggml_fp32_to_fp16(max_scale / q4scale);
    } else {
        for (int j = 0; j < LANES; ++j) y.scales[j] = 0;
        y.d = ggml_fp32_to_fp16(0.f);
    }
    if (max_min > 0) {
        float iscale = q4scale / max_min;
        for (int j = 0; j < LANES; ++j) y.scales[j] |= (uint8_t) (nearest_int(iscale * mins[j]) << 4);
        y.dmin = ggml_fp32_to_fp16(max_min / q4scale);
    } else {
        y.dmin = ggml_fp32_to_fp16(0.f);
    }
    // the levels again against the 4-bit scales and mins (sub-blocks of scale 0 keep the search's)
    // (a sub-block's values W at a time, in vector lanes)
    using V = lanes<W>;
    const float d_all = ggml_fp16_to_fp32(y.d), dmin_all = ggml_fp16_to_fp32(y.dmin);
    uint8_t L[QK_K];
    for (int j = 0; j < LANES; ++j) {
        const float d = d_all * (y.scales[j] & 0xF);
        const float dm = dmin_all * (y.scales[j] >> 4);
        if (d == 0) {
            for (int i = 0; i < SUB; ++i) L[SUB * j + i] = lt[i][j];
            continue;
        }
        for (int i = 0; i < SUB; i += W) {
            typename V::f v;
            std::memcpy(&v, x + SUB * j + i, sizeof v);
            const typename V::i l = V::clamp(V::nearest_int((v + dm) / d), 3);
            for (int k = 0; k < W; ++k) L[SUB * j + i + k] = (uint8_t) l[k];
        }
    }
    for (int j = 0; j < QK_K; j += 128)
        for (int l = 0; l < 32; ++l)
            y.qs[j / 4 + l] = L[j + l] | (L[j + l + 32] << 2) | (L[j + l + 64] << 4) | (L[j + l + 96] << 6);
}

void quantize_blocks(const float * x, block_q2_K * y, int64_t n_blocks) {  // the baseline ISA
    for (int64_t b = 0; b < n_blocks; ++b) quantize_super_block<4>(x + b * QK_K, y[b]);
}

#if defined(__x86_64__) && defined(__GNUC__)
__attribute__((target("avx2,fma")))
void quantize_blocks_avx2(const float * x, block_q2_K * y, int64_t n_blocks) {
    for (int64_t b = 0; b < n_blocks; ++b) quantize_super_block<8>(x + b * QK_K, y[b]);
}
#endif

}  // namespace

extern "C" size_t hobbit_quantize_q2_K(const float * src, void * dst, int64_t nrows, int64_t n_per_row) {
    if (n_per_row <= 0 || n_per_row % QK_K != 0 || nrows < 0) return 0;
    auto * y = static_cast<block_q2_K *>(dst);
    const int64_t n_blocks = nrows * (n_per_row / QK_K);
#if defined(__x86_64__) && defined(__GNUC__)
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
        quantize_blocks_avx2(src, y, n_blocks);
        return (size_t) n_blocks * sizeof(block_q2_K);
    }
#endif
    quantize_blocks(src, y, n_blocks);
    return (size_t) n_blocks * sizeof(block_q2_K);
}
