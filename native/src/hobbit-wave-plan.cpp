#include "hobbit-wave-plan.h"

#include <algorithm>
#include <climits>
#include <cmath>

wave_selection read_selection(const ggml_tensor * sel, const ggml_tensor * wts, int n_expert,
                              const precision_thresholds & thresholds, const int8_t * placed, int only_level) {
    const int n_used = (int) sel->ne[0], n_tokens = (int) sel->ne[1];
    std::vector<int32_t> ids((size_t) n_used * n_tokens);
    std::vector<float> w((size_t) n_used * n_tokens);
    for (int t = 0; t < n_tokens; ++t) {
        for (int k = 0; k < n_used; ++k) { // (the top-k view is not contiguous)
            ids[(size_t) t * n_used + k] = *(const int32_t *) ((const char *) sel->data + t*sel->nb[1] + k*sel->nb[0]);
            w[(size_t) t * n_used + k]   = *(const float *) ((const char *) wts->data + k*wts->nb[1] + t*wts->nb[2]);
        }
    }
    return read_selection_of(ids.data(), w.data(), n_used, n_tokens, n_expert, thresholds, placed, only_level);
}

wave_selection read_selection_of(const int32_t * ids, const float * wts, int n_used, int n_tokens, int n_expert,
                                 const precision_thresholds & thresholds, const int8_t * placed, int only_level) {
    wave_selection ws;
    ws.n_used   = n_used;
    ws.n_tokens = n_tokens;
    const int skip = thresholds.n_level;
    ws.ids.resize((size_t) ws.n_used * ws.n_tokens);
    ws.n_pairs.assign(n_expert, 0);
    ws.want.assign(n_expert, INT_MAX);
    ws.top1.assign(n_expert, false);
    ws.share_low.assign(n_expert, false);
    std::vector<float> w(ws.n_used);
    std::vector<int> pair_level(ws.n_used);
    for (int t = 0; t < ws.n_tokens; ++t) {
        for (int k = 0; k < ws.n_used; ++k) {
            w[k] = wts != nullptr ? wts[(size_t) t * ws.n_used + k] : 1.0f;
        }
        precision_levels(thresholds, w.data(), ws.n_used, pair_level.data());
        const int first = (int) (std::max_element(w.begin(), w.end(), [](float a, float b) { return std::fabs(a) < std::fabs(b); }) - w.begin());
        for (int k = 0; k < ws.n_used; ++k) {
            int32_t e = ids[(size_t) t * ws.n_used + k];
            // a placement fixes each expert's level; the skip rule then acts only with skip_cached
            const int level = e < 0 || e >= n_expert ? skip
                            : pair_level[k] == PRECISION_SKIP && (!placed || thresholds.skip_cached) ? skip
                            : placed ? placed[e] : pair_level[k];
            if (only_level >= 0 && level != only_level) {
                // another level's wave serves this pair; one to skip is left out of every wave (a
                // pair of an expert that another token wants would otherwise be computed with it)
                ws.n_skipped_pairs += level == skip && e >= 0 && e < n_expert && only_level == skip - 1;
                e = -1;
            }
            ws.ids[(size_t) t*ws.n_used + k] = e;
            if (e >= 0 && e < n_expert) {
                if (ws.n_pairs[e]++ == 0) {
                    ws.order.push_back(e);
                }
                ws.want[e] = std::min(ws.want[e], level);
                ws.top1[e] = ws.top1[e] || k == first;
            }
        }
    }
    // Fate §4.5: in a prompt, an expert few tokens select costs as much to read as a popular
    // one but carries little of the output: the least popular want the lowest level
    if (placed == nullptr && thresholds.n_level > 1 && thresholds.prefill_low_share > 0.0f &&
        is_prompt_ubatch(ws.n_pair(), n_expert)) {
        const std::vector<bool> low = least_popular_experts(ws.n_pairs, thresholds.prefill_low_share);
        for (int e : ws.order) {
            if (low[e] && ws.want[e] < skip) {
                ws.want[e] = skip - 1;
                ws.share_low[e] = true;
            }
        }
    }
    // when the ubatch needs more experts than there are slots, the experts with the most
    // tokens get the slots; the rest run in place (one wave) or in the next waves
    std::stable_sort(ws.order.begin(), ws.order.end(), [&](int a, int b) { return ws.n_pairs[a] > ws.n_pairs[b]; });
    return ws;
}

int first_level(int want, int n_level, bool exact, bool allow_lower, const std::function<bool(int)> & has_room) {
    if (exact) {
        return has_room(want) ? want : -1;
    }
    for (int l = want; l >= 0; --l) {
        if (has_room(l)) {
            return l;
        }
    }
    for (int l = want + 1; allow_lower && l < n_level; ++l) {
        if (has_room(l)) {
            return l;
        }
    }
    return -1;
}
