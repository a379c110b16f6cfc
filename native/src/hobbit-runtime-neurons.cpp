// hobbit-runtime-neurons.cpp - CORM's neuron ops of the runtime: the kept shares counted, the rows of the
// selected experts' up and down read after the gate (neuron-granular reads), and their products.

#include "hobbit-runtime.h"

#include "hobbit-error.h"
#include "hobbit-neuron-reads.h"
#include "hobbit-substitution.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cfloat>
#include <chrono>
#include <climits>
#include <cstdint>
#include <cmath>
#include <cstring>
#include <map>
#include <numeric>

// CORM's neuron mask of a pass: what it kept, counted (args: kept share per pair, dispatch ids)
void hobbit_runtime::neuron_count_op(ggml_tensor * dst, int ith, int nth, void * ud) {
    (void) nth;
    if (ith != 0) {
        return;
    }
    auto * rt = (hobbit_runtime *) ud;
    const ggml_tensor * kept = dst->src[0]; // [1, n_expert_used, n_tokens]
    const ggml_tensor * ids  = dst->src[1]; // [n_expert_used, n_tokens, n_pool + 1]
    int64_t n = 0, whole = 0;
    double sum = 0.0;
    for (int64_t t = 0; t < ids->ne[1]; ++t) {
        for (int64_t k = 0; k < ids->ne[0]; ++k) {
            bool in_pass = false;
            for (int64_t p = 0; p < ids->ne[2]; ++p) {
                in_pass |= *(const int32_t *) ((const char *) ids->data + k * ids->nb[0] + t * ids->nb[1] + p * ids->nb[2]) >= 0;
            }
            if (in_pass) {
                const float share = *(const float *) ((const char *) kept->data + k * kept->nb[1] + t * kept->nb[2]);
                n++;
                whole += share >= 1.0f;
                sum += share;
            }
        }
    }
    std::lock_guard<std::mutex> lock(rt->mtx);
    rt->stats_.neuron_selections += n;
    rt->stats_.neuron_whole      += whole;
    rt->stats_.neuron_kept       += sum;
}

// neuron-granular reads (hobbit-neuron-reads.h): after the gate projection, the rows of up and
// down its activations keep are read into the neuron row cache (args: gate pre-activation,
// dispatch ids; dst: the keep mask); the up projection over the kept neurons (args: the
// experts' input, the keep mask, slot ids) and the down projection (args: activation, slot ids)
// over the rows the fetch left in the pass's pages
void hobbit_runtime::neuron_fetch_op(ggml_tensor * dst, int ith, int nth, void * ud) {
    (void) nth;
    if (ith != 0) {
        return;
    }
    const auto * d = (const dispatch_ud *) ud;
    d->rt->fetch_neurons(dst, d->il);
}

// the pair (k, t) of a pass: its pages, or nullptr when it is not in the pass
static const int32_t * pair_pages(const std::vector<const int32_t *> & pages, int64_t n_used, int64_t k, int64_t t) {
    const size_t i = (size_t) (t * n_used + k);
    return i < pages.size() ? pages[i] : nullptr;
}

void hobbit_runtime::neuron_up_op(ggml_tensor * dst, int ith, int nth, void * ud) {
    const auto * rt = (const hobbit_runtime *) ud;
    const ggml_tensor * x    = dst->src[0]; // [n_embd, 1 or n_expert_used, n_tokens]
    const ggml_tensor * keep = dst->src[1]; // [n_ff, n_expert_used, n_tokens]
    const neuron_row_cache & rows = *rt->neurons.rows;
    const int n_ff = (int) dst->ne[0];
    // each thread its share of the neurons, for every pair
    const int f0 = (int) ((int64_t) n_ff * ith / nth), f1 = (int) ((int64_t) n_ff * (ith + 1) / nth);
    for (int64_t t = 0; t < dst->ne[2]; ++t) {
        for (int64_t k = 0; k < dst->ne[1]; ++k) {
            float * out = (float *) ((char *) dst->data + k * dst->nb[1] + t * dst->nb[2]);
            const int32_t * pages = pair_pages(rt->neurons.pages, dst->ne[1], k, t);
            if (pages == nullptr) {
                std::fill(out + f0, out + f1, 0.0f);
                continue;
            }
            const float * xk = (const float *) ((const char *) x->data + (x->ne[1] == 1 ? 0 : k) * x->nb[1] + t * x->nb[2]);
            neuron_up_q8_0(rows.row(0, 0), rows.page_bytes(), pages, (int) x->ne[0], xk,
                           (const float *) ((const char *) keep->data + k * keep->nb[1] + t * keep->nb[2]), out, f0, f1);
        }
    }
}

void hobbit_runtime::neuron_down_op(ggml_tensor * dst, int ith, int nth, void * ud) {
    const auto * rt = (const hobbit_runtime *) ud;
    const ggml_tensor * act = dst->src[0]; // [n_ff, n_expert_used, n_tokens]
    const neuron_row_cache & rows = *rt->neurons.rows;
    const int64_t n_block = dst->ne[0] / 32;
    // each thread its share of the output's blocks, for every pair
    const int64_t b0 = n_block * ith / nth, b1 = n_block * (ith + 1) / nth;
    for (int64_t t = 0; t < act->ne[2]; ++t) {
        for (int64_t k = 0; k < act->ne[1]; ++k) {
            float * out = (float *) ((char *) dst->data + k * dst->nb[1] + t * dst->nb[2]);
            const int32_t * pages = pair_pages(rt->neurons.pages, act->ne[1], k, t);
            if (pages == nullptr) {
                memset(out + b0 * 32, 0, (size_t) (b1 - b0) * 32 * sizeof(float));
                continue;
            }
            neuron_down_q8_0(rows.row(1, 0), rows.page_bytes(), pages, (int) act->ne[0],
                             (const float *) ((const char *) act->data + k * act->nb[1] + t * act->nb[2]), out, b0, b1);
        }
    }
}

