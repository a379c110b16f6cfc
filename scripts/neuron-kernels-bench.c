// What a neuron-sparse expert (CORM's sparse compute) would cost with ggml's CPU kernels,
// on one expert of the inflated reference models (n_embd 256, n_ff 16384), one thread,
// for a decode token: the figures behind docs/BENCHMARKS.md, "CORM: what sparse compute
// would buy on this CPU". For each quant type and share of active neurons it times
//   - W1/W3 as rows: one vec_dot per active neuron (a row of n_embd weights);
//   - W2 as GGUF stores it: n_embd rows of n_ff, every row a dense dot with the activation
//     (a sparse activation does not make a block-quantized dot cheaper);
//   - W2 stored transposed (a row per neuron): each active neuron's row dequantized with
//     ggml's to_float and accumulated, the only way ggml's kernels skip a neuron of W2.
// Build against an installed hobbitpy (its lib/ holds ggml; the headers are the vendored
// llama.cpp's):
//   L=$(python -c 'import hobbitpy, os; print(os.path.join(os.path.dirname(hobbitpy.__file__), "lib"))')
//   gcc -O3 -march=native scripts/neuron-kernels-bench.c -I<llama.cpp>/ggml/include
//       -L$L -lggml-cpu -lggml-base -Wl,-rpath,$L -lm -o /tmp/neuron-kernels && /tmp/neuron-kernels
#include "ggml.h"
#include "ggml-cpu.h"

#include <stdio.h>
#include <stdlib.h>
#include <time.h>

enum { N_EMBD = 256, N_FF = 16384, REPEATS = 7, CALLS = 20 };

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static int cmp_double(const void * a, const void * b) {
    const double x = *(const double *) a, y = *(const double *) b;
    return (x > y) - (x < y);
}

// the median over REPEATS of the mean time of CALLS calls, in ms
#define TIME_MS(out, body) do {                                       \
        double t_[REPEATS];                                           \
        for (int r_ = 0; r_ < REPEATS; ++r_) {                        \
            const double t0_ = now_s();                               \
            for (int c_ = 0; c_ < CALLS; ++c_) { body; }              \
            t_[r_] = (now_s() - t0_) / CALLS * 1e3;                   \
        }                                                             \
        qsort(t_, REPEATS, sizeof(double), cmp_double);               \
        (out) = t_[REPEATS / 2];                                      \
    } while (0)

int main(void) {
    ggml_cpu_init();
    srand(1);
    const enum ggml_type types[] = { GGML_TYPE_Q8_0, GGML_TYPE_Q4_K, GGML_TYPE_Q2_K, GGML_TYPE_IQ2_XXS };
    const float shares[] = { 1.0f, 0.75f, 0.5f, 0.3f };
    float * w = malloc(sizeof(float) * N_EMBD * N_FF);
    float * x = malloc(sizeof(float) * N_EMBD);
    float * h = malloc(sizeof(float) * N_FF);
    float * row = malloc(sizeof(float) * N_EMBD);
    float * out = calloc(N_EMBD, sizeof(float));
    float * imatrix = malloc(sizeof(float) * N_FF);
    int * active = malloc(sizeof(int) * N_FF);
    for (long i = 0; i < (long) N_EMBD * N_FF; ++i) w[i] = ((float) rand() / RAND_MAX * 2 - 1) * 0.05f;
    for (int i = 0; i < N_EMBD; ++i) x[i] = (float) rand() / RAND_MAX * 2 - 1;
    for (int i = 0; i < N_FF; ++i) { h[i] = (float) rand() / RAND_MAX * 2 - 1; imatrix[i] = 1.0f; }

    printf("%-8s %6s %14s %14s %22s\n", "type", "active", "W1/W3 rows ms", "W2 dense ms", "W2 transposed sparse ms");
    for (size_t ti = 0; ti < sizeof(types) / sizeof(types[0]); ++ti) {
        const enum ggml_type type = types[ti];
        const struct ggml_type_traits_cpu * cpu = ggml_get_type_traits_cpu(type);
        const struct ggml_type_traits * traits = ggml_get_type_traits(type);
        const struct ggml_type_traits_cpu * act = ggml_get_type_traits_cpu(cpu->vec_dot_type);
        const float * im = ggml_quantize_requires_imatrix(type) ? imatrix : NULL;
        // the same weights as neuron rows (W1/W3, or W2 transposed) and as W2's n_embd rows
        const size_t neuron_bytes = ggml_row_size(type, N_EMBD);
        const size_t w2_row_bytes = ggml_row_size(type, N_FF);
        char * neurons = malloc(neuron_bytes * N_FF);
        char * w2 = malloc(w2_row_bytes * N_EMBD);
        ggml_quantize_chunk(type, w, neurons, 0, N_FF, N_EMBD, im);
        ggml_quantize_chunk(type, w, w2, 0, N_EMBD, N_FF, im);
        char * xq = malloc(ggml_row_size(cpu->vec_dot_type, N_EMBD));
        char * hq = malloc(ggml_row_size(cpu->vec_dot_type, N_FF));
        act->from_float(x, xq, N_EMBD);
        float y[N_EMBD];
        for (size_t si = 0; si < sizeof(shares) / sizeof(shares[0]); ++si) {
            int n_active = 0;
            for (int j = 0; j < N_FF; ++j) {
                if ((float) rand() / RAND_MAX < shares[si]) active[n_active++] = j;
            }
            double rows_ms, dense_ms, transposed_ms;
            TIME_MS(rows_ms, for (int k = 0; k < n_active; ++k) {
                cpu->vec_dot(N_EMBD, &h[active[k]], 0, neurons + (size_t) active[k] * neuron_bytes, 0, xq, 0, 1);
            });
            TIME_MS(dense_ms, {
                act->from_float(h, hq, N_FF);
                for (int i = 0; i < N_EMBD; ++i) cpu->vec_dot(N_FF, &y[i], 0, w2 + (size_t) i * w2_row_bytes, 0, hq, 0, 1);
            });
            TIME_MS(transposed_ms, for (int k = 0; k < n_active; ++k) {
                traits->to_float(neurons + (size_t) active[k] * neuron_bytes, row, N_EMBD);
                const float a = h[active[k]];
                for (int i = 0; i < N_EMBD; ++i) out[i] += a * row[i];
            });
            printf("%-8s %6.2f %14.3f %14.3f %22.3f\n", ggml_type_name(type), (double) n_active / N_FF,
                   rows_ms, dense_ms, transposed_ms);
        }
        free(neurons); free(w2); free(xq); free(hq);
    }
    // keep the results observable so the compiler cannot drop the loops
    fprintf(stderr, "checksum %g\n", (double) out[0] + h[0]);
    return 0;
}
