#include "hobbit-expert-pool.h"

#include "hobbit-error.h"

#include "ggml-alloc.h"

#include <sys/mman.h>

#include <cstdint>

// back a host pool buffer with transparent huge pages where the system leaves that to
// madvise: a decode step streams hundreds of MB of expert weights, and with 4 KB pages
// the TLB misses alone cost a visible share of it (stock's mapped file gets large folios)
static void advise_huge_pages(ggml_backend_buffer_t buf) {
#ifdef MADV_HUGEPAGE
    if (!ggml_backend_buffer_is_host(buf)) {
        return;
    }
    const uintptr_t huge = (uintptr_t) 2 << 20;
    const uintptr_t base = (uintptr_t) ggml_backend_buffer_get_base(buf);
    const uintptr_t beg  = (base + huge - 1) / huge * huge;
    const uintptr_t end  = (base + ggml_backend_buffer_get_size(buf)) / huge * huge;
    if (end > beg) {
        madvise((void *) beg, end - beg, MADV_HUGEPAGE); // advice only: failure changes nothing
    }
#else
    (void) buf;
#endif
}

static ggml_backend_dev_t cpu_device() {
    ggml_backend_dev_t cpu = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
    if (cpu == nullptr && ggml_backend_reg_count() == 0) {
        // a portable build's backends are modules nothing has loaded yet (a pool made before
        // any model, as the native tests and the simulator do): load them as llama.cpp would
        ggml_backend_load_all();
        cpu = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
    }
    if (cpu == nullptr) {
        throw hobbit_error(HOBBIT_STATUS_ERROR_INTERNAL, "no CPU backend is loaded");
    }
    return cpu;
}

ggml_backend_dev_t expert_pool_device() {
    ggml_backend_dev_t cpu = cpu_device(); // loads the backends if nothing has
    for (size_t i = 0; i < ggml_backend_dev_count(); ++i) {
        ggml_backend_dev_t dev = ggml_backend_dev_get(i);
        const enum ggml_backend_dev_type t = ggml_backend_dev_type(dev);
        if (t == GGML_BACKEND_DEVICE_TYPE_GPU || t == GGML_BACKEND_DEVICE_TYPE_IGPU) {
            return dev;
        }
    }
    return cpu;
}

// the same test the llama.cpp loader makes for a MUL_MAT_ID weight
static bool buft_supports_expert_weight(ggml_backend_dev_t dev, ggml_backend_buffer_type_t buft,
                                        int type, int64_t n_in, int64_t n_out, int n_expert_used) {
    ggml_init_params ip = { 4*ggml_tensor_overhead(), nullptr, true };
    ggml_context * ctx = ggml_init(ip);
    // 3-D like a stacked expert tensor (a repacking buffer only takes those for MUL_MAT_ID)
    ggml_tensor * w   = ggml_new_tensor_3d(ctx, (ggml_type) type, n_in, n_out, 2);
    ggml_tensor * b   = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, n_in, n_expert_used, 512);
    ggml_tensor * ids = ggml_new_tensor_2d(ctx, GGML_TYPE_I32, n_expert_used, 512);
    ggml_tensor * op  = ggml_mul_mat_id(ctx, w, b, ids);
    w->buffer = ggml_backend_buft_alloc_buffer(buft, 0);
    const bool ok = ggml_backend_dev_supports_op(dev, op);
    ggml_backend_buffer_free(w->buffer);
    ggml_free(ctx);
    return ok;
}

ggml_backend_buffer_type_t expert_weight_buft(int type, int64_t n_in, int64_t n_out, int n_expert_used, bool cpu_repack) {
    ggml_backend_dev_t cpu = cpu_device();
    auto * reg = ggml_backend_dev_backend_reg(cpu);
    auto get_extra = (ggml_backend_dev_get_extra_bufts_t) ggml_backend_reg_get_proc_address(reg, "ggml_backend_dev_get_extra_bufts");
    if (get_extra && cpu_repack) {
        for (ggml_backend_buffer_type_t * b = get_extra(cpu); b && *b; ++b) {
            if (buft_supports_expert_weight(cpu, *b, type, n_in, n_out, n_expert_used)) {
                return *b;
            }
        }
    }
    return ggml_backend_dev_buffer_type(cpu);
}

bool expert_weight_repacked(int type, int64_t n_in, int64_t n_out, int n_expert_used, bool cpu_repack) {
    return expert_weight_buft(type, n_in, n_out, n_expert_used, cpu_repack) != ggml_backend_dev_buffer_type(cpu_device());
}

