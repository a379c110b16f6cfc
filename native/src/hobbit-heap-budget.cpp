// hobbit-heap-budget.cpp - a bound on what one thread's Python code may allocate while a
// budget is open (a chat template rendering, say).
//
// Python has no memory limit per piece of code, and one C call of a template (`'x'|center(n)`,
// a `join`, a `%` format) can ask for gigabytes before any line-level deadline sees it. Every
// Python block over 512 bytes (strings, lists, integers, the buffers that grow them) comes
// from the raw allocator domain; its allocator is wrapped here, so that while this thread has
// a budget open, the bytes it asks for are counted and a request that would pass the budget
// gets NULL, which Python raises as MemoryError. Requests of a page or less always pass: the
// interpreter needs them to raise that error and unwind.
//
// What is counted is the bytes asked for, not the bytes kept (a free cannot be attributed
// without the block's size): churn counts, so a budget is set well above what a legitimate
// render keeps. Other threads, and this one with no budget open, pass straight through.

#include "hobbit.h"

#include <cstdint>

namespace {

hobbit_raw_allocator previous;

thread_local bool budget_open = false;
thread_local int64_t budget_left = 0;
thread_local bool refused = false;

constexpr size_t always_granted = 4096;

bool admit(size_t n) {
    if (!budget_open) {
        return true;
    }
    if (n > always_granted && (int64_t) n > budget_left) {
        refused = true;
        return false;
    }
    budget_left -= (int64_t) n;
    return true;
}

void * budget_malloc(void *, size_t n) {
    return admit(n) ? previous.malloc(previous.ctx, n) : nullptr;
}

void * budget_calloc(void *, size_t count, size_t size) {
    size_t n = 0;
    if (__builtin_mul_overflow(count, size, &n)) {
        return budget_open ? nullptr : previous.calloc(previous.ctx, count, size);
    }
    return admit(n) ? previous.calloc(previous.ctx, count, size) : nullptr;
}

void * budget_realloc(void *, void * p, size_t n) {
    return admit(n) ? previous.realloc(previous.ctx, p, n) : nullptr;
}

void budget_free(void *, void * p) {
    previous.free(previous.ctx, p);
}

}  // namespace

extern "C" {

void hobbit_heap_budget_wrap(const hobbit_raw_allocator * current, hobbit_raw_allocator * wrapped) {
    // wrapping the wrapper would recurse without end: a second install keeps the first's
    if (current->malloc != budget_malloc) {
        previous = *current;
    }
    *wrapped = {nullptr, budget_malloc, budget_calloc, budget_realloc, budget_free};
}

void hobbit_heap_budget_open(int64_t bytes) {
    budget_left = bytes;
    refused = false;
    budget_open = true;
}

bool hobbit_heap_budget_close(void) {
    budget_open = false;
    return refused;
}

}
