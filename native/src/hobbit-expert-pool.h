// hobbit-expert-pool.h - a fixed set of slots, each holding the weights of one expert
// (every projection), with a slot table (layer, expert) -> slot and pin counts.
//
// The pool's weights are ggml tensors [n_in, n_out, n_slot] of the model's expert type,
// so a MoE layer's expert matmul runs on them with slot ids instead of expert ids. Each
// projection lives in the buffer type stock llama.cpp would give the model's tensor
// (the CPU repack buffer for Q4_0/Q4_K/... where the CPU has the kernels), so the pool
// computes with the very kernels stock uses and its results are the same bits.
// Not thread-safe: the runtime guards it with its mutex.
#pragma once

#include "hobbit-expert-store.h"

#include "ggml-backend.h"
#include "ggml.h"

#include <vector>

enum class slot_state {
    empty,   // holds nothing
    loading, // a read into it is queued or running
    ready,   // holds (layer, expert)
    unread,  // holds (layer, expert) but its queued background read was dropped: read when first used
};

struct pool_slot {
    int        layer      = -1;
    int        expert     = -1;
    slot_state state      = slot_state::empty;
    int        pins       = 0;     // users that need the data to stay (the layer being computed)
    bool       prefetched = false; // loaded by a prefetch and not selected since
    // the graph a background load (prefetch, upgrade) was queued into this slot in (-1: none,
    // or the prefetch's layer has had its turn): the slot is busy until then (an upgrade: for
    // the rest of that graph), however soon its bytes arrive, so that what a plan may take
    // does not depend on the disk's timing
    int64_t    background_graph = -1;
};

// where the pools live: the first GPU ggml has a backend for (HOBBIT §4's GPU-centric
// design: experts computed where the non-expert weights are; on a Jetson the same memory),
// else the CPU
ggml_backend_dev_t expert_pool_device();

// the buffer type stock llama.cpp picks for an expert weight of this type and shape on
// the CPU (an extra buffer type that repacks it, or plain host memory)
ggml_backend_buffer_type_t expert_weight_buft(int type, int64_t n_in, int64_t n_out, int n_expert_used);
bool expert_weight_repacked(int type, int64_t n_in, int64_t n_out, int n_expert_used);

class expert_pool {
public:
    // shape: the expert tensors of the layers this pool serves; dev: where its weights live
    // (NULL: the CPU); gate_only: the gate projection alone (neuron-granular reads: the neuron
    // row cache holds the rows of up and down)
    expert_pool(const expert_layer_layout & shape, int n_layer, int n_expert, int n_expert_used, int n_slot,
                ggml_backend_dev_t dev = nullptr, bool gate_only = false);
    ~expert_pool();
    expert_pool(const expert_pool &) = delete;
    expert_pool & operator=(const expert_pool &) = delete;

    int n_slot() const { return (int) slots.size(); }
    ggml_tensor * weights(int proj) const { return tensors[proj]; }
    bool repacked() const; // some projection is stored repacked (by the CPU backend)
    bool on_device() const { return on_device_; } // in a GPU's memory

    // where a load into slot puts each projection: raw bytes go to dst[p]; a repacked or
    // device projection has dst[p] = NULL and view[p] = the slot's tensor, written through
    // ggml_backend_tensor_set (which repacks, or copies to the device)
    void slot_targets(int slot, void * dst[LLAMA_MOE_PROJ_COUNT], ggml_tensor * view[LLAMA_MOE_PROJ_COUNT]) const;

    int  find(int layer, int expert) const { return slot_of[layer*n_expert + expert]; }
    // slot now belongs to (layer, expert) and is loading; the previous owner is forgotten
    void assign(int slot, int layer, int expert);
    // a failed load leaves the slot empty
    void clear(int slot);

    int  n_used() const { return n_used_; }  // slots that hold or are loading an expert

    std::vector<pool_slot> slots;

private:
    int n_expert;
    int n_used_ = 0;
    bool on_device_ = false;
    std::vector<int> slot_of; // [n_layer * n_expert], -1 when not in the pool
    ggml_context * ctx = nullptr;
    std::vector<ggml_backend_buffer_t> buffers;                 // one per projection
    ggml_tensor * tensors[LLAMA_MOE_PROJ_COUNT] = {};
    std::vector<ggml_tensor *> views[LLAMA_MOE_PROJ_COUNT];     // per slot, repacked or device projections only
};
