// test-expert-pool.cpp - native unit tests: the pools' tensors.
#include "test-common.h"

#include "hobbit-expert-pool.h"
#include "hobbit-expert-store.h"

void test_pool(const std::string & path) {
    expert_index idx = expert_index::from_file(path);
    expert_pool pool(idx.layers[0], N_USED, 3);
    CHECK(pool.n_slot() == 3);
    CHECK(pool.weights(LLAMA_MOE_PROJ_UP)->ne[2] == 3);
    CHECK(pool.weights(LLAMA_MOE_PROJ_GATE_UP) == nullptr);
    void * dst[LLAMA_MOE_PROJ_COUNT];
    ggml_tensor * view[LLAMA_MOE_PROJ_COUNT];
    pool.slot_targets(2, dst, view);
    CHECK(!pool.repacked() && view[LLAMA_MOE_PROJ_DOWN] == nullptr); // F32 is never repacked
    CHECK((char *) dst[LLAMA_MOE_PROJ_DOWN] == (char *) pool.weights(LLAMA_MOE_PROJ_DOWN)->data + 2*pool.weights(LLAMA_MOE_PROJ_DOWN)->nb[2]);
    printf("ok pool\n");
}
