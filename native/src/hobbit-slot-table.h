// hobbit-slot-table.h - the state of one expert pool's slots: which (layer, expert) each
// holds, how far its load has got, who needs it to stay, and the marks the cache's plan
// reads (prefetched, busy with a background load).
//
// No lock and no I/O: its owner (the expert cache, under its lock) calls it, and every
// transition is asserted. A slot's life: empty -> loading (assign) -> ready (loaded); a
// queued background read dropped leaves it unread (holding the expert, bytes not read),
// loading again when first used; a failed load empties it. Only a slot nobody pins may
// change owner.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

enum class slot_state {
    empty,   // holds nothing
    loading, // a read into it is queued or running
    ready,   // holds (layer, expert)
    unread,  // holds (layer, expert) but its queued background read was dropped: read when first used
};

struct slot_entry {
    int        layer      = -1;
    int        expert     = -1;
    slot_state state      = slot_state::empty;
    int        pins       = 0;     // users that need the data to stay (the layer being computed, a prediction)
    bool       prefetched = false; // loaded by a prefetch and not selected since
    // the graph a background load (prefetch, upgrade) was queued into this slot in (-1: none,
    // or the prefetch's layer has had its turn): the slot is busy until then (an upgrade: for
    // the rest of that graph), however soon its bytes arrive, so that what a plan may take
    // does not depend on the disk's timing
    int64_t    background_graph = -1;
};

class slot_table {
public:
    slot_table() = default;
    slot_table(int n_layer, int n_expert, int n_slot);

    int size() const { return (int) slots.size(); }
    const slot_entry & operator[](int s) const { return slots[s]; }
    std::vector<slot_entry>::const_iterator begin() const { return slots.begin(); }
    std::vector<slot_entry>::const_iterator end() const { return slots.end(); }

    // the slot that holds (or is loading) (layer, expert), or -1
    int  find(int layer, int expert) const { return slot_of[(size_t) layer*n_expert + expert]; }
    int  n_used() const { return n_used_; } // slots that hold or are loading an expert
    bool has_empty() const { return n_used_ < size(); }

    // an unpinned slot now belongs to (layer, expert) and is loading; the previous owner is forgotten
    void assign(int s, int layer, int expert);
    // its read finished: loading -> ready
    void loaded(int s);
    // its queued read was dropped: loading -> unread
    void drop_read(int s);
    // a dropped read is needed after all: unread -> loading
    void read_again(int s);
    // a failed load leaves the slot empty (its pins stay: released by whoever pinned it)
    void clear(int s);

    void pin(int s);
    void unpin(int s);
    void set_prefetched(int s, bool prefetched);
    void set_background_graph(int s, int64_t graph);

private:
    slot_entry & at(int s);

    int n_expert = 0;
    int n_used_  = 0;
    std::vector<slot_entry> slots;
    std::vector<int> slot_of; // [n_layer * n_expert], -1 when not in the pool
};
