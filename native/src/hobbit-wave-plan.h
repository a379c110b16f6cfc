// hobbit-wave-plan.h - what one wave of a MoE layer's dispatch does for each expert the
// router selected, decided before anything changes.
//
// As llama.cpp plans a ubatch's KV cells (find_slot) before writing them (apply_ubatch),
// the runtime first reads the router's choice (read_selection), then the expert cache plans
// the wave from the slots as they are (expert_cache::plan_wave, read-only) and carries the
// plan out (apply_wave: pins, slots taken, loads handed out), and the runtime waits for the loads.
#pragma once

#include "hobbit-precision-scorer.h"

#include "ggml.h"

#include <cstdint>
#include <functional>
#include <vector>

// the router's choice for one ubatch
struct wave_selection {
    int n_used   = 0;
    int n_tokens = 0;
    std::vector<int32_t> ids;     // [n_tokens][n_used] expert ids (the top-k view is not contiguous)
    std::vector<int>     n_pairs; // [n_expert] tokens that selected the expert
    std::vector<int>     want;    // [n_expert] level wanted: the highest any of its tokens asks for;
                                  // n_level = skipped if missed; INT_MAX = not selected
    std::vector<bool>    top1;    // [n_expert] some token weighs this expert most
    std::vector<bool>    share_low; // [n_expert] wants the lowest level as one of a prompt's least popular (Fate
                                    // §4.5): a higher copy, cached or where the low pool has no room, serves it as
                                    // well, even with hits "exact" (the rule saves reads; it never asks to lose
                                    // precision at hand)
    std::vector<int>     order;   // the selected experts, those with the most tokens first
    // [n_expert], or empty: an access the policies count as low precision (HOBBIT's LHU), whatever
    // level serves it (empty: those served below the highest): the simulator's one mixed pool
    std::vector<bool>    counted_low;
    int n_skipped_pairs = 0;      // only_level: pairs to skip left out of the wave (once, in the lowest level's)

    size_t n_pair() const { return ids.size(); }
};

// a ubatch whose selections could cover its layer twice over is a prompt's: it and the next
// one sweep every MoE layer in order (the prompt rules: sweep order, the next layer loaded
// whole, Fate's low-precision share)
inline bool is_prompt_ubatch(size_t n_pair, int n_expert) {
    return n_pair >= 2 * (size_t) n_expert;
}

// sel: the dispatch op's [n_used, n_tokens] ids; wts: its [1, n_used, n_tokens] gate weights;
// placed: [n_expert] the level each expert is served at (a static placement), or nullptr:
// the thresholds decide from the weights (and, in a prompt, from how many tokens select each
// expert: thresholds.prefill_low_share). only_level >= 0: the pairs wanting another level are
// left out (id -1), those to skip too (counted in the lowest level's): one level's waves of a
// ubatch served level by level (expert_cache::waves_by_level)
wave_selection read_selection(const ggml_tensor * sel, const ggml_tensor * wts, int n_expert,
                              const precision_thresholds & thresholds, const int8_t * placed, int only_level = -1);
// the same from arrays: ids and weights [n_tokens][n_used] (weights nullptr: every pair wants the highest level)
wave_selection read_selection_of(const int32_t * ids, const float * wts, int n_used, int n_tokens, int n_expert,
                                 const precision_thresholds & thresholds, const int8_t * placed, int only_level = -1);

enum class serve_as {
    hit,      // cached at `level`, in `slot`
    skip,     // wanted at no level and missed (or, with skip_cached, cached too): left out of the sum (HOBBIT's T2)
    in_place, // computed on the mapped model (cooperative)
    load,     // a slot of `level`'s pool is empty or evictable: the expert is read into it
    wait,     // no slot now, but a background load or a prediction holds one, or no pass comes after this one:
              // free one (drop prefetches) or wait for one
    later,    // no slot now: a later wave serves it
};

struct expert_choice {
    int      expert  = -1;
    serve_as how     = serve_as::later;
    int      level   = -1;
    int      slot    = -1;    // hit only
    bool     upgrade = false; // a hit below the wanted level of a token's top-1 expert: load the wanted copy
};

struct wave_plan {
    bool has_inplace = false; // the wave has an in-place pass
    bool must_fit    = false; // no in-place pass and no wave after this one: every expert left needs a slot
    bool last        = false; // no wave after this one
    std::vector<expert_choice> choices; // cached experts first; those an earlier wave served left out
};

// what the id planes are written from once the plan is carried out
struct wave_assignment {
    std::vector<int>  slot_of;  // [n_expert] slot serving the expert, or -1
    std::vector<int>  level_of; // [n_expert] level serving it, n_level if skipped, or -1
    std::vector<bool> inplace;  // [n_expert] computed on the mapped model
    bool any_inplace = false;

    explicit wave_assignment(int n_expert) : slot_of(n_expert, -1), level_of(n_expert, -1), inplace(n_expert, false) {}
};

// the levels a selection wanted at `want` may take a slot at, in order: the wanted one,
// then the nearer higher precisions, then (allow_lower) the lower ones. Hits "exact": the
// wanted one only, so what is served is a function of the text alone (a lower level taken
// for want of room depended on which slots loads and predictions held at that moment: the
// soak's repeats differed at a cap whose high pools held a slot or two a layer)
int first_level(int want, int n_level, bool exact, bool allow_lower, const std::function<bool(int)> & has_room);
