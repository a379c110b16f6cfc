// hobbit-executor-choice.h - where a missed expert runs: loaded into a pool slot, or
// computed in place on the model's mapped file (HOBBIT §4's cooperative mode, Fiddler's
// Algorithm 1). On a machine without a GPU both compute on the CPU with the same kernels;
// what differs is how the weights arrive: a load reads them with the I/O threads (and
// keeps them cached for the next tokens), in place the compute threads fault them in from
// the file (through the page cache, which may already hold them).
//
// The latency model is measured at start-up: the bandwidth of a load (pread, O_DIRECT when
// in use) and of faulting the same bytes in through the mapping, both from a cold page cache.
#pragma once

#include "hobbit-expert-store.h"

#include "hobbit.h"

#include <cstddef>

struct executor_choice {
    enum hobbit_mode mode = HOBBIT_MODE_GPU_CENTRIC;
    bool   available       = false; // in place is possible (the model's experts are not repacked on load)
    double load_bytes_per_s = 0.0;
    double map_bytes_per_s  = 0.0;

    // compute a missed expert in place? n_tokens: tokens of the ubatch using it; resident:
    // the share of its bytes already in the page cache; layer_bytes: every expert of its
    // layer; room: what the page cache may hold now beside the pools (-1 = no limit known)
    bool in_place(int n_tokens, double resident, int64_t layer_bytes, int64_t room) const;
};

// computing a layer in place faults its experts into the page cache, which holds them while
// the layer computes and the next layer is read ahead: room for two layers' experts, or the
// faulted-in pages evict each other mid-matmul. room: what the page cache may hold beside
// the pools (-1 = no limit known)
bool page_cache_holds_two_layers(int64_t layer_bytes, int64_t room);

// measure the latency model on the first expert of the first MoE layer (drops that range
// of the model file from the page cache first; a failed measurement leaves 0 bandwidths)
executor_choice executor_choice_make(const expert_index & index, enum hobbit_mode mode, bool available, bool direct_io);

// no readahead on faults over [addr, addr + n_bytes) of a file mapping: a fault reads its
// page only (the kernel's default reads read_ahead_kb around it, 8 MB on some disks)
void map_advise_random(const void * addr, size_t n_bytes);

// ask the kernel to read [addr, addr + n_bytes) of a file mapping ahead, asynchronously
void map_advise_willneed(const void * addr, size_t n_bytes);

// share of [addr, addr + n_bytes) resident in memory (mincore); 0 on error
double resident_share(const void * addr, size_t n_bytes);
