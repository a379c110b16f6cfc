// test-executor-choice.cpp - native unit tests: Algorithm 2's split of a wave's misses.
#include "test-common.h"

#include "hobbit-executor-choice.h"

void test_balance_misses() {
    const auto miss = [](int n_tokens, double load_s, double in_place_s) {
        miss_cost c;
        c.n_tokens = n_tokens;
        c.load_s = load_s;
        c.in_place_s = in_place_s;
        return c;
    };
    // Algorithm 2's walk: batches 9, 5, 3, 2, 1 (given out of order), every load 1 s, in place 1.5 s
    // (a cold read through the mapping, slower than a load): load 9 (C_load 1 > 0), in place 1
    // (1.5), load 5 (2 > 1.5), in place 2 (3), load 3 (3 <= 3 goes to the load side)
    std::vector<bool> s = balance_misses({ miss(3, 1, 1.5), miss(9, 1, 1.5), miss(1, 1, 1.5), miss(5, 1, 1.5),
                                           miss(2, 1, 1.5) });
    CHECK(s == std::vector<bool>({ false, false, true, false, true }));
    // an expert the page cache holds costs nothing in place and runs there; the rest as before
    s = balance_misses({ miss(1, 1, 0.0), miss(4, 1, 1), miss(1, 1, 1) });
    CHECK(s == std::vector<bool>({ true, false, true }));
    // a decode token's two misses: one each way; one miss alone: loaded (it is worth its slot)
    CHECK(balance_misses({ miss(1, 1, 1), miss(1, 1, 1) }) == std::vector<bool>({ false, true }));
    CHECK(balance_misses({ miss(1, 1, 1) }) == std::vector<bool>({ false }));
    CHECK(balance_misses({}).empty());
    // the latency model's costs: a load at its bandwidth, in place only what is not resident
    executor_choice c;
    c.load_bytes_per_s = 1e9;
    c.map_bytes_per_s  = 5e8;
    const miss_cost m = c.cost(3, 1000000000, 0.75);
    CHECK(m.n_tokens == 3 && std::fabs(m.load_s - 1.0) < 1e-9 && std::fabs(m.in_place_s - 0.5) < 1e-9);
    printf("ok balance_misses\n");
}
