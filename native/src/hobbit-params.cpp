// hobbit-params.cpp - the defaults of hobbit_params, the ranges of its numeric fields, and the
// check of a whole struct (hobbit-params.h).
#include "hobbit-params.h"

#include "hobbit-cache-policy.h"

#include <cmath>
#include <cstdio>
#include <iterator>

namespace {

// a field's range and how to read it as a double
struct ranged_field {
    hobbit_param_range range;
    double (*value)(const hobbit_params &);
};

#define HOBBIT_INT_FIELD(field, lo, hi)   { { #field, (lo), (hi), true },  [](const hobbit_params & p) { return (double) p.field; } }
#define HOBBIT_FLOAT_FIELD(field, lo, hi) { { #field, (lo), (hi), false }, [](const hobbit_params & p) { return (double) p.field; } }

const ranged_field RANGED_FIELDS[] = {
    // more than a PiB is a typo, and MB counts past it overflow on their way to bytes
    HOBBIT_INT_FIELD(budget_bytes, 1, 1125899906842624.0),
    // prefetch looks this many layers ahead through the predictor's routers; past a few the guesses are noise
    HOBBIT_INT_FIELD(prefetch_layers, 0, 8),
    HOBBIT_INT_FIELD(prefetch_width, HOBBIT_PREFETCH_WIDTH_FATE, HUGE_VAL),
    HOBBIT_INT_FIELD(shallow_layers, -1, HUGE_VAL),
    HOBBIT_FLOAT_FIELD(prefill_low_share, 0, 1),
    HOBBIT_FLOAT_FIELD(substitute_alpha, 0, 1),
    HOBBIT_FLOAT_FIELD(neuron_threshold, -HUGE_VAL, HUGE_VAL), // finite; below 0: off
    HOBBIT_FLOAT_FIELD(neuron_limit, 0, 1),
    HOBBIT_INT_FIELD(n_io_threads, 1, HOBBIT_MAX_IO_THREADS),
    HOBBIT_INT_FIELD(n_row_readers, 0, HOBBIT_MAX_IO_THREADS),
    HOBBIT_INT_FIELD(neuron_bridge, 0, HUGE_VAL),
    HOBBIT_INT_FIELD(n_level, 1, HOBBIT_MAX_LEVELS),
    HOBBIT_FLOAT_FIELD(t1, 0, 1),
    HOBBIT_FLOAT_FIELD(t_mid, 0, 1),
    HOBBIT_FLOAT_FIELD(t2, 0, 1),
};

#undef HOBBIT_INT_FIELD
#undef HOBBIT_FLOAT_FIELD

const int32_t N_RANGED_FIELDS = (int32_t) std::size(RANGED_FIELDS);

hobbit_param_range RANGES[std::size(RANGED_FIELDS)];

// "1..64", "0 or more", "in [0, 1]", "finite"
std::string range_text(const hobbit_param_range & r) {
    char lo[32];
    char hi[32];
    snprintf(lo, sizeof(lo), "%.17g", r.min);
    snprintf(hi, sizeof(hi), "%.17g", r.max);
    if (std::isinf(r.min) && std::isinf(r.max)) {
        return "finite";
    }
    if (std::isinf(r.max)) {
        return std::string(lo) + " or more";
    }
    return r.integer ? std::string(lo) + ".." + hi : "in [" + std::string(lo) + ", " + hi + "]";
}

std::string shown(double x, bool integer) {
    char s[32];
    snprintf(s, sizeof(s), integer ? "%.0f" : "%g", x);
    return s;
}

} // namespace

