#include "hobbit-expert-pool.h"

#include "hobbit-error.h"

#include "ggml-alloc.h"

expert_pool::expert_pool(const expert_layer_layout & shape, int n_layer, int n_expert, int n_slot)
        : slots(n_slot), n_expert(n_expert), slot_of((size_t) n_layer * n_expert, -1) {
    ggml_init_params ip = { ggml_tensor_overhead() * LLAMA_MOE_PROJ_COUNT, nullptr, /*no_alloc*/ true };
    ctx = ggml_init(ip);
    static const char * names[LLAMA_MOE_PROJ_COUNT] = { "hobbit_pool_gate", "hobbit_pool_up", "hobbit_pool_down", "hobbit_pool_gate_up" };
    for (int p = 0; p < LLAMA_MOE_PROJ_COUNT; ++p) {
        const expert_proj_layout & pl = shape.proj[p];
        if (!pl.present) {
            continue;
        }
        tensors[p] = ggml_new_tensor_3d(ctx, (ggml_type) pl.type, pl.ne[0], pl.ne[1], n_slot);
        ggml_set_name(tensors[p], names[p]);
    }
    ggml_backend_dev_t cpu = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
    if (cpu == nullptr) {
        ggml_free(ctx);
        throw hobbit_error(HOBBIT_STATUS_ERROR_INTERNAL, "no CPU backend is loaded");
    }
    // pages are only touched by loads, so resident memory grows with the slots in use
    buffer = ggml_backend_alloc_ctx_tensors_from_buft(ctx, ggml_backend_dev_buffer_type(cpu));
    if (buffer == nullptr) {
        ggml_free(ctx);
        throw hobbit_error(HOBBIT_STATUS_ERROR_BUDGET, "cannot allocate the expert pool (" + std::to_string(n_slot) + " slots)");
    }
    ggml_backend_buffer_set_usage(buffer, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
}

expert_pool::~expert_pool() {
    ggml_backend_buffer_free(buffer);
    ggml_free(ctx);
}

void expert_pool::slot_data(int slot, void * dst[LLAMA_MOE_PROJ_COUNT]) const {
    for (int p = 0; p < LLAMA_MOE_PROJ_COUNT; ++p) {
        dst[p] = tensors[p] ? (char *) tensors[p]->data + (size_t) slot * tensors[p]->nb[2] : nullptr;
    }
}

void expert_pool::assign(int slot, int layer, int expert) {
    pool_slot & s = slots[slot];
    if (s.layer >= 0) {
        slot_of[s.layer*n_expert + s.expert] = -1;
    }
    if (s.state == slot_state::empty) {
        n_used_++;
    }
    s.layer      = layer;
    s.expert     = expert;
    s.state      = slot_state::loading;
    s.prefetched = false;
    slot_of[layer*n_expert + expert] = slot;
}

void expert_pool::clear(int slot) {
    pool_slot & s = slots[slot];
    if (s.layer >= 0) {
        slot_of[s.layer*n_expert + s.expert] = -1;
    }
    if (s.state != slot_state::empty) {
        n_used_--;
    }
    const int pins = s.pins; // released by whoever pinned it
    s = pool_slot{};
    s.pins = pins;
}
