#include "hobbit-neuron-sim-cache.h"

#include <algorithm>
#include <stdexcept>

neuron_sim_cache::neuron_sim_cache(int n_layer, int n_expert, int n_neuron, int64_t neuron_bytes, int64_t budget_bytes,
                                   double limit)
        : n_layer(n_layer), n_expert(n_expert), n_neuron(n_neuron), neuron_bytes(neuron_bytes),
          budget_bytes(budget_bytes), limit(limit) {
    if (n_layer < 1 || n_expert < 1 || n_neuron < 1 || neuron_bytes < 1 || !(limit >= 0.0 && limit <= 1.0)) {
        throw std::invalid_argument("neuron_sim_cache: bad shape or limit");
    }
}

int64_t neuron_sim_cache::bytes_of(const neuron_bits & w1, const neuron_bits & rest) const {
    return ((int64_t) w1.count() + 2 * (int64_t) rest.count()) * neuron_bytes;
}

void neuron_sim_cache::begin_step() {
    step++;
}

neuron_sim_plan neuron_sim_cache::plan_access(int layer, int expert, const neuron_need & need) const {
    neuron_sim_plan p;
    p.layer = layer;
    p.expert = expert;
    const int64_t key = (int64_t) layer * n_expert + expert;
    // over the limit the whole expert: CORM reads it in one request rather than most of it in pieces
    p.whole = need.rest.count() > limit * n_neuron;
    const neuron_bits all(n_neuron, true);
    const neuron_bits & want_w1 = p.whole ? all : need.w1;
    const neuron_bits & want_rest = p.whole ? all : need.rest;
    const auto it = entries.find(key);
    p.hit = it != entries.end();
    if (p.hit) {
        p.read_w1 = minus(want_w1, it->second.w1);
        p.read_rest = minus(want_rest, it->second.rest);
    } else {
        p.read_w1 = want_w1;
        p.read_rest = want_rest;
    }
    p.read_bytes = bytes_of(p.read_w1, p.read_rest);
    p.n_requests = p.read_w1.runs() + 2 * p.read_rest.runs();
    // room: the least recently used experts the step has not pinned go first
    int64_t need_bytes = used + p.read_bytes - budget_bytes;
    if (need_bytes > 0) {
        std::vector<std::pair<int64_t, int64_t>> order;  // (last use, key)
        for (const auto & [k, e] : entries) {
            if (k != key && e.step != step) {
                order.emplace_back(e.last_use, k);
            }
        }
        std::sort(order.begin(), order.end());
        for (const auto & [last, k] : order) {
            if (need_bytes <= 0) {
                break;
            }
            p.evict.push_back(k);
            const entry & e = entries.at(k);
            need_bytes -= bytes_of(e.w1, e.rest);
        }
    }
    return p;
}

void neuron_sim_cache::apply(const neuron_sim_plan & p) {
    for (int64_t k : p.evict) {
        const entry & e = entries.at(k);
        used -= bytes_of(e.w1, e.rest);
        entries.erase(k);
    }
    const int64_t key = (int64_t) p.layer * n_expert + p.expert;
    auto it = entries.find(key);
    if (it == entries.end()) {
        it = entries.emplace(key, entry{ neuron_bits(n_neuron), neuron_bits(n_neuron), 0, -1 }).first;
    }
    join(it->second.w1, p.read_w1);
    join(it->second.rest, p.read_rest);
    used += p.read_bytes;
    it->second.last_use = ++tick;
    it->second.step = step;
}
