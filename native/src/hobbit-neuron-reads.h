// hobbit-neuron-reads.h - CORM's neuron-granular reads (CORM §3.3-3.5) with W1 first:
// an expert's gate projection (W1) is read whole, the neurons its activation keeps decide
// which rows of up (W3) and of the transposed down (W2, `prepare --neuron-layout`) are read;
// the rows read stay in the neuron row cache (hobbit-neuron-rows.h): a hit reads only the
// kept neurons its expert lacks.
//
// The pieces the runtime uses: which neurons a pair keeps, and the sparse up and down
// projections over the kept neurons (Q8_0 rows, held by the neuron row cache).
#pragma once

#include "hobbit-neuron-bits.h"

#include <cstdint>
#include <vector>

// the neurons a pair keeps from its gate pre-activation g[n_ff]: |SiLU(g)| >= theta, or every
// neuron when more than limit of them pass (the expert then runs whole); returns whether whole
bool neuron_keep(const float * g, int n_ff, float theta, float limit, neuron_bits & keep);

// the expert's rows live in pages (hobbit-neuron-rows.h): row f of a projection at
// base + pages[f] * page_bytes, a Q8_0 row of n_embd weights

// out[f] = row f of up . x for the neurons f in [f0, f1) kept (keep[f] != 0), 0 for the others:
// the up projection of an expert restricted to the neurons kept, x in F32 (not quantized)
void neuron_up_q8_0(const uint8_t * base, uint64_t page_bytes, const int32_t * pages, int n_embd, const float * x,
                    const float * keep, float * out, int f0, int f1);

// out[b0*32 .. b1*32) = sum over the neurons f < n_ff with act[f] != 0 of act[f] * row f of the
// transposed down: the down projection of an expert restricted to the neurons kept, on blocks
// [b0, b1) of the output
void neuron_down_q8_0(const uint8_t * base, uint64_t page_bytes, const int32_t * pages, int n_ff, const float * act,
                      float * out, int64_t b0, int64_t b1);
