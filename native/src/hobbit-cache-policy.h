// hobbit-cache-policy.h - which cached expert to evict when a slot is needed.
//
// One interface, one implementation per policy (LRU here; LFU, LHU, FLD, the HOBBIT
// multidimensional mix, ARC and score history plug in the same way). The pool decides
// which slots may be evicted (not pinned, not loading); the policy only ranks them.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

struct cache_policy_i {
    virtual ~cache_policy_i() = default;

    // slot now holds (layer, expert)
    virtual void on_insert(int slot, int layer, int expert) = 0;
    // the expert in slot was selected by the router this step
    virtual void on_access(int slot) = 0;
    // the victim among candidates (never empty)
    virtual int choose_victim(const std::vector<int> & candidates) = 0;
    // a new sequence starts (sequence-level policies reset their counters)
    virtual void reset() {}
};

// least recently used: evict the slot whose expert was selected longest ago
std::unique_ptr<cache_policy_i> cache_policy_make_lru(int n_slot);