expert_pool::expert_pool(const expert_layer_layout & shape, int n_expert_used, int n_slot, ggml_backend_dev_t dev,
                         bool gate_only, bool cpu_repack)
        : n_slot_(n_slot) {
    const bool on_cpu = dev == nullptr || ggml_backend_dev_type(dev) == GGML_BACKEND_DEVICE_TYPE_CPU;
    on_device_ = !on_cpu;
    ggml_init_params ip = { ggml_tensor_overhead() * (LLAMA_MOE_PROJ_COUNT * (1 + (size_t) n_slot)), nullptr, /*no_alloc*/ true };
    ctx = ggml_init(ip);
    static const char * names[LLAMA_MOE_PROJ_COUNT] = { "hobbit_pool_gate", "hobbit_pool_up", "hobbit_pool_down", "hobbit_pool_gate_up" };
    try {
        for (int p = 0; p < LLAMA_MOE_PROJ_COUNT; ++p) {
            const expert_proj_layout & pl = shape.proj[p];
            if (!pl.present || (gate_only && p != LLAMA_MOE_PROJ_GATE)) {
                continue;
            }
            ggml_tensor * t = ggml_new_tensor_3d(ctx, (ggml_type) pl.type, pl.ne[0], pl.ne[1], n_slot);
            ggml_set_name(t, names[p]);
            tensors[p] = t;

            // on a GPU the device's own buffer type (ggml's CUDA kernels take every type as stored)
            ggml_backend_buffer_type_t buft = !on_cpu ? ggml_backend_dev_buffer_type(dev)
                                                      : expert_weight_buft(pl.type, pl.ne[0], pl.ne[1], n_expert_used, cpu_repack);
            // host pages are only touched by loads, so resident memory grows with the slots in use
            ggml_backend_buffer_t buf = ggml_backend_buft_alloc_buffer(buft, ggml_backend_buft_get_alloc_size(buft, t));
            if (buf == nullptr) {
                throw hobbit_error(HOBBIT_STATUS_ERROR_BUDGET, "cannot allocate the expert pool (" + std::to_string(n_slot) + " slots)");
            }
            buffers.push_back(buf);
            advise_huge_pages(buf);
            ggml_backend_buffer_set_usage(buf, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
            ggml_tallocr talloc = ggml_tallocr_new(buf);
            if (ggml_tallocr_alloc(&talloc, t) != GGML_STATUS_SUCCESS) {
                throw hobbit_error(HOBBIT_STATUS_ERROR_INTERNAL, "cannot place the expert pool in its buffer");
            }
            if (buft != ggml_backend_dev_buffer_type(cpu_device())) {
                // a repacking buffer converts on set_tensor, whole tensors only, and device
                // memory is written through its backend: one view per slot
                for (int s = 0; s < n_slot; ++s) {
                    ggml_tensor * v = ggml_view_3d(ctx, t, t->ne[0], t->ne[1], 1, t->nb[1], t->nb[2], (size_t) s * t->nb[2]);
                    if (ggml_backend_view_init(v) != GGML_STATUS_SUCCESS) {
                        throw hobbit_error(HOBBIT_STATUS_ERROR_INTERNAL, "cannot initialise a repacked expert slot");
                    }
                    views[p].push_back(v);
                }
            }
        }
    } catch (...) {
        for (auto * b : buffers) {
            ggml_backend_buffer_free(b);
        }
        ggml_free(ctx);
        throw;
    }
}

expert_pool::~expert_pool() {
    for (auto * b : buffers) {
        ggml_backend_buffer_free(b);
    }
    ggml_free(ctx);
}

bool expert_pool::repacked() const {
    if (on_device_) {
        return false; // written through views too, but stored as the file has it
    }
    for (const auto & v : views) {
        if (!v.empty()) {
            return true;
        }
    }
    return false;
}

void expert_pool::slot_targets(int slot, void * dst[LLAMA_MOE_PROJ_COUNT], ggml_tensor * view[LLAMA_MOE_PROJ_COUNT]) const {
    for (int p = 0; p < LLAMA_MOE_PROJ_COUNT; ++p) {
        const bool repack = !views[p].empty();
        dst[p]  = tensors[p] && !repack ? (char *) tensors[p]->data + (size_t) slot * tensors[p]->nb[2] : nullptr;
        view[p] = repack ? views[p][slot] : nullptr;
    }
}
