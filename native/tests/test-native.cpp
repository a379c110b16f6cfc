// test-native.cpp - the native unit tests (test-*.cpp, one file a unit of native/src) on a GGUF
// written here. Exits non-zero on the first failure; prints one line per test.
#include "test-common.h"

#include <unistd.h>

int main(int argc, char ** argv) {
    const std::string dir = argc > 1 ? argv[1] : "/tmp";
    const std::string path = write_model(dir + "/hobbit-native-test-" + std::to_string(getpid()) + ".gguf");
    test_index(path);
    for (bool staged : {false, true}) {
        test_store(path, false, staged);
        test_store(path, true, staged);
    }
    test_direct_granule(path);
    test_truncated(path);
    test_lru();
    test_lfu_lhu_fld();
    test_arc();
    test_popularity();
    test_frequency();
    test_score_policy();
    test_simulator();
    test_take_slot();
    test_slot_table();
    test_expert_cache();
    test_pool(path);
    test_scheduler(path);
    test_precision_scorer();
    test_companion_check(path, dir);
    test_level_budgets(path);
    test_per_layer_plan(path);
    test_placed_plan(path);
    test_stacked_predictor();
    test_predicted_expert_counts();
    test_substitution();
    test_balance_misses();
    test_neuron_sim_cache();
    test_neuron_reads(path);
    test_mapping_guard(dir);
    unlink(path.c_str());
    printf("all native tests passed\n");
    return 0;
}
