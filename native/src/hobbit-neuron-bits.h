// hobbit-neuron-bits.h - a set of an expert's neurons, one bit each: what a selection needs,
// what a cache holds, what a read fetches. Shared by the runtime's neuron rows
// (hobbit-neuron-rows.h), its neuron reads (hobbit-neuron-reads.h) and CORM's cache model
// for the simulator (hobbit-neuron-sim-cache.h).
#pragma once

#include <cstdint>
#include <vector>

struct neuron_bits {
    std::vector<uint64_t> words;

    explicit neuron_bits(int n_neuron = 0, bool all = false);
    int  size() const { return n; }
    bool test(int i) const { return (words[i >> 6] >> (i & 63)) & 1; }
    void set(int i) { words[i >> 6] |= uint64_t(1) << (i & 63); }
    void reset(int i) { words[i >> 6] &= ~(uint64_t(1) << (i & 63)); }
    int  count() const;
    // runs of consecutive set neurons: the read requests a coalescing reader issues
    int  runs() const;

    int n = 0;
};

neuron_bits minus(const neuron_bits & a, const neuron_bits & b); // a & ~b
void        join(neuron_bits & into, const neuron_bits & b);    // into |= b
