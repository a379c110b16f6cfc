// hobbit-expert-pool.h - the tensors of a fixed set of slots, each holding the weights of one
// expert (every projection); which expert each slot holds is its slot_table's.
//
// The pool's weights are ggml tensors [n_in, n_out, n_slot] of the model's expert type,
// so a MoE layer's expert matmul runs on them with slot ids instead of expert ids. Each
// projection lives in the buffer type stock llama.cpp would give the model's tensor
// (the CPU repack buffer for Q4_0/Q4_K/... where the CPU has the kernels), so the pool
// computes with the very kernels stock uses and its results are the same bits.
#pragma once

#include "hobbit-expert-store.h"

#include "ggml-backend.h"
#include "ggml.h"

#include <memory>
#include <vector>

// where the pools live: the first GPU ggml has a backend for (HOBBIT §4's GPU-centric
// design: experts computed where the non-expert weights are; on a Jetson the same memory),
// else the CPU
ggml_backend_dev_t expert_pool_device();

// the buffer type stock llama.cpp picks for an expert weight of this type and shape on
// the CPU: with its extra buffer types on (cpu_repack, its default) the one that repacks it
// where there is one, else plain host memory
ggml_backend_buffer_type_t expert_weight_buft(int type, int64_t n_in, int64_t n_out, int n_expert_used, bool cpu_repack);
bool expert_weight_repacked(int type, int64_t n_in, int64_t n_out, int n_expert_used, bool cpu_repack);

class expert_pool {
public:
    // shape: the expert tensors of the layers this pool serves; dev: where its weights live
    // (NULL: the CPU); gate_only: the gate projection alone (neuron-granular reads: the neuron
    // row cache holds the rows of up and down); cpu_repack: on the CPU, the buffer type
    // expert_weight_buft gives with it (the model load's repack setting)
    expert_pool(const expert_layer_layout & shape, int n_expert_used, int n_slot, ggml_backend_dev_t dev = nullptr,
                bool gate_only = false, bool cpu_repack = true);
    ~expert_pool();
    expert_pool(const expert_pool &) = delete;
    expert_pool & operator=(const expert_pool &) = delete;

    int n_slot() const { return n_slot_; }
    ggml_tensor * weights(int proj) const { return tensors[proj]; }
    bool repacked() const; // some projection is stored repacked (by the CPU backend)
    bool on_device() const { return on_device_; } // in a GPU's memory

    // where a load into slot puts each projection: raw bytes go to dst[p]; a repacked or
    // device projection has dst[p] = NULL and view[p] = the slot's tensor, written through
    // ggml_backend_tensor_set (which repacks, or copies to the device)
    void slot_targets(int slot, void * dst[LLAMA_MOE_PROJ_COUNT], ggml_tensor * view[LLAMA_MOE_PROJ_COUNT]) const;

private:
    int n_slot_;
    bool on_device_ = false;
    ggml_context * ctx = nullptr;
    std::vector<ggml_backend_buffer_t> buffers;                 // one per projection
    ggml_tensor * tensors[LLAMA_MOE_PROJ_COUNT] = {};
    std::vector<ggml_tensor *> views[LLAMA_MOE_PROJ_COUNT];     // per slot, repacked or device projections only
};

// the pools of one runtime: where they live, and each one's tensors (in the expert cache's pool order)
struct expert_pool_set {
    ggml_backend_dev_t dev = nullptr;
    std::vector<std::unique_ptr<expert_pool>> tensors;
};
