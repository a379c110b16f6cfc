// hobbit-neuron-sim-cache.h - CORM's coarse-to-fine cache (CORM §3.5, Fig. 6) as the simulator
// models it (hobbit_simulate_neurons; the runtime's own neuron rows are hobbit-neuron-rows.h): the expert
// cache holds, for each cached expert, a subset of its neurons. A neuron is a row of W1, a
// row of W3 and a column of W2 (contiguous in a neuron-major layout); a selection needs a set
// of them; a cached expert reads only the needed neurons it lacks and keeps the union; above
// the limit the whole expert is read. The budget counts bytes: an expert costs the neurons it
// holds, so a cache of partial experts holds more experts than one of whole ones.
//
// W1 is held apart from W3/W2 so that both ways of choosing neurons fit: CORM's (the set
// predicted one layer ahead, for all three) and W1-first (W1 whole, then the exactly active
// rows of W3 and columns of W2).
//
// As the slot rule: plan_access says what to read and whom to evict without changing
// anything; apply carries a plan out. Experts used in the current step (token, layer) are
// pinned: the layer computes with them.
#pragma once

#include "hobbit-neuron-bits.h"

#include <cstdint>
#include <unordered_map>
#include <vector>

struct neuron_need {
    neuron_bits w1;    // rows of W1 the selection computes with
    neuron_bits rest;  // rows of W3 and columns of W2
};

struct neuron_sim_plan {
    int     layer = -1, expert = -1;
    bool    hit   = false;   // the expert was cached (with some neurons)
    bool    whole = false;   // over the limit: the whole expert is read
    neuron_bits read_w1, read_rest;     // what to read
    int64_t read_bytes = 0;
    int     n_requests = 0;             // coalesced: one per run of neurons, per projection
    std::vector<int64_t> evict;         // keys (layer * n_expert + expert) of the victims, least recent first
};

class neuron_sim_cache {
public:
    // neuron_bytes: one neuron of one projection (a row of W1); limit: the share of neurons
    // over which a whole expert is read (CORM: 0.75; 0 = always whole, expert-granular)
    neuron_sim_cache(int n_layer, int n_expert, int n_neuron, int64_t neuron_bytes, int64_t budget_bytes, double limit);

    void begin_step();  // a new (token, layer): what the previous one used may go
    neuron_sim_plan plan_access(int layer, int expert, const neuron_need & need) const;
    void apply(const neuron_sim_plan & plan);

    int64_t used_bytes() const { return used; }
    int64_t budget() const { return budget_bytes; }
    int     n_cached() const { return (int) entries.size(); }

private:
    struct entry {
        neuron_bits w1, rest;
        int64_t last_use = 0;  // tick of its last access
        int64_t step     = -1; // step that pinned it
    };
    int64_t bytes_of(const neuron_bits & w1, const neuron_bits & rest) const;

    int n_layer, n_expert, n_neuron;
    int64_t neuron_bytes, budget_bytes;
    double limit;
    std::unordered_map<int64_t, entry> entries;
    int64_t used = 0, tick = 0, step = 0;
};
