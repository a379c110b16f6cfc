// test-predictor.cpp - native unit tests: the next layers' predictor.
#include "test-common.h"

#include "hobbit-predictor.h"

// stacked gates: the next layers' routers on this layer's input, nearest first
void test_stacked_predictor() {
    const int n_embd = 2;
    std::vector<router_weights> routers(3);
    for (int i = 0; i < 3; ++i) {
        routers[i].il = 2 * i; // MoE layers 0, 2, 4
    }
    // x = (1, 0): layer 2 ranks experts 2 > 0 > 1, layer 4 ranks 1 > 2 > 0
    routers[0].w = { 1, 0,  2, 0,  3, 0 };
    routers[1].w = { 0.5f, 0,  -1, 0,  2, 0 };
    routers[2].w = { -1, 0,  3, 0,  1, 0 };
    auto predictor = predictor_make_stacked_gates(routers, n_embd, /*n_predict*/ 2, /*max_depth*/ 2);
    const float x[2] = { 1.0f, 0.0f };
    std::vector<layer_prediction> out;
    predictor->predict(0, x, 2, out);
    CHECK(out.size() == 2 && out[0].il == 2 && out[1].il == 4);
    CHECK(out[0].experts == std::vector<int>({ 2, 0 }) && out[1].experts == std::vector<int>({ 1, 2 }));
    // softmax over the top-k: exp(2) : exp(0.5), summing to 1
    CHECK(std::fabs(out[0].weights[0] + out[0].weights[1] - 1.0f) < 1e-6f);
    CHECK(std::fabs(out[0].weights[0] / out[0].weights[1] - std::exp(1.5f)) < 1e-3f);
    out.clear();
    predictor->predict(0, x, 1, out); // a smaller depth asked for
    CHECK(out.size() == 1 && out[0].il == 2);
    out.clear();
    predictor->predict(2, x, 2, out); // only one layer left after layer 2
    CHECK(out.size() == 1 && out[0].il == 4);
    out.clear();
    predictor->predict(4, x, 2, out); // the last MoE layer predicts nothing
    CHECK(out.empty());
    printf("ok stacked predictor\n");
}

// Fate's popularity-ordered prefill: per expert of the next MoE layer, the tokens whose top-k
// the router is predicted to put it in; a widened prediction still counts each token's k only
void test_predicted_expert_counts() {
    const int n_embd = 2;
    std::vector<router_weights> routers(2);
    routers[0].il = 0;
    routers[1].il = 1;
    routers[0].w = { 1, 0,  0, 1,  1, 1 };
    // layer 1 scores experts (x0, -x0 + x1, 2 x1): x = (1, 0) ranks 0 > 2 > 1, (0, 1) 2 > 1 > 0
    routers[1].w = { 1, 0,  -1, 1,  0, 2 };
    auto predictor = predictor_make_stacked_gates(routers, n_embd, /*n_predict (widened)*/ 3, /*max_depth*/ 1);
    // three tokens, rows 3 floats apart (a padded layout): (1, 0), (0, 1), (0, 1)
    const float x[9] = { 1, 0, -7,  0, 1, -7,  0, 1, -7 };
    const std::vector<int> top1 = predicted_expert_counts(*predictor, 0, x, 3, 3, /*k*/ 1, 3);
    CHECK(top1 == std::vector<int>({ 1, 0, 2 }));
    const std::vector<int> top2 = predicted_expert_counts(*predictor, 0, x, 3, 3, /*k*/ 2, 3);
    CHECK(top2 == std::vector<int>({ 1, 2, 3 }));
    CHECK(predicted_expert_counts(*predictor, 1, x, 3, 3, 2, 3).empty()); // the last MoE layer: nothing after it
    printf("ok predicted expert counts\n");
}