std::string params_problem(const hobbit_params & params) {
    for (const ranged_field & f : RANGED_FIELDS) {
        const double x = f.value(params);
        // NaN fails both comparisons; an infinity is refused even where a side has no bound
        if (!(x >= f.range.min && x <= f.range.max) || std::isinf(x)) {
            return std::string(f.range.name) + " must be " + range_text(f.range) + ", got " + shown(x, f.range.integer);
        }
    }
    // a NaN or an infinity here would reach float-to-integer conversions in the budget split
    const hobbit_policy_weights & w = params.policy_weights;
    for (const float x : { w.lru, w.lfu, w.lhu, w.fld }) {
        if (!std::isfinite(x) || x < 0.0f) {
            return "policy_weights must be finite and non-negative";
        }
    }
    for (int l = 0; l < params.n_level; ++l) {
        if (!std::isfinite(params.level_shares[l]) || params.level_shares[l] < 0.0f) {
            return "level_shares must be finite and non-negative";
        }
    }
    cache_policy_kind policy;
    if (!cache_policy_of(params.policy, policy)) {
        return "unknown cache policy " + std::to_string((int) params.policy);
    }
    if (params.hit_policy < HOBBIT_HIT_FOUND || params.hit_policy > HOBBIT_HIT_AT_LEAST) {
        return "unknown hit policy " + std::to_string((int) params.hit_policy);
    }
    if (params.mode < HOBBIT_MODE_GPU_CENTRIC || params.mode > HOBBIT_MODE_BALANCED) {
        return "unknown mode " + std::to_string((int) params.mode);
    }
    // the thresholds' order matters where they are read: several levels, or skipping cached experts
    const bool ordered = params.t1 <= params.t2 && (params.n_level < 3 || (params.t1 <= params.t_mid && params.t_mid <= params.t2));
    if ((params.n_level > 1 || params.skip_cached) && !ordered) {
        return "thresholds must satisfy t1 <= t_mid <= t2 (t1 " + std::to_string(params.t1) + ", t_mid " +
               std::to_string(params.t_mid) + ", t2 " + std::to_string(params.t2) + ")";
    }
    if (params.neuron_reads && (params.neuron_threshold < 0.0f || params.n_level != 1 || params.level_paths[0] == nullptr ||
                                params.level_paths[0][0] == '\0')) {
        return "neuron_reads needs neuron_threshold >= 0, one level and the neuron layout as level_paths[0]";
    }
    if (params.shallow_layers >= 0 && params.expert_levels != nullptr) {
        return "a pool per layer (shallow_layers >= 0) and a static placement (expert_levels) do not go together";
    }
    if (params.n_expert_levels < 0 || (params.n_expert_levels > 0) != (params.expert_levels != nullptr)) {
        return "expert_levels and n_expert_levels must be given together";
    }
    if (params.n_expert_popularity < 0 || (params.n_expert_popularity > 0) != (params.expert_popularity != nullptr)) {
        return "expert_popularity and n_expert_popularity must be given together";
    }
    return "";
}

extern "C" {

// the one table of the runtime's defaults: OffloadConfig (config.py) takes its own from here
struct hobbit_params hobbit_default_params(void) {
    hobbit_params p = {};
    p.budget_bytes    = 0;
    p.policy          = HOBBIT_POLICY_LRU;
    p.policy_weights  = { 0.25f, 0.25f, 0.25f, 0.25f };
    p.seed            = 0;
    p.prefetch_layers = 0;
    p.prefetch_width  = 0;
    p.shallow_layers  = -1;
    p.prefill_popular_first = true;
    p.cpu_repack = true;  // llama.cpp's default (use_extra_bufts)
    p.prefill_low_share = 0.0f;
    p.substitute_alpha = 0.0f;
    p.neuron_threshold = -1.0f;
    p.neuron_limit     = 0.75f;  // CORM's limit for Mixtral
    p.direct_io       = true;
    p.n_io_threads    = 2;
    p.n_row_readers   = 16;
    p.neuron_bridge   = 0;
    p.n_level         = 1;
    p.t1              = 0.6f;  // HOBBIT's values for Mixtral-8x7B (§3.2)
    p.t_mid           = 0.75f;
    p.t2              = 0.9f;
    p.skip_cached     = false;
    p.hit_policy      = HOBBIT_HIT_UPGRADE;
    p.warm_low        = true;
    p.mode            = HOBBIT_MODE_GPU_CENTRIC; // auto measured slower under tight caps (docs/BENCHMARKS.md at 5f63b2a)
    p.page_cache_room_bytes = -1;
    p.expert_levels   = nullptr;
    p.n_expert_levels = 0;
    p.expert_popularity   = nullptr;
    p.n_expert_popularity = 0;
    return p;
}

const struct hobbit_param_range * hobbit_param_ranges(int32_t * n) {
    static const bool filled = [] {
        for (int32_t i = 0; i < N_RANGED_FIELDS; ++i) {
            RANGES[i] = RANGED_FIELDS[i].range;
        }
        return true;
    }();
    (void) filled;
    if (n != nullptr) {
        *n = N_RANGED_FIELDS;
    }
    return RANGES;
}

} // extern "C"
