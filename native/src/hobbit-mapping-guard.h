// hobbit-mapping-guard.h - a SIGBUS in the mapped model file becomes an error, not a crash.
//
// llama.cpp maps the model file: its resident weights, and the experts computed in place, are
// read from the mapping. If the file is cut while the process runs, a read past its new end
// raises SIGBUS, which kills the process (the runtime checks the size before each ubatch and
// before an expert runs in place, but the file can shrink after the check).
// While a guard lives, a SIGBUS inside its region maps a page of zeros over the faulting
// page, so the computation finishes (on zeros), and marks the guard faulted; the runtime
// then fails the run (ExpertReadError) before anything uses the result; restore() maps the
// file back over the region once the run's error is cleared. A SIGBUS anywhere else goes to
// the handler that was there before.
#pragma once

#include <cstddef>
#include <cstdint>

class mapping_guard {
public:
    // throws hobbit_error when every slot is taken (HOBBIT_MAX_GUARDS live guards)
    mapping_guard(const void * begin, size_t size);
    ~mapping_guard();
    mapping_guard(const mapping_guard &) = delete;
    mapping_guard & operator=(const mapping_guard &) = delete;

    bool faulted() const;

    // the pages a fault replaced by zeros mapped again from the file (read-only, shared, as
    // llama.cpp maps it, advised with advice): the file's pages come back. fd: the file;
    // file_offset: where the region's first byte lies in it. Returns false (still faulted) if
    // the mapping fails. Call it only while nothing reads the region.
    bool restore(int fd, uint64_t file_offset, int advice);

private:
    int slot;
};
