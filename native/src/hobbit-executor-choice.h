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
#include <vector>

// one missed expert of a wave, as the balance weighs it (seconds)
struct miss_cost {
    int    n_tokens   = 0;   // tokens of the ubatch that selected it (Algorithm 2's B_i)
    double load_s     = 0.0; // read into a slot by the I/O threads
    double in_place_s = 0.0; // faulted in by the compute threads: what the page cache does not hold yet
};

// Importance-driven scheduling's Algorithm 2 (CPU-load balancing), on this tier. There a
// missed expert is either loaded over PCIe (the GPU then computes any batch of it almost for
// free) or computed by the CPU (time linear in its batch), and a two-pointer walk over the
// misses, widest batch first, gives the next widest to the load side while its cumulative
// time is not ahead, else the next narrowest to the CPU side, so that both finish together.
// Here both sides compute on the same cores with the same kernels, so a token's compute costs
// the same either way and drops out; what differs is how the bytes arrive: a load's pread by
// the I/O threads (into a slot that keeps them for the next tokens), or in place the kernel's
// readahead into the page cache (nothing read for what it already holds, nothing cached in
// the pools). The walk is the paper's, with those two costs: the widest batches, the experts
// most worth a slot, are loaded; the narrowest run in place; an expert the page cache holds
// whole costs nothing in place and runs there before the walk. Returns, in the order given,
// whether each miss runs in place.
std::vector<bool> balance_misses(const std::vector<miss_cost> & misses);

struct executor_choice {
    enum hobbit_mode mode = HOBBIT_MODE_GPU_CENTRIC;
    bool   available       = false; // in place is possible (the model's experts are not repacked on load)
    std::vector<bool> inplace_ok;   // [n_layer]: the layer's misses may run on the mapped model (the runtime's choice)
    double load_bytes_per_s = 0.0;
    double map_bytes_per_s  = 0.0;

    // compute a missed expert in place? n_tokens: tokens of the ubatch using it; resident:
    // the share of its bytes already in the page cache; layer_bytes: every expert of its
    // layer; room: what the page cache may hold now beside the pools (-1 = no limit known)
    bool in_place(int n_tokens, double resident, int64_t layer_bytes, int64_t room) const;

    // a miss of n_bytes selected by n_tokens, resident: the share of its bytes in the page cache
    miss_cost cost(int n_tokens, int64_t n_bytes, double resident) const;
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
