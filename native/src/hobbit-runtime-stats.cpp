// hobbit-runtime-stats.cpp - what the runtime reports: its counters and each pool's, the error of a failed run,
// and the routing trace it records.

#include "hobbit-runtime.h"

#include "hobbit-error.h"
#include "hobbit-neuron-reads.h"
#include "hobbit-substitution.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cfloat>
#include <chrono>
#include <climits>
#include <cstdint>
#include <cmath>
#include <cstring>
#include <map>
#include <numeric>

void hobbit_runtime::fail(const std::string & msg) {
    failure.set(msg);
}

hobbit_stats hobbit_runtime::stats() const {
    const cache_counters c = cache->counters();
    std::lock_guard<std::mutex> lock(mtx);
    hobbit_stats s = stats_;
    c.write_to(s);
    return s;
}

void hobbit_runtime::reset_stats() {
    const int64_t used = used_pool_bytes();
    cache->reset_counters();
    std::lock_guard<std::mutex> lock(mtx);
    const hobbit_stats keep = stats_;
    stats_ = {};
    stats_.budget_bytes    = keep.budget_bytes;
    stats_.pool_bytes      = keep.pool_bytes;
    stats_.n_slot          = keep.n_slot;
    stats_.direct_io       = keep.direct_io;
    stats_.n_level         = keep.n_level;
    stats_.mode            = keep.mode;
    stats_.load_bytes_per_s = keep.load_bytes_per_s;
    stats_.map_bytes_per_s = keep.map_bytes_per_s;
    stats_.peak_pool_bytes = used;
}

bool hobbit_runtime::error(std::string & msg) const {
    msg = failure.message();
    if (!failure.failed() && files.faulted()) {
        msg = files.fault();
        return true;
    }
    return failure.failed();
}

void hobbit_runtime::clear_error() {
    failure.clear();
    // a fault left zero pages in the mapping: the file's own pages again (where it is whole now,
    // the next run reads the model; where it is still cut, the size check or the guard fails it)
    files.restore();
}

bool hobbit_runtime::pool_stats(int pool, hobbit_pool_stats & out) const {
    cache_pool_counters c;
    if (!cache->pool_counters(pool, c)) {
        return false;
    }
    out = {};
    out.hits         = c.hits;
    out.misses       = c.misses;
    out.bytes_read   = c.bytes_read;
    out.expert_bytes = c.expert_bytes;
    out.n_slot       = c.n_slot;
    out.n_layer      = c.n_layer;
    out.level        = c.level;
    out.type         = c.type;
    return true;
}

void hobbit_runtime::trace_begin(int lookahead, bool keep_inputs) {
    if (lookahead < 0 || lookahead > 4) {
        throw hobbit_error(HOBBIT_STATUS_ERROR_INVALID, "trace lookahead must be 0..4, got " + std::to_string(lookahead));
    }
    std::vector<router_weights> routers;
    if (lookahead > 0 && files.model() != nullptr) {
        routers = load_routers(files.model(), plan.moe_layers);
    }
    auto rec = std::make_unique<trace_recorder>(plan.moe_layers, levels.index.info.n_expert, levels.index.info.n_expert_used,
                                                levels.index.info.n_embd, lookahead, std::move(routers), keep_inputs);
    std::lock_guard<std::mutex> lock(mtx);
    recorder = std::move(rec);
}

int64_t hobbit_runtime::trace_size(int & n_moe_layer, int & lookahead) const {
    std::lock_guard<std::mutex> lock(mtx);
    n_moe_layer = (int) plan.moe_layers.size();
    lookahead = recorder ? recorder->lookahead() : 0;
    return recorder ? recorder->n_tokens() : 0;
}

void hobbit_runtime::trace_copy(int64_t n, int32_t * experts, float * weights, float * probs, int32_t * predicted,
                                float * inputs) const {
    std::lock_guard<std::mutex> lock(mtx);
    if (recorder) {
        recorder->copy(std::min(n, recorder->n_tokens()), experts, weights, probs, predicted, inputs);
    }
}

void hobbit_runtime::trace_end() {
    std::lock_guard<std::mutex> lock(mtx);
    recorder.reset();
}

void hobbit_runtime::new_sequence() {
    cache->new_sequence();
}
