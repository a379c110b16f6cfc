#include "hobbit-mapping-guard.h"

#include "hobbit-error.h"

#include <atomic>
#include <csignal>
#include <cstdint>
#include <mutex>
#include <sys/mman.h>
#include <unistd.h>

namespace {

// the handler may run on any thread at any time: a fixed table of atomics, no allocation,
// no lock (only mmap, which Linux does not mind in a handler)
constexpr int HOBBIT_MAX_GUARDS = 256;

struct guard_slot {
    std::atomic<uintptr_t> begin{0};
    std::atomic<uintptr_t> end{0};  // 0: free
    std::atomic<bool>      faulted{false};
    // the pages replaced by zeros lie in [lo, hi): restore maps back only those
    std::atomic<uintptr_t> lo{UINTPTR_MAX};
    std::atomic<uintptr_t> hi{0};
};

guard_slot       g_slots[HOBBIT_MAX_GUARDS];
struct sigaction g_previous;
std::once_flag   g_installed;
std::mutex       g_claim; // between constructors only

void on_sigbus(int sig, siginfo_t * info, void * uctx) {
    const uintptr_t addr = (uintptr_t) info->si_addr;
    for (guard_slot & s : g_slots) {
        const uintptr_t end = s.end.load(std::memory_order_acquire);
        if (end != 0 && addr >= s.begin.load(std::memory_order_relaxed) && addr < end) {
            const uintptr_t page = (uintptr_t) sysconf(_SC_PAGESIZE);
            void * at = (void *) (addr & ~(page - 1));
            if (mmap(at, page, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0) != MAP_FAILED) {
                // lock-free atomics: safe in a handler, and two threads may fault at once
                uintptr_t lo = s.lo.load(std::memory_order_relaxed);
                while ((uintptr_t) at < lo && !s.lo.compare_exchange_weak(lo, (uintptr_t) at)) {}
                uintptr_t hi = s.hi.load(std::memory_order_relaxed);
                while ((uintptr_t) at + page > hi && !s.hi.compare_exchange_weak(hi, (uintptr_t) at + page)) {}
                s.faulted.store(true, std::memory_order_release);
                return; // the faulting read runs again, on zeros
            }
            break;
        }
    }
    // not ours (or the page could not be replaced): what would have happened without us
    if (g_previous.sa_flags & SA_SIGINFO) {
        g_previous.sa_sigaction(sig, info, uctx);
    } else if (g_previous.sa_handler == SIG_IGN) {
        return;
    } else if (g_previous.sa_handler != SIG_DFL) {
        g_previous.sa_handler(sig);
    } else {
        signal(sig, SIG_DFL); // returning re-executes the faulting read: the default action ends the process
    }
}

void install() {
    struct sigaction sa = {};
    sa.sa_sigaction = on_sigbus;
    sa.sa_flags     = SA_SIGINFO | SA_ONSTACK;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGBUS, &sa, &g_previous);
}

} // namespace

mapping_guard::mapping_guard(const void * begin, size_t size) : slot(-1) {
    std::call_once(g_installed, install);
    std::lock_guard<std::mutex> lock(g_claim);
    for (int i = 0; i < HOBBIT_MAX_GUARDS; ++i) {
        if (g_slots[i].end.load() == 0) {
            slot = i;
            g_slots[i].faulted.store(false);
            g_slots[i].lo.store(UINTPTR_MAX);
            g_slots[i].hi.store(0);
            g_slots[i].begin.store((uintptr_t) begin);
            g_slots[i].end.store((uintptr_t) begin + size, std::memory_order_release);
            return;
        }
    }
    throw hobbit_error(HOBBIT_STATUS_ERROR_INTERNAL, "more than " + std::to_string(HOBBIT_MAX_GUARDS) +
        " models computing experts in place in one process");
}

mapping_guard::~mapping_guard() {
    std::lock_guard<std::mutex> lock(g_claim);
    g_slots[slot].end.store(0, std::memory_order_release);
    g_slots[slot].begin.store(0);
}

bool mapping_guard::faulted() const {
    return g_slots[slot].faulted.load(std::memory_order_acquire);
}

bool mapping_guard::restore(int fd, uint64_t file_offset, int advice) {
    guard_slot & s = g_slots[slot];
    const uintptr_t begin = s.begin.load(), lo = s.lo.load(), hi = s.hi.load();
    if (!s.faulted.load(std::memory_order_acquire) || lo >= hi) {
        return true;
    }
    // only the zeroed pages: the rest of the region is the file's already (and parts of a
    // region may not be mapped at all: llama.cpp unmaps a file's pages no tensor uses)
    if (lo < begin && file_offset < begin - lo) {
        return false; // the first zeroed page would start before the file
    }
    const uint64_t at = file_offset + lo - begin; // the file offset of the first zeroed page (wraps back when lo < begin)
    if (mmap((void *) lo, hi - lo, PROT_READ, MAP_SHARED | MAP_FIXED, fd, (off_t) at) == MAP_FAILED) {
        return false;
    }
    madvise((void *) lo, hi - lo, advice);
    s.lo.store(UINTPTR_MAX);
    s.hi.store(0);
    s.faulted.store(false, std::memory_order_release);
    return true;
}
