// hobbit-substitution.h - importance-driven scheduling's expert-cache router (Algorithm 1 of
// "Enabling MoE on the Edge via Importance-Driven Expert Scheduling"), for one token: a
// selected expert whose router score is close to the best unselected one's is "low-score",
// and if it is not cached it is replaced by an unselected, cached expert of similar score,
// so the token needs no load for it.
//
// Pure: it plans from the scores and what is cached; the runtime writes the plan into the
// graph's selected ids and gate weights (hobbit_runtime::substitute_low_scores).
#pragma once

#include <functional>
#include <vector>

// Algorithm 1's split: a selection scoring at least (1 + alpha) β, β the best unselected
// score, is top-score (always served as selected); below it, low-score (substitutable). The
// prefetch of the importance preset fetches the predicted top-score experts only.
inline bool top_score(float score, float beta, float alpha) { return score >= (1.0f + alpha) * beta; }

struct substitution_plan {
    std::vector<int>   ids;     // [k] the experts the token uses
    std::vector<float> weights; // [k] their gate weights
    int n_substituted = 0;      // selections replaced
};

// scores: [n_expert] the token's router scores (probabilities: softmax or sigmoid outputs);
// ids, weights: its k selections and their gate weights; alpha: β = the (k+1)-th highest
// score; a selection scoring at least (1 + alpha) β is top-score and kept, one below it is
// low-score and, when not cached, replaced by the best cached unselected expert scoring in
// [(1 - alpha) β, β), the lowest-scoring low-score selections first when there are fewer such
// experts than misses. The gate weights: where the token's weights are its selections' scores
// normalized to sum to 1 (mixtral, gpt-oss) the new set is normalized again; otherwise (the raw
// scores, qwen2moe) the substitute gets its score, scaled as the others are.
substitution_plan plan_substitution(const std::vector<float> & scores, const std::vector<int> & ids,
                                    const std::vector<float> & weights, float alpha,
                                    const std::function<bool(int)> & cached);

// a decode batch (beams, sequences decoded side by side), token by token: an expert another
// token of the batch selects is read anyway, so it counts as cached for this token (its own
// low-score selection is kept, or it is taken as a substitute): the batch rule of Algorithm 2,
// whose GPU computes an expert for many tokens as cheaply as for one. Every token's plan sees
// the substitutions of the tokens before it. scores/ids/weights: one entry per token.
std::vector<substitution_plan> plan_batch_substitution(const std::vector<std::vector<float>> & scores,
                                                       const std::vector<std::vector<int>> & ids,
                                                       const std::vector<std::vector<float>> & weights, float alpha,
                                                       const std::function<bool(int)> & cached);
