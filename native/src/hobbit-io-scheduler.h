// hobbit-io-scheduler.h - I/O threads draining one priority queue of expert loads.
//
// On-demand loads (a layer is waiting for them) go before prefetches; within a class,
// first come first served. Each load is cut into pieces of at most PIECE_BYTES that any
// thread may read, so even a single missing expert keeps every reader busy (one read in
// flight per thread, and one thread's bounce-buffer copy overlaps the other's read).
// Neuron rows (a load's ranges) are many small reads: with row readers they go to a queue of
// their own, cut into reads of at most HOBBIT_ROW_READ_BYTES that row readers (a small buffer
// each) take beside the expert readers, so that many are in flight at once (a disk's bandwidth
// for reads of tens of KB needs a queue 8-16 deep; whole-slice buffers cost too much for that).
// A load that has started cannot be cancelled; a queued prefetch can be dropped.
// Completion is reported through a callback on the I/O thread that read the last piece.
#pragma once

#include "hobbit-expert-store.h"

#include "ggml.h"

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

// bytes [begin, end) of projection proj of an expert's slice (a run of neurons' rows), read to
// `to` (a run of the neuron row cache's pages)
struct load_range {
    int      proj;
    uint64_t begin, end;
    void *   to;
};

struct load_task {
    int  group;                             // the pool the slot belongs to
    int  level;                             // precision level: which file the expert is read from
    int  slot;
    int  layer;
    int  expert;
    bool prefetch;                          // false: a dispatch waits for it
    void * dst[LLAMA_MOE_PROJ_COUNT];       // where each raw projection goes (NULL: none, or repacked)
    ggml_tensor * view[LLAMA_MOE_PROJ_COUNT]; // repacked or device projections: the slot's tensor, written with ggml_backend_tensor_set
    std::vector<load_range> ranges;         // not empty: only these bytes (rows of neurons of the expert the slot holds:
                                            // its state does not change), instead of whole projections
};

class io_scheduler {
public:
    // on_done(task, error, n_bytes, us): error is empty on success; called on the I/O thread
    using done_fn = std::function<void(const load_task &, const std::string & error, uint64_t n_bytes, int64_t us)>;

    // n_threads readers, each with its own handles on every level's file (indexes[level];
    // throws hobbit_error if a file cannot be opened). pinned: the host buffer type of the
    // pools' device when it is not the CPU (slices staged in page-locked memory), or NULL.
    // n_row_threads: readers of on-demand ranges only (neuron rows), with buffers of
    // HOBBIT_ROW_READ_BYTES; 0: the n_threads read ranges too, in pieces of PIECE_BYTES
    io_scheduler(std::vector<const expert_index *> indexes, bool direct_io, int n_threads, done_fn on_done,
                 ggml_backend_buffer_type_t pinned = nullptr, int n_row_threads = 0);
    ~io_scheduler(); // closes: drops queued tasks, finishes the running reads, joins

    bool direct_io() const { return stores.front().front()->direct_io(); }

    // queue loads, all at once (the thread sees none of them before all are queued); does not block
    void submit(const std::vector<load_task> & tasks);

    // drop queued (not started) prefetches for which pred returns true; returns them
    std::deque<load_task> drop_prefetches(const std::function<bool(const load_task &)> & pred);

    // background (prefetch-class) loads queued or being read
    int background_in_flight();

    static constexpr uint64_t PIECE_BYTES = 2u << 20;

private:
    // a load in progress: its task, pieces still unread, the first error
    struct load {
        load_task   task;
        int         pieces_left = 0;
        bool        started     = false;
        std::string error;
        int64_t     t_start_us  = 0;
        uint64_t    n_bytes     = 0; // what the load reads
    };
    // one read of a load: bytes [begin, end) of projection proj to `to` (whole = a repacked
    // projection, set through ggml in one piece)
    struct piece {
        std::shared_ptr<load> ld;
        int      proj;
        uint64_t begin, end;
        void *   to;
        bool     whole;
    };

    using level_stores = std::vector<std::unique_ptr<expert_store>>; // [level]
    void loop(level_stores & stores, bool rows_only);
    void stop_workers(); // closing: drops queued tasks, finishes running reads, joins every started thread

    std::vector<level_stores>          stores;  // one set per thread: the expert readers, then the row readers
    int                                n_expert_readers = 0;
    std::vector<const expert_index *>  indexes; // [level]
    done_fn              on_done;

    std::mutex              mtx;
    std::condition_variable cv;
    std::deque<piece>       on_demand;
    std::deque<piece>       rows;       // on-demand ranges, with row readers: theirs first, the expert readers' after on_demand
    std::deque<piece>       prefetches;
    int                     n_background = 0; // prefetch-class loads submitted and not yet completed
    bool                    closing = false;
    std::vector<std::thread> workers;
};
