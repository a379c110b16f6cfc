#include "hobbit-neuron-bits.h"

#include <cstddef>

neuron_bits::neuron_bits(int n_neuron, bool all) : words((n_neuron + 63) / 64, all ? ~uint64_t(0) : 0), n(n_neuron) {
    if (all && n_neuron % 64 != 0) {
        words.back() = (uint64_t(1) << (n_neuron % 64)) - 1;
    }
}

int neuron_bits::count() const {
    int c = 0;
    for (uint64_t w : words) {
        c += __builtin_popcountll(w);
    }
    return c;
}

int neuron_bits::runs() const {
    int r = 0;
    bool prev = false;
    for (int i = 0; i < n; ++i) {
        const bool b = test(i);
        r += b && !prev;
        prev = b;
    }
    return r;
}

neuron_bits minus(const neuron_bits & a, const neuron_bits & b) {
    neuron_bits out(a.n);
    for (size_t i = 0; i < a.words.size(); ++i) {
        out.words[i] = a.words[i] & ~b.words[i];
    }
    return out;
}

void join(neuron_bits & into, const neuron_bits & b) {
    for (size_t i = 0; i < into.words.size(); ++i) {
        into.words[i] |= b.words[i];
    }
}
