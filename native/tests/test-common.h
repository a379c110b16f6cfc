// test-common.h - what the native unit tests share: CHECK, the test model's shape and its bytes, a
// child process that must abort, and each unit's test functions (test-*.cpp), run by test-native.cpp.
#pragma once

#include "hobbit-neuron-bits.h"

#include "ggml.h"
#include "gguf.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <mutex>
#include <string>
#include <vector>

#define CHECK(cond) do { if (!(cond)) { fprintf(stderr, "FAIL %s:%d: %s\n", __FILE__, __LINE__, #cond); exit(1); } } while (0)

constexpr int N_LAYER = 3, N_EXPERT = 4, N_USED = 2, N_EMBD = 64, N_FF = 96;

// byte b of expert e, layer il, projection p: distinct everywhere, so a read from the
// wrong offset is caught
uint8_t pattern(int il, int p, int e, size_t b);
// a MoE-shaped GGUF: layer 1 is dense, layers 0 and 2 have F32 experts of n_ff neurons
std::string write_model(const std::string & path, int n_ff = N_FF);
void check_expert_bytes(const std::vector<std::vector<uint8_t>> & buf, int il, int e);
// a set of neurons: n bits, those of `set` on
neuron_bits bits(int n, std::initializer_list<int> set);
// whether fn aborts (a failed GGML_ASSERT) in a child process
bool aborts(const std::function<void()> & fn);

void test_index(const std::string & path);
void test_store(const std::string & path, bool direct, bool staged);
void test_direct_granule(const std::string & path);
void test_truncated(const std::string & path);
void test_companion_check(const std::string & path, const std::string & dir);
void test_lru();
void test_lfu_lhu_fld();
void test_arc();
void test_popularity();
void test_frequency();
void test_score_policy();
void test_take_slot();
void test_simulator();
void test_slot_table();
void test_expert_cache();
void test_pool(const std::string & path);
void test_scheduler(const std::string & path);
void test_precision_scorer();
void test_level_budgets(const std::string & path);
void test_per_layer_plan(const std::string & path);
void test_placed_plan(const std::string & path);
void test_stacked_predictor();
void test_predicted_expert_counts();
void test_substitution();
void test_balance_misses();
void test_neuron_sim_cache();
void test_neuron_reads(const std::string & path);
void test_mapping_guard(const std::string & dir);
