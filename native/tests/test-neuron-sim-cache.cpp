// test-neuron-sim-cache.cpp - native unit tests: the neuron cache simulator.
#include "test-common.h"

#include "hobbit-cache-sim.h"
#include "hobbit-neuron-sim-cache.h"

void test_neuron_sim_cache() {
    const int n = 10;  // neurons; one neuron of one projection is 4 bytes, a whole expert 120
    CHECK(neuron_bits(n, true).count() == 10 && neuron_bits(70, true).count() == 70);
    CHECK(bits(n, { 0, 1, 2, 5, 7, 8 }).runs() == 3);
    neuron_sim_cache c(2, 4, n, 4, 100, 0.75);
    c.begin_step();
    // a cold selection of 3 neurons reads them: 3 rows of W1 + 3 of W3 + 3 columns of W2
    neuron_sim_plan p = c.plan_access(0, 1, { bits(n, { 1, 2, 3 }), bits(n, { 1, 2, 3 }) });
    CHECK(!p.hit && !p.whole && p.read_bytes == 36 && p.n_requests == 3 && p.evict.empty());
    c.apply(p);
    CHECK(c.used_bytes() == 36);
    // the same expert needs 2..5: only 4 and 5 are missing (the union is kept)
    c.begin_step();
    p = c.plan_access(0, 1, { bits(n, { 2, 3, 4, 5 }), bits(n, { 2, 3, 4, 5 }) });
    CHECK(p.hit && p.read_bytes == 24 && p.read_rest.count() == 2);
    c.apply(p);
    CHECK(c.used_bytes() == 60);
    // W1 whole, W3/W2 for two neurons (W1-first): 10 + 2 x 2 neurons
    p = c.plan_access(1, 0, { neuron_bits(n, true), bits(n, { 0, 9 }) });
    CHECK(p.read_bytes == 56 && p.n_requests == 1 + 2 * 2);
    // over the limit (8 of 10 > 0.75): the whole expert, and room made by evicting the least
    // recent expert the step has not pinned; expert (0, 1) was pinned by this step
    const neuron_need most = { bits(n, { 0, 1, 2, 3, 4, 5, 6, 7 }), bits(n, { 0, 1, 2, 3, 4, 5, 6, 7 }) };
    p = c.plan_access(1, 2, most);
    CHECK(p.whole && p.read_bytes == 120 && p.evict.empty());  // nothing may go: it runs over the budget
    c.begin_step();
    p = c.plan_access(1, 2, most);
    CHECK(p.whole && p.evict == std::vector<int64_t>({ 0 * 4 + 1 }));
    c.apply(p);
    CHECK(c.used_bytes() == 120 && c.n_cached() == 1);
    // expert-granular: a limit of 0 reads every selection whole
    neuron_sim_cache whole(1, 4, n, 4, 1000, 0.0);
    whole.begin_step();
    CHECK(whole.plan_access(0, 0, { bits(n, { 1 }), bits(n, { 1 }) }).read_bytes == 120);
    // the replay: one layer, one expert, two tokens needing neurons {0,1} then {1,2}
    const int32_t experts[2] = { 3, 3 };
    const uint8_t need[4] = { 0x03, 0x00, 0x06, 0x00 };  // two bytes a selection for 10 neurons
    const neuron_sim_trace tr = { 2, 1, 4, 1, n, experts, need, need };
    const neuron_sim_result r = neuron_sim_cache_simulate(tr, 4, 1000, 0.75);
    CHECK(r.accesses == 2 && r.bytes_read == (2 + 1) * 12 && r.hits == 0 && r.whole == 0 && r.requests == 6);
    const neuron_sim_result lru = neuron_sim_cache_simulate(tr, 4, 1000, 0.0);
    CHECK(lru.bytes_read == 120 && lru.hits == 1 && lru.whole == 2);
    printf("ok neuron cache\n");
}
