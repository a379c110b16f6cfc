// hobbit-neuron-reads.h - CORM's neuron-granular reads (corm.txt §3.3-3.5) with W1 first:
// an expert's gate projection (W1) is read whole, the neurons its activation keeps decide
// which rows of up (W3) and of the transposed down (W2, `prepare --neuron-layout`) are read;
// a slot keeps the rows it has read for the expert it last read them for (the neuron
// cache inside the expert cache: a hit reads only the kept neurons it lacks).
//
// The pieces the runtime uses: which neurons a pair keeps, the byte ranges of the rows a
// slot lacks, and the sparse down projection over the kept neurons (Q8_0 rows).
#pragma once

#include "hobbit-io-scheduler.h"
#include "hobbit-neuron-cache.h"

#include <cstdint>
#include <vector>

// the neurons a pair keeps from its gate pre-activation g[n_ff]: |SiLU(g)| >= theta, or every
// neuron when more than limit of them pass (the expert then runs whole); returns whether whole
bool neuron_keep(const float * g, int n_ff, float theta, float limit, neuron_bits & keep);

// the rows of rows (a neuron per row of row_bytes in projection proj), one range per run of
// consecutive neurons: what a coalescing reader asks for
void neuron_ranges(const neuron_bits & rows, int proj, uint64_t row_bytes, std::vector<load_range> & out);

// out[b0*32 .. b1*32) = sum over the neurons f with act[f] != 0 of act[f] * row f of w, for
// w a Q8_0 matrix of n_ff rows (a neuron each) of row_stride bytes: the down projection of an
// expert stored transposed, restricted to the neurons kept, on blocks [b0, b1) of the output
void neuron_down_q8_0(const void * w, uint64_t row_stride, int n_ff, const float * act, float * out,
                      int64_t b0, int64_t b1);
