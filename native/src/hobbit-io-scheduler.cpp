#include "hobbit-io-scheduler.h"

#include "hobbit-error.h"

#include "ggml-backend.h"

#include <algorithm>
#include <chrono>
#include <system_error>

io_scheduler::io_scheduler(std::vector<const expert_index *> indexes, bool direct_io, int n_threads, done_fn on_done,
                           ggml_backend_buffer_type_t pinned, int n_row_threads)
        : indexes(std::move(indexes)), on_done(std::move(on_done)) {
    n_expert_readers = std::max(1, n_threads);
    stores.resize(n_expert_readers + std::max(0, n_row_threads));
    for (size_t i = 0; i < stores.size(); ++i) {
        const bool row_reader = (int) i >= n_expert_readers;
        for (const expert_index * index : this->indexes) {
            stores[i].push_back(std::make_unique<expert_store>(*index, direct_io, pinned,
                                                               row_reader ? HOBBIT_ROW_READ_BYTES : 0));
        }
    }
    try {
        for (size_t i = 0; i < stores.size(); ++i) {
            workers.emplace_back([this, s = &stores[i], rows_only = (int) i >= n_expert_readers] { loop(*s, rows_only); });
        }
    } catch (const std::system_error & e) {
        // a thread could not start (address space, thread limits): the ones started must be
        // joined before this throws, or their std::thread destructors terminate the process
        const size_t started = workers.size();
        stop_workers();
        throw hobbit_error(HOBBIT_STATUS_ERROR_INTERNAL, "cannot start I/O thread " + std::to_string(started + 1) +
            " of " + std::to_string(stores.size()) + " (" + e.what() + "); use fewer io_threads or row readers");
    }
}

void io_scheduler::stop_workers() {
    {
        std::lock_guard<std::mutex> lock(mtx);
        closing = true;
        on_demand.clear();
        rows.clear();
        prefetches.clear();
    }
    cv.notify_all();
    for (auto & w : workers) {
        w.join();
    }
    workers.clear();
}

io_scheduler::~io_scheduler() {
    stop_workers();
}

static int64_t now_us() {
    return std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

void io_scheduler::submit(const std::vector<load_task> & tasks) {
    {
        std::lock_guard<std::mutex> lock(mtx);
        for (const load_task & task : tasks) {
            auto ld = std::make_shared<load>();
            ld->task = task;
            n_background += task.prefetch ? 1 : 0;
            std::deque<piece> & q = task.prefetch ? prefetches : on_demand;
            const expert_layer_layout & layer = indexes[task.level]->layers[task.layer];
            const auto push_range = [&](std::deque<piece> & q, uint64_t piece_bytes, int p, uint64_t begin, uint64_t end,
                                        char * to) {
                for (uint64_t b = begin; b < end; b += piece_bytes) {
                    q.push_back({ ld, p, b, std::min(end, b + piece_bytes), to + (b - begin), false });
                    ld->pieces_left++;
                }
                ld->n_bytes += end - begin;
            };
            const bool to_row_readers = !task.prefetch && (int) stores.size() > n_expert_readers;
            for (const load_range & r : task.ranges) {
                if (to_row_readers) {
                    push_range(rows, HOBBIT_ROW_READ_BYTES, r.proj, r.begin, r.end, (char *) r.to);
                } else {
                    push_range(q, PIECE_BYTES, r.proj, r.begin, r.end, (char *) r.to);
                }
            }
            for (int p = 0; p < LLAMA_MOE_PROJ_COUNT && task.ranges.empty(); ++p) {
                if (task.view[p] != nullptr) {
                    q.push_back({ ld, p, 0, 0, nullptr, true });
                    ld->pieces_left++;
                    ld->n_bytes += layer.proj[p].n_bytes;
                } else if (layer.proj[p].present && task.dst[p] != nullptr) {
                    push_range(q, PIECE_BYTES, p, 0, layer.proj[p].n_bytes, (char *) task.dst[p]);
                }
            }
            if (ld->pieces_left == 0) {
                q.push_back({ ld, 0, 0, 0, nullptr, false }); // nothing to read: completes at once
                ld->pieces_left = 1;
            }
        }
    }
    cv.notify_all();
}

std::deque<load_task> io_scheduler::drop_prefetches(const std::function<bool(const load_task &)> & pred) {
    std::deque<load_task> dropped;
    std::lock_guard<std::mutex> lock(mtx);
    // a prefetch can go only while none of its pieces has started; a load's pieces are
    // queued one after the other, so each dropped load is reported once
    const load * last = nullptr;
    for (auto it = prefetches.begin(); it != prefetches.end();) {
        const std::shared_ptr<load> ld = it->ld;
        if (!ld->started && pred(ld->task)) {
            if (ld.get() != last) {
                dropped.push_back(ld->task);
                last = ld.get();
                n_background--;
            }
            it = prefetches.erase(it);
        } else {
            ++it;
        }
    }
    return dropped;
}

int io_scheduler::background_in_flight() {
    std::lock_guard<std::mutex> lock(mtx);
    return n_background;
}

void io_scheduler::loop(level_stores & stores, bool rows_only) {
    for (;;) {
        piece pc;
        {
            std::unique_lock<std::mutex> lock(mtx);
            cv.wait(lock, [&] {
                return closing || !rows.empty() || (!rows_only && (!on_demand.empty() || !prefetches.empty()));
            });
            if (closing) {
                return;
            }
            // a row reader takes rows only (its buffer is small); an expert reader takes what a layer
            // waits for first, whole slices before rows (row readers are there for those)
            std::deque<piece> & q = rows_only || (on_demand.empty() && !rows.empty()) ? rows
                                  : on_demand.empty() ? prefetches : on_demand;
            pc = q.front();
            q.pop_front();
            if (!pc.ld->started) {
                pc.ld->started = true;
                pc.ld->t_start_us = now_us();
            }
        }

        // blocking read, outside the lock: submits, drops and the other readers go on meanwhile
        load & ld = *pc.ld;
        const load_task & task = ld.task;
        expert_store & store = *stores[task.level];
        std::string error;
        try {
            if (pc.whole) {
                // the buffer repacks the raw slice into the slot as it is set, or copies it to
                // device memory (CUDA: on this thread's own stream, so the copy overlaps the
                // compute stream, from the page-locked staging: disk -> pinned -> device)
                ggml_backend_tensor_set(task.view[pc.proj], store.read_slice(task.layer, task.expert, pc.proj), 0,
                                        ggml_nbytes(task.view[pc.proj]));
            } else if (pc.end > pc.begin) {
                store.read_piece(task.layer, task.expert, pc.proj, pc.begin, pc.end, pc.to);
            }
        } catch (const std::exception & e) {
            error = e.what();
        }

        bool last = false;
        int64_t us = 0;
        {
            std::lock_guard<std::mutex> lock(mtx);
            if (!error.empty() && ld.error.empty()) {
                ld.error = error;
            }
            last = --ld.pieces_left == 0;
            us = now_us() - ld.t_start_us;
            n_background -= (last && task.prefetch) ? 1 : 0;
        }
        if (last) {
            on_done(task, ld.error, ld.error.empty() ? ld.n_bytes : 0, us);
        }
    }
}