void hobbit_runtime::fetch_neurons(ggml_tensor * dst, int il) {
    const ggml_tensor * gate = dst->src[0]; // [n_ff, n_expert_used, n_tokens]
    const ggml_tensor * ids  = dst->src[1]; // [n_expert_used, n_tokens, n_pool + 1]; plane 0: the slot
    const int n_ff = (int) gate->ne[0];
    const int64_t t_enter = runtime_clock_us();

    const int p = cache->pool_of(0, il);
    // which expert each pair's slot holds (the cache's lock, before the runtime's)
    std::vector<std::pair<int, int>> owner_of(gate->ne[1] * gate->ne[2], { -1, -1 });
    std::map<int, int> slot_of_expert; // of this layer's experts in the pass
    for (int64_t t = 0; t < gate->ne[2]; ++t) {
        for (int64_t k = 0; k < gate->ne[1]; ++k) {
            const int32_t s = *(const int32_t *) ((const char *) ids->data + k * ids->nb[0] + t * ids->nb[1]);
            if (s >= 0) {
                owner_of[t * gate->ne[1] + k] = cache->slot_owner(p, s);
                if (owner_of[t * gate->ne[1] + k].first == il) {
                    slot_of_expert[owner_of[t * gate->ne[1] + k].second] = s;
                }
            }
        }
    }
    std::unique_lock<std::mutex> lock(mtx);
    neuron_row_cache & rows = *neurons.caches[p];
    std::map<int64_t, neuron_bits> need;                       // owner (layer * n_expert + expert) -> the union of its pairs' kept neurons
    std::vector<int64_t> pair_owner(gate->ne[1] * gate->ne[2], -1); // token-major
    neurons.rows = &rows;
    neurons.pages.assign(pair_owner.size(), nullptr); // a failed fetch leaves the up and down ops zero rows
    neuron_bits keep;
    for (int64_t t = 0; t < gate->ne[2]; ++t) {
        for (int64_t k = 0; k < gate->ne[1]; ++k) {
            const int32_t s = *(const int32_t *) ((const char *) ids->data + k * ids->nb[0] + t * ids->nb[1]);
            float * mask = (float *) ((char *) dst->data + k * dst->nb[1] + t * dst->nb[2]);
            if (s < 0 || failed()) {
                std::fill(mask, mask + n_ff, 0.0f); // not in this pass: its down row is zero anyway
                continue;
            }
            const float * g = (const float *) ((const char *) gate->data + k * gate->nb[1] + t * gate->nb[2]);
            const bool whole = neuron_keep(g, n_ff, params.neuron_threshold, params.neuron_limit, keep);
            const int kept = keep.count();
            for (int f = 0; f < n_ff; ++f) {
                mask[f] = keep.test(f) ? 1.0f : 0.0f;
            }
            stats_.neuron_selections++;
            stats_.neuron_whole += whole;
            stats_.neuron_kept  += (double) kept / n_ff;
            const std::pair<int, int> & slot = owner_of[t * gate->ne[1] + k];
            const int64_t owner = (int64_t) slot.first * levels.index.info.n_expert + slot.second;
            pair_owner[t * gate->ne[1] + k] = owner;
            auto it = need.find(owner);
            if (it == need.end()) {
                need.emplace(owner, keep);
            } else {
                join(it->second, keep);
            }
        }
    }
    // read the rows the pass's experts lack, making room from the least recently used others
    neuron_rows_plan plan;
    if (!rows.plan_rows(need, plan)) {
        // the waves hold no more experts than the pages can hold whole (expert_cache::layer_capacity)
        fail("neuron reads: a pass of layer " + std::to_string(il) + " needs more rows than the neuron row cache's " +
             std::to_string(rows.n_page()) + " pages");
        return;
    }
    std::vector<neuron_row_run> runs;
    rows.apply_rows(plan, runs);
    for (size_t i = 0; i < pair_owner.size(); ++i) {
        neurons.pages[i] = pair_owner[i] < 0 ? nullptr : rows.pages(pair_owner[i]);
    }
    // a run of neurons is one read: the layout bundles each neuron's up row and down column, as a page does
    const uint64_t page_bytes = rows.page_bytes();
    std::vector<load_task> loads;
    for (const neuron_row_run & run : runs) {
        const int e = (int) (run.owner % levels.index.info.n_expert);
        if (loads.empty() || loads.back().expert != e) {
            loads.push_back({ p, 0, slot_of_expert.at(e), il, e, /*prefetch*/ false, {}, {}, {} });
        }
        loads.back().ranges.push_back({ LLAMA_MOE_PROJ_UP, (uint64_t) run.first * page_bytes,
                                        (uint64_t) (run.first + run.count) * page_bytes, rows.row(0, run.first_page) });
        stats_.neuron_reads++;
    }
    if (loads.empty()) {
        stats_.dispatch_us += runtime_clock_us() - t_enter;
        return;
    }
    neurons.pending += (int) loads.size();
    lock.unlock(); // the runtime's lock is held around no call into the cache
    cache->waiting_elsewhere(+1);
    io->submit(loads);
    const int64_t t0 = runtime_clock_us();
    lock.lock();
    neurons.done.wait(lock, [&] { return failed() || neurons.pending == 0; });
    lock.unlock();
    cache->waiting_elsewhere(-1);
    const int64_t waited = runtime_clock_us() - t0;
    lock.lock();
    stats_.stall_us    += waited;
    stats_.dispatch_us += runtime_clock_us() - t_enter - waited;
}
