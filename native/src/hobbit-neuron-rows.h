// hobbit-neuron-rows.h - the neuron cache of neuron-granular reads (CORM §3.5): the rows of
// up and of the transposed down that have been read, held per expert (layer * n_expert + expert)
// in pages of one neuron each (its up row, then its down row: the neuron layout's bundle, so a
// run of neurons is read straight into a run of pages), apart from the gate projections' slots. The budget counts the rows held, not whole experts, so the cache holds as many experts
// as their kept neurons leave room for, and an expert's rows outlive its gate's slot.
//
// When a pass needs more pages than are free, the rows of the least recently used experts
// outside the pass go, all of an expert's rows at once (the expert LRU, at neuron granularity).
// As the slot rule: plan_rows says what to read and whose rows go, changing nothing;
// apply_rows carries a plan out and says where each run of read rows goes.
#pragma once

#include "hobbit-neuron-bits.h"

#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <map>
#include <memory>
#include <unordered_map>
#include <vector>

struct neuron_rows_plan {
    std::vector<std::pair<int64_t, neuron_bits>> reads; // owner -> the needed rows it lacks
    std::vector<int64_t> used;                          // every owner of the pass
    std::vector<int64_t> evict;                         // owners whose rows go, least recent first
};

// a run of consecutive neurons [first, first + count) of owner read into consecutive pages
// from first_page: one request for its up rows, one for its down rows
struct neuron_row_run {
    int64_t owner;
    int     first, count;
    int32_t first_page;
};

class neuron_row_cache {
public:
    // bridge: a gap of at most this many rows between two runs a pass reads is read with them
    // (hobbit_params.neuron_bridge: fewer, larger requests for more bytes; 0: the kept rows only)
    neuron_row_cache(int n_ff, uint64_t row_bytes, int64_t n_page, int bridge = 0);

    int      n_ff() const { return n_ff_; }
    int64_t  n_page() const { return n_page_; }
    int64_t  n_free() const { return n_free_; }
    uint64_t row_bytes() const { return row_bytes_; }
    uint64_t page_bytes() const { return 2 * row_bytes_; }
    int64_t  bytes() const { return 2 * n_page_ * (int64_t) row_bytes_; }

    // owner's page of each neuron [n_ff], -1 where not held; nullptr when it holds none
    const int32_t * pages(int64_t owner) const;
    // where a page's up row (half 0) or down row (half 1) lives
    uint8_t *       row(int half, int32_t page) { return arena.get() + ((size_t) page * 2 + half) * row_bytes_; }
    const uint8_t * row(int half, int32_t page) const { return arena.get() + ((size_t) page * 2 + half) * row_bytes_; }

    // the reads and evictions that give every owner of need the rows it names; false (plan
    // unset) when the pass needs more rows than the cache has pages
    bool plan_rows(const std::map<int64_t, neuron_bits> & need, neuron_rows_plan & plan) const;
    // drops the victims' rows, gives each row read a page (the lowest free, so a run of
    // neurons lands in a run of pages as often as it can) and marks the pass's owners used
    void apply_rows(const neuron_rows_plan & plan, std::vector<neuron_row_run> & runs);

    // the rows a read of missing bridges: a gap of at most `bridge` rows between two missing
    // ones, none of them held, is read too (held: the owner's pages, or nullptr)
    void bridge_gaps(neuron_bits & missing, const int32_t * held) const;

private:
    struct entry {
        std::vector<int32_t> page;
        int     n_held   = 0;
        int64_t last_use = 0;
    };
    void    drop(entry & e);
    int32_t take_page();

    int      n_ff_;
    uint64_t row_bytes_;
    int64_t  n_page_, n_free_;
    int      bridge_;
    struct free_arena { void operator()(uint8_t * p) const { std::free(p); } };
    std::unique_ptr<uint8_t[], free_arena> arena; // n_page pages, each an up row and a down row; on a memory page
    std::vector<uint64_t> free_words;  // bit set: page free
    size_t   free_hint = 0;            // no free page below this word
    std::unordered_map<int64_t, entry> entries;
    int64_t  tick = 0;
};

// how a pool's bytes are shared between gate slots (an expert's gate projection each, gate_bytes)
// and row pages (one neuron's up and down rows, 2 x row_bytes): gates first, as many as the
// bytes hold beside the rows of n_min experts whole (one token's top-k: a pass must fit), at most
// n_max; the pages take the rest (at most n_max experts' rows). False when bytes hold less than
// n_min whole experts. Why gates first: a cached gate saves its whole read at every reuse, while
// cached rows save only those of the neurons the next token keeps again, and where neurons fire
// at random (our reference models: each neuron kept by 35-66 % of tokens at θ 0.25) half the rows
// held are the wrong ones: per byte a gate saves about twice what rows do. Measured on the tall
// model at cap 0.55 (one invocation each, disk MiB per token): room for the rows at half their
// neurons, 18 gates, hit 0.33, 44.3; at a fifth, hit 0.48, 48.4; gates first, hit 0.79, 40.6
// (docs/BENCHMARKS.md at 5f63b2a, CORM's row readers).
bool neuron_rows_split(int64_t bytes, int64_t gate_bytes, int n_ff, uint64_t row_bytes, int n_min, int n_max,
                       int & n_gate_slot, int64_t & n_page);

// a runtime's neuron-granular reads: per pool its row cache (the rows of up and down read for its
// layers' experts; the pool holds their gate projections), or nullptr; the row loads in flight; the
// last fetch's pass (each pair's pages, token-major, nullptr: not in the pass), read by the up and
// down ops that follow it in the graph. Its owner's lock guards it
struct neuron_pass {
    std::vector<std::unique_ptr<neuron_row_cache>> caches;
    std::condition_variable done;  // a row load finished
    int pending = 0;
    const neuron_row_cache * rows = nullptr;
    std::vector<const int32_t *> pages;
};
