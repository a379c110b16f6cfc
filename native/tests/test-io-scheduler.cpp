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
