// test-slot-table.cpp - native unit tests: the slot table's transitions, and each refused one (it must abort).
#include "test-common.h"

#include "hobbit-slot-table.h"

void test_slot_table() {
    slot_table t(N_LAYER, N_EXPERT, 3);
    CHECK(t.size() == 3 && t.find(2, 1) == -1 && t.n_used() == 0 && t.has_empty());
    t.assign(1, 2, 1);
    CHECK(t.find(2, 1) == 1 && t.n_used() == 1 && t[1].state == slot_state::loading);
    t.loaded(1);
    CHECK(t[1].state == slot_state::ready);
    t.assign(1, 0, 3); // evicts (2, 1)
    CHECK(t.find(2, 1) == -1 && t.find(0, 3) == 1 && t.n_used() == 1);
    // a dropped background read: unread, holding the expert; read again when used
    t.set_prefetched(1, true);
    t.drop_read(1);
    CHECK(t[1].state == slot_state::unread && t.find(0, 3) == 1 && t[1].prefetched);
    t.read_again(1);
    CHECK(t[1].state == slot_state::loading && !t[1].prefetched);
    // a failed load empties the slot and keeps its pins for whoever pinned it
    t.pin(1);
    t.clear(1);
    CHECK(t.find(0, 3) == -1 && t.n_used() == 0 && t[1].state == slot_state::empty && t[1].pins == 1);
    t.unpin(1);
    t.assign(0, 1, 0);
    t.assign(1, 1, 1);
    t.assign(2, 1, 2);
    CHECK(!t.has_empty() && t.n_used() == 3);
    // every transition out of order is refused
    slot_table pinned = t;
    pinned.pin(0);
    CHECK(aborts([&] { pinned.assign(0, 2, 2); }));  // a pinned slot changes owner
    CHECK(aborts([&] { pinned.unpin(1); }));          // unpinned more often than pinned
    CHECK(aborts([&] { pinned.read_again(2); }));     // loading, not unread
    pinned.loaded(2);
    CHECK(aborts([&] { pinned.loaded(2); }));         // ready, not loading
    CHECK(aborts([&] { pinned.drop_read(2); }));      // ready: no read to drop
    CHECK(aborts([&] { pinned.assign(3, 0, 0); }));   // no such slot
    printf("ok slot table\n");
}
