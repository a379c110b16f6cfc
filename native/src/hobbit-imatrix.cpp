// Importance matrix of the routed experts (llama.cpp's llama-imatrix, for the expert
// tensors only): for every expert tensor and expert, the sum over the tokens routed to it of
// the squared inputs of each column, and how many tokens that was. ggml's quantizer weighs
// each column's rounding error by it; the lowest-bit types (IQ2_*, IQ1_*) need it.
//
// Collected from the graph evaluation callback (llama_context_params.cb_eval) of a stock
// context: every MUL_MAT_ID whose weights are a model's "*_exps" tensor. Same accumulation as
// llama-imatrix's collect_imatrix, so its file (written by the Python side in the same GGUF
// layout) is one llama-quantize takes too.

#include "hobbit.h"

#include "ggml.h"
#include "ggml-backend.h"

#include <cstdio>
#include <cstring>
#include <iterator>
#include <map>
#include <mutex>
#include <string>
#include <vector>

struct hobbit_imatrix {
    struct entry {
        std::vector<double>  sums;    // [n_mat][n_col]
        std::vector<int64_t> counts;  // [n_mat]
        int64_t n_col = 0;
    };
    std::map<std::string, entry> entries;  // ordered: the file lists them in name order
    std::vector<uint8_t> ids;              // host copy of a node's expert ids
    std::vector<uint8_t> src1;             // host copy of a node's inputs, when not in host memory
    std::mutex mutex;
    bool failed = false;
};

static bool is_expert_weight(const ggml_tensor * w) {
    const char * name = w->name;
    return std::strncmp(name, "blk.", 4) == 0 && std::strstr(name, "_exps") != nullptr;
}

extern "C" hobbit_imatrix * hobbit_imatrix_new(void) {
    try {
        return new hobbit_imatrix();
    } catch (...) {
        return nullptr;
    }
}

extern "C" void hobbit_imatrix_free(hobbit_imatrix * im) {
    delete im;
}

extern "C" bool hobbit_imatrix_collect(struct ggml_tensor * t, bool ask, void * user_data) {
    auto * im = static_cast<hobbit_imatrix *>(user_data);
    if (ask) {  // the scheduler asks which nodes we want to see computed
        return t->op == GGML_OP_MUL_MAT_ID && is_expert_weight(t->src[0]);
    }
    if (t->op != GGML_OP_MUL_MAT_ID || !is_expert_weight(t->src[0])) {
        return true;
    }
    const ggml_tensor * w    = t->src[0];
    const ggml_tensor * x    = t->src[1];  // [n_col, n_expert_used or 1 (broadcast), n_tokens], f32
    const ggml_tensor * idst = t->src[2];  // [n_expert_used, n_tokens], i32, maybe not contiguous
    std::lock_guard<std::mutex> lock(im->mutex);
    try {
        if (x->type != GGML_TYPE_F32 || ggml_nrows(x) != x->ne[1] * x->ne[2] || idst->ne[1] != x->ne[2]) {
            im->failed = true;  // a layout this collector does not know: better no matrix than a wrong one
            return true;
        }
        im->ids.resize(ggml_nbytes(idst));
        ggml_backend_tensor_get(idst, im->ids.data(), 0, ggml_nbytes(idst));
        const char * data = static_cast<const char *>(x->data);
        if (!ggml_backend_buffer_is_host(x->buffer)) {
            im->src1.resize(ggml_nbytes(x));
            ggml_backend_tensor_get(x, im->src1.data(), 0, ggml_nbytes(x));
            data = reinterpret_cast<const char *>(im->src1.data());
        }
        const int64_t n_col = x->ne[0], n_mat = w->ne[2], n_used = idst->ne[0], n_tokens = x->ne[2];
        auto & e = im->entries[w->name];
        if (e.sums.empty()) {
            e.n_col = n_col;
            e.sums.assign(n_col * n_mat, 0.0);
            e.counts.assign(n_mat, 0);
        } else if (e.n_col != n_col || (int64_t) e.counts.size() != n_mat) {
            im->failed = true;
            return true;
        }
        for (int64_t token = 0; token < n_tokens; ++token) {
            for (int64_t k = 0; k < n_used; ++k) {
                const int32_t expert = *reinterpret_cast<const int32_t *>(im->ids.data() + token * idst->nb[1] + k * idst->nb[0]);
                if (expert < 0 || expert >= n_mat) {
                    continue;  // -1: no expert (a skipped selection), nothing computed with these weights
                }
                const float * row = reinterpret_cast<const float *>(data + (k % x->ne[1]) * x->nb[1] + token * x->nb[2]);
                double * acc = e.sums.data() + expert * n_col;
                for (int64_t j = 0; j < n_col; ++j) {
                    acc[j] += (double) row[j] * row[j];
                }
                e.counts[expert]++;
            }
        }
    } catch (...) {
        im->failed = true;
    }
    return true;
}

extern "C" int32_t hobbit_imatrix_count(hobbit_imatrix * im) {
    std::lock_guard<std::mutex> lock(im->mutex);
    return im->failed ? -1 : (int32_t) im->entries.size();
}

extern "C" bool hobbit_imatrix_entry(hobbit_imatrix * im, int32_t i, char * name, size_t name_size,
                                     int64_t * n_col, int64_t * n_mat) {
    std::lock_guard<std::mutex> lock(im->mutex);
    if (i < 0 || i >= (int32_t) im->entries.size()) {
        return false;
    }
    auto it = std::next(im->entries.begin(), i);
    if (name != nullptr && name_size > 0) {
        std::snprintf(name, name_size, "%s", it->first.c_str());
    }
    if (n_col != nullptr) *n_col = it->second.n_col;
    if (n_mat != nullptr) *n_mat = (int64_t) it->second.counts.size();
    return true;
}

extern "C" void hobbit_imatrix_copy(hobbit_imatrix * im, int32_t i, float * sums, float * counts) {
    std::lock_guard<std::mutex> lock(im->mutex);
    if (i < 0 || i >= (int32_t) im->entries.size()) {
        return;
    }
    const auto & e = std::next(im->entries.begin(), i)->second;
    for (size_t j = 0; j < e.sums.size(); ++j) {
        sums[j] = (float) e.sums[j];
    }
    for (size_t j = 0; j < e.counts.size(); ++j) {
        counts[j] = (float) e.counts[j];
    }
}
