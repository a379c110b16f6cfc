#include "hobbit-slot-table.h"

#include "ggml.h"

slot_table::slot_table(int n_layer, int n_expert, int n_slot)
    : n_expert(n_expert), slots(n_slot), slot_of((size_t) n_layer * n_expert, -1) {}

slot_entry & slot_table::at(int s) {
    GGML_ASSERT(s >= 0 && s < size());
    return slots[s];
}

void slot_table::assign(int s, int layer, int expert) {
    slot_entry & e = at(s);
    GGML_ASSERT(e.pins == 0 && "a pinned slot changed owner");
    GGML_ASSERT(layer >= 0 && expert >= 0 && expert < n_expert && (size_t) layer*n_expert + expert < slot_of.size());
    if (e.layer >= 0) {
        slot_of[(size_t) e.layer*n_expert + e.expert] = -1;
    }
    if (e.state == slot_state::empty) {
        n_used_++;
    }
    e.layer      = layer;
    e.expert     = expert;
    e.state      = slot_state::loading;
    e.prefetched = false;
    slot_of[(size_t) layer*n_expert + expert] = s;
}

void slot_table::loaded(int s) {
    slot_entry & e = at(s);
    GGML_ASSERT(e.state == slot_state::loading && "a read finished into a slot that was not loading");
    e.state = slot_state::ready;
}

void slot_table::drop_read(int s) {
    slot_entry & e = at(s);
    GGML_ASSERT(e.state == slot_state::loading && "a read was dropped from a slot that was not loading");
    e.state = slot_state::unread;
}

void slot_table::read_again(int s) {
    slot_entry & e = at(s);
    GGML_ASSERT(e.state == slot_state::unread && "a slot was read again that was not unread");
    e.state      = slot_state::loading;
    e.prefetched = false;
}

void slot_table::clear(int s) {
    slot_entry & e = at(s);
    if (e.layer >= 0) {
        slot_of[(size_t) e.layer*n_expert + e.expert] = -1;
    }
    if (e.state != slot_state::empty) {
        n_used_--;
    }
    const int pins = e.pins;
    e = slot_entry{};
    e.pins = pins;
}

void slot_table::pin(int s) {
    at(s).pins++;
}

void slot_table::unpin(int s) {
    slot_entry & e = at(s);
    GGML_ASSERT(e.pins > 0 && "a slot was unpinned more often than pinned");
    e.pins--;
}

void slot_table::set_prefetched(int s, bool prefetched) {
    at(s).prefetched = prefetched;
}

void slot_table::set_background_graph(int s, int64_t graph) {
    at(s).background_graph = graph;
}
