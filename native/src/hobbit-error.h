// hobbit-error.h - the exception the runtime throws inside C++ and turns into a
// hobbit_status at the C boundary.
#pragma once

#include "hobbit.h"

#include <atomic>
#include <mutex>
#include <stdexcept>
#include <string>

struct hobbit_error : std::runtime_error {
    hobbit_status status;
    hobbit_error(hobbit_status status, const std::string & msg) : std::runtime_error(msg), status(status) {}
};

// the first failure of a run, kept: set from any thread (an I/O thread's failed read, the compute
// thread's checks), read without a lock by every wait's predicate
class run_failure {
public:
    void set(const std::string & why) { // the first one sticks
        std::lock_guard<std::mutex> lock(mtx);
        if (!failed_.load()) {
            msg = why;
            failed_.store(true, std::memory_order_release);
        }
    }
    bool failed() const { return failed_.load(std::memory_order_acquire); }
    std::string message() const {
        std::lock_guard<std::mutex> lock(mtx);
        return msg;
    }
    void clear() {
        std::lock_guard<std::mutex> lock(mtx);
        msg.clear();
        failed_.store(false);
    }

private:
    std::atomic<bool>  failed_{false};
    mutable std::mutex mtx; // guards msg; taken last, around nothing else
    std::string        msg;
};
