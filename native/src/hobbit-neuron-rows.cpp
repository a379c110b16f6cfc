#include "hobbit-neuron-rows.h"

#include <algorithm>
#include <cstdlib>
#include <new>

// the pages on a memory page: a run of pages is then aligned as O_DIRECT wants its memory (a
// neuron layout's pages are multiples of 512 bytes), and the readers read straight into it
static uint8_t * page_aligned_arena(size_t bytes) {
    constexpr size_t PAGE = 4096;
    void * p = std::aligned_alloc(PAGE, (bytes + PAGE - 1) / PAGE * PAGE);
    if (p == nullptr) {
        throw std::bad_alloc();
    }
    return (uint8_t *) p;
}

neuron_row_cache::neuron_row_cache(int n_ff, uint64_t row_bytes, int64_t n_page, int bridge)
        : n_ff_(n_ff), row_bytes_(row_bytes), n_page_(n_page), n_free_(n_page), bridge_(bridge),
          arena(page_aligned_arena((size_t) 2 * n_page * row_bytes)), // pages are touched only when read into
          free_words((size_t) (n_page + 63) / 64, ~uint64_t(0)) {
    if (n_page % 64 != 0) {
        free_words.back() = (uint64_t(1) << (n_page % 64)) - 1;
    }
}

const int32_t * neuron_row_cache::pages(int64_t owner) const {
    const auto it = entries.find(owner);
    return it == entries.end() || it->second.n_held == 0 ? nullptr : it->second.page.data();
}

void neuron_row_cache::bridge_gaps(neuron_bits & missing, const int32_t * held) const {
    int last = -1; // the last missing row seen
    for (int f = 0; f < n_ff_; ++f) {
        if (!missing.test(f)) {
            continue;
        }
        const int gap = f - last - 1;
        if (last >= 0 && gap > 0 && gap <= bridge_) {
            bool free_gap = true;
            for (int g = last + 1; g < f && held; ++g) {
                free_gap &= held[g] < 0;
            }
            for (int g = last + 1; g < f && free_gap; ++g) {
                missing.set(g);
            }
        }
        last = f;
    }
}

bool neuron_row_cache::plan_rows(const std::map<int64_t, neuron_bits> & need, neuron_rows_plan & plan) const {
    plan = {};
    int64_t n_new = 0;
    for (const auto & [owner, rows] : need) {
        plan.used.push_back(owner);
        neuron_bits missing = rows;
        const auto it = entries.find(owner);
        if (it != entries.end()) {
            for (int f = 0; f < n_ff_; ++f) {
                if (it->second.page[f] >= 0) {
                    missing.reset(f);
                }
            }
        }
        bridge_gaps(missing, it == entries.end() ? nullptr : it->second.page.data());
        const int n = missing.count();
        if (n > 0) {
            n_new += n;
            plan.reads.emplace_back(owner, std::move(missing));
        }
    }
    if (n_new <= n_free_) {
        return true;
    }
    // the rows of the least recently used owners outside the pass go until the new ones fit
    std::vector<std::pair<int64_t, int64_t>> candidates; // (last use, owner)
    for (const auto & [owner, e] : entries) {
        if (e.n_held > 0 && need.count(owner) == 0) {
            candidates.emplace_back(e.last_use, owner);
        }
    }
    std::sort(candidates.begin(), candidates.end());
    int64_t room = n_free_;
    for (const auto & [last_use, owner] : candidates) {
        if (room >= n_new) {
            break;
        }
        plan.evict.push_back(owner);
        room += entries.at(owner).n_held;
    }
    if (room < n_new) {
        plan = {};
        return false;
    }
    return true;
}

void neuron_row_cache::drop(entry & e) {
    for (int32_t & p : e.page) {
        if (p >= 0) {
            free_words[(size_t) p >> 6] |= uint64_t(1) << (p & 63);
            free_hint = std::min(free_hint, (size_t) p >> 6);
            p = -1;
        }
    }
    n_free_ += e.n_held;
    e.n_held = 0;
}

int32_t neuron_row_cache::take_page() {
    while (free_words[free_hint] == 0) {
        free_hint++; // plan_rows made sure a page is free: the scan stops
    }
    uint64_t & w = free_words[free_hint];
    const int bit = __builtin_ctzll(w);
    w &= w - 1;
    n_free_--;
    return (int32_t) (free_hint * 64 + bit);
}

void neuron_row_cache::apply_rows(const neuron_rows_plan & plan, std::vector<neuron_row_run> & runs) {
    for (int64_t owner : plan.evict) {
        drop(entries.at(owner));
    }
    for (const auto & [owner, missing] : plan.reads) {
        entry & e = entries[owner];
        if (e.page.empty()) {
            e.page.assign(n_ff_, -1);
        }
        for (int f = 0; f < n_ff_; ++f) {
            if (!missing.test(f)) {
                continue;
            }
            const int32_t p = take_page();
            e.page[f] = p;
            e.n_held++;
            neuron_row_run * last = runs.empty() ? nullptr : &runs.back();
            if (last && last->owner == owner && last->first + last->count == f && last->first_page + last->count == p) {
                last->count++;
            } else {
                runs.push_back({ owner, f, 1, p });
            }
        }
    }
    for (int64_t owner : plan.used) {
        const auto it = entries.find(owner); // an owner that needed no rows has none to keep
        if (it != entries.end()) {
            it->second.last_use = ++tick;
        }
    }
}

bool neuron_rows_split(int64_t bytes, int64_t gate_bytes, int n_ff, uint64_t row_bytes, int n_min, int n_max,
                       int & n_gate_slot, int64_t & n_page) {
    const int64_t rows_bytes = 2 * (int64_t) n_ff * (int64_t) row_bytes; // an expert's up and down, whole
    if (bytes < (int64_t) n_min * (gate_bytes + rows_bytes)) {
        return false;
    }
    // the pages must hold the top-k's rows whole; the gates get the rest
    int64_t n_gate = (bytes - (int64_t) n_min * rows_bytes) / gate_bytes;
    n_gate = std::max<int64_t>(n_min, std::min<int64_t>(n_gate, n_max));
    n_page = std::min<int64_t>((bytes - n_gate * gate_bytes) / (2 * (int64_t) row_bytes), (int64_t) n_max * n_ff);
    n_gate_slot = (int) n_gate;
    return true;
}
