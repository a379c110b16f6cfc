// test-io-scheduler.cpp - native unit tests: the I/O threads' queue.
#include "test-common.h"

#include "hobbit-io-scheduler.h"
#include "hobbit-expert-store.h"

// on-demand loads overtake queued prefetches, and every load lands its exact bytes
void test_scheduler(const std::string & path) {
    expert_index idx = expert_index::from_file(path);
    std::mutex mtx;
    std::condition_variable cv;
    std::vector<int> done_order;
    std::vector<std::vector<std::vector<uint8_t>>> bufs(8, std::vector<std::vector<uint8_t>>(3));
    {
        io_scheduler io({ &idx }, /*direct_io*/ false, /*n_threads*/ 1, [&](const load_task & t, const std::string & err, uint64_t, int64_t) {
            CHECK(err.empty());
            std::lock_guard<std::mutex> lock(mtx);
            done_order.push_back(t.slot);
            cv.notify_all();
        });
        std::vector<load_task> tasks;
        for (int i = 0; i < 8; ++i) {
            load_task t = { 0, /*level*/ 0, i, i < 4 ? 0 : 2, i % N_EXPERT, /*prefetch*/ i < 7, {}, {}, {} };
            for (int p = 0; p < 3; ++p) {
                bufs[i][p].resize(idx.layers[t.layer].proj[p].n_bytes);
                t.dst[p] = bufs[i][p].data();
            }
            tasks.push_back(t);
        }
        io.submit(tasks);
        std::unique_lock<std::mutex> lock(mtx);
        cv.wait(lock, [&] { return done_order.size() == 8; });
    }
    // queued together, the on-demand load (slot 7) goes first
    int pos = -1;
    for (size_t i = 0; i < done_order.size(); ++i) {
        if (done_order[i] == 7) pos = (int) i;
    }
    CHECK(pos == 0);
    for (int i = 0; i < 8; ++i) {
        check_expert_bytes(bufs[i], i < 4 ? 0 : 2, i % N_EXPERT);
    }
    printf("ok scheduler (on-demand completed at position %d of 8)\n", pos);
}

// a queued background load expedited goes before the background loads queued ahead of it, behind the on-demand
// ones, and still lands its exact bytes; the load running when it was expedited finishes first
void test_scheduler_expedite(const std::string & path) {
    expert_index idx = expert_index::from_file(path);
    std::mutex mtx;
    std::condition_variable cv;
    std::vector<int> done_order;
    bool first_done = false, go_on = false;
    constexpr int N = 7;
    std::vector<std::vector<std::vector<uint8_t>>> bufs(N, std::vector<std::vector<uint8_t>>(3));
    int n_moved = 0;
    {
        // the I/O thread holds at the first load's completion until the others are queued and expedited
        io_scheduler io({ &idx }, /*direct_io*/ false, /*n_threads*/ 1, [&](const load_task & t, const std::string & err, uint64_t, int64_t) {
            CHECK(err.empty());
            std::unique_lock<std::mutex> lock(mtx);
            done_order.push_back(t.slot);
            first_done = true;
            cv.notify_all();
            cv.wait(lock, [&] { return go_on; });
        });
        // slots 0-5 background loads, 6 on demand; 0 submitted alone first, so that it runs before the rest is queued
        std::vector<load_task> tasks;
        for (int i = 0; i < N; ++i) {
            load_task t = { 0, /*level*/ 0, i, i % 2 == 0 ? 0 : 2, i % N_EXPERT, /*prefetch*/ i < 6, {}, {}, {} };
            for (int p = 0; p < 3; ++p) {
                bufs[i][p].resize(idx.layers[t.layer].proj[p].n_bytes);
                t.dst[p] = bufs[i][p].data();
            }
            tasks.push_back(t);
        }
        io.submit({ tasks[0] });
        {
            std::unique_lock<std::mutex> lock(mtx);
            cv.wait(lock, [&] { return first_done; });
        }
        io.submit(std::vector<load_task>(tasks.begin() + 1, tasks.end()));
        n_moved = io.expedite([](const load_task & t) { return t.slot == 4 || t.slot == 0; }); // 0 has run
        CHECK(io.background_in_flight() == 5); // still background loads
        {
            std::lock_guard<std::mutex> lock(mtx);
            go_on = true;
        }
        cv.notify_all();
        std::unique_lock<std::mutex> lock(mtx);
        cv.wait(lock, [&] { return done_order.size() == N; });
    }
    CHECK(n_moved == 1);
    CHECK((done_order == std::vector<int>{ 0, 6, 4, 1, 2, 3, 5 }));
    for (int i = 0; i < N; ++i) {
        check_expert_bytes(bufs[i], i % 2 == 0 ? 0 : 2, i % N_EXPERT);
    }
    printf("ok scheduler: an expedited background load goes before the others\n");
}
