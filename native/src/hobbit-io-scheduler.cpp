#include "hobbit-io-scheduler.h"

#include "hobbit-error.h"

#include "ggml-backend.h"

#include <algorithm>
#include <chrono>

io_scheduler::io_scheduler(const expert_index & index, bool direct_io, int n_threads, done_fn on_done)
        : index(index), on_done(std::move(on_done)) {
    for (int i = 0; i < std::max(1, n_threads); ++i) {
        stores.push_back(std::make_unique<expert_store>(index, direct_io));
    }
    for (auto & store : stores) {
        workers.emplace_back([this, s = store.get()] { loop(*s); });
    }
}

io_scheduler::~io_scheduler() {
    {
        std::lock_guard<std::mutex> lock(mtx);
        closing = true;
        on_demand.clear();
        prefetches.clear();
    }
    cv.notify_all();
    for (auto & w : workers) {
        w.join();
    }
}

void io_scheduler::submit(const std::vector<load_task> & tasks) {
    {
        std::lock_guard<std::mutex> lock(mtx);
        for (const load_task & task : tasks) {
            (task.prefetch ? prefetches : on_demand).push_back(task);
        }
    }
    cv.notify_one();
}

std::deque<load_task> io_scheduler::drop_prefetches(const std::function<bool(const load_task &)> & pred) {
    std::deque<load_task> dropped;
    std::lock_guard<std::mutex> lock(mtx);
    for (auto it = prefetches.begin(); it != prefetches.end();) {
        if (pred(*it)) {
            dropped.push_back(*it);
            it = prefetches.erase(it);
        } else {
            ++it;
        }
    }
    return dropped;
}

void io_scheduler::loop(expert_store & store) {
    for (;;) {
        load_task task;
        {
            std::unique_lock<std::mutex> lock(mtx);
            cv.wait(lock, [this] { return closing || !on_demand.empty() || !prefetches.empty(); });
            if (closing) {
                return;
            }
            std::deque<load_task> & q = on_demand.empty() ? prefetches : on_demand;
            task = q.front();
            q.pop_front();
        }

        // blocking read, outside the lock: submits and drops go on meanwhile
        const auto t0 = std::chrono::steady_clock::now();
        std::string error;
        try {
            store.read_expert(task.layer, task.expert, task.dst);
            for (int p = 0; p < LLAMA_MOE_PROJ_COUNT; ++p) {
                if (task.view[p] != nullptr) {
                    // the buffer repacks the raw slice into the slot as it is set
                    ggml_backend_tensor_set(task.view[p], store.read_slice(task.layer, task.expert, p), 0, ggml_nbytes(task.view[p]));
                }
            }
        } catch (const std::exception & e) {
            error = e.what();
        }
        const int64_t us = std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now() - t0).count();
        on_done(task, error, error.empty() ? index.layers[task.layer].n_bytes() : 0, us);
    }
}
