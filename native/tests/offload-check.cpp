// hobbit-offload-check: the product's promise checked on the machine it runs on, with
// nothing but the libraries (no Python): a prompt and a greedy decode of a MoE GGUF run
// twice, by stock llama.cpp and with the experts served from hobbitpy's smallest cache
// (one token's top-k: nearly every selection a miss read from the file), and every
// token's logits must be equal bit for bit. Used where Python is not at hand: an aarch64
// build under qemu (scripts/check-aarch64.sh), a freshly installed Jetson (docs/JETSON.md).
//
//   hobbit-offload-check MODEL.gguf [N_DECODE] [--share S] [--mode gpu-centric|cooperative]
//                                                   exit 0: equal; 1: not equal; 2: bad input
//
// --share S sizes the cache at S times the bytes of every expert (at least the smallest cache);
// --mode says where a missed expert runs. On a GPU build both runs put every layer on the GPU
// (llama.cpp's default) and the expert pools live in device memory.
#include "hobbit.h"
#include "llama.h"
#include "ggml-backend.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace {

const char * const PROMPT = "And God said, Let there be light: and there was light.";

struct run_result {
    std::vector<float> logits;  // every evaluated token's logits, in order
    hobbit_stats stats = {};
    bool offloaded = false;
    std::string pool_device;    // where the expert pools lived
};

void quiet_log(ggml_log_level level, const char * text, void *) {
    if (level == GGML_LOG_LEVEL_ERROR) {
        fputs(text, stderr);
    }
}

// prompt, then n_decode greedy tokens; logits of the prompt's last token and of each decoded one
bool run(const char * path, const hobbit_params * offload, int n_decode, run_result & out, std::string & err) {
    char msg[512] = {};
    if (offload && hobbit_request_offload(offload, msg, sizeof msg) != HOBBIT_STATUS_OK) {
        err = msg;
        return false;
    }
    llama_model_params mp = llama_model_default_params();
    llama_model * model = llama_model_load_from_file(path, mp);
    if (model == nullptr) {
        if (offload && hobbit_last_attach_error(msg, sizeof msg)) {
            err = msg;
        } else {
            err = "llama.cpp could not load the model";
        }
        return false;
    }
    out.offloaded = hobbit_runtime_of_model(model) != nullptr;
    llama_context_params cp = llama_context_default_params();
    cp.n_ctx = 256;
    cp.n_batch = 256;
    cp.n_threads = cp.n_threads_batch = 2;
    llama_context * ctx = llama_init_from_model(model, cp);
    if (ctx == nullptr) {
        llama_model_free(model);
        err = "llama.cpp could not create a context";
        return false;
    }
    const llama_vocab * vocab = llama_model_get_vocab(model);
    const int n_vocab = llama_vocab_n_tokens(vocab);
    std::vector<llama_token> prompt(128);
    const int n_prompt = llama_tokenize(vocab, PROMPT, (int32_t) strlen(PROMPT), prompt.data(), (int32_t) prompt.size(), true, false);
    bool ok = n_prompt > 0;
    if (!ok) {
        err = "the prompt does not tokenize";
    }
    prompt.resize(ok ? n_prompt : 0);
    llama_batch batch = llama_batch_get_one(prompt.data(), (int32_t) prompt.size());
    llama_token next = 0;
    for (int i = 0; ok && i <= n_decode; ++i) {
        if (llama_decode(ctx, batch) != 0) {
            err = "llama_decode failed";
            ok = false;
            break;
        }
        const float * logits = llama_get_logits_ith(ctx, -1);
        out.logits.insert(out.logits.end(), logits, logits + n_vocab);
        next = 0;
        for (int v = 1; v < n_vocab; ++v) {
            if (logits[v] > logits[next]) {
                next = v;
            }
        }
        batch = llama_batch_get_one(&next, 1);
    }
    if (hobbit_runtime * rt = hobbit_runtime_of_model(model)) {
        hobbit_runtime_get_stats(rt, &out.stats);
        out.pool_device = hobbit_runtime_pool_device(rt);
    }
    llama_free(ctx);
    llama_model_free(model);
    return ok;
}

// which CPU backend variant ggml loaded: its instruction-set features as it reports them
void print_cpu_backend() {
    ggml_backend_dev_t cpu = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
    if (cpu == nullptr) {
        printf("no CPU backend is loaded\n");
        return;
    }
    std::string features;
    auto get_features = (ggml_backend_get_features_t) ggml_backend_reg_get_proc_address(
            ggml_backend_dev_backend_reg(cpu), "ggml_backend_get_features");
    for (ggml_backend_feature * f = get_features ? get_features(ggml_backend_dev_backend_reg(cpu)) : nullptr;
         f && f->name; ++f) {
        if (strcmp(f->value, "1") == 0) {
            features += std::string(" ") + f->name;
        }
    }
    printf("CPU backend: %s;%s\n", ggml_backend_dev_description(cpu), features.c_str());
}

}  // namespace

int main(int argc, char ** argv) {
    const char * path = argc >= 2 ? argv[1] : nullptr;
    int n_decode = 8;
    double share = 0.0;
    hobbit_mode mode = HOBBIT_MODE_GPU_CENTRIC;
    bool usage_ok = path != nullptr;
    int i = 2;
    if (usage_ok && i < argc && argv[i][0] != '-') {
        n_decode = atoi(argv[i++]);
        if (n_decode < 1 || n_decode > 200) {
            fprintf(stderr, "%s: N_DECODE must be 1..200\n", argv[0]);
            return 2;
        }
    }
    for (; usage_ok && i < argc; i += 2) {
        if (i + 1 < argc && strcmp(argv[i], "--share") == 0) {
            char * end = nullptr;
            share = strtod(argv[i + 1], &end);
            usage_ok = end != argv[i + 1] && *end == '\0' && share >= 0.0 && share <= 1.0;
        } else if (i + 1 < argc && strcmp(argv[i], "--mode") == 0) {
            usage_ok = strcmp(argv[i + 1], "gpu-centric") == 0 || strcmp(argv[i + 1], "cooperative") == 0;
            mode = strcmp(argv[i + 1], "cooperative") == 0 ? HOBBIT_MODE_COOPERATIVE : HOBBIT_MODE_GPU_CENTRIC;
        } else {
            usage_ok = false;
        }
    }
    if (!usage_ok) {
        fprintf(stderr, "usage: %s MODEL.gguf [N_DECODE] [--share 0..1] [--mode gpu-centric|cooperative]\n", argv[0]);
        return 2;
    }
    hobbit_model_info info = {};
    char msg[512] = {};
    if (hobbit_inspect_model(path, &info, msg, sizeof msg) != HOBBIT_STATUS_OK) {
        fprintf(stderr, "%s\n", msg);
        return 2;
    }
    if (info.n_layer_moe == 0) {
        fprintf(stderr, "%s: a dense model (no routed experts): nothing to offload\n", path);
        return 2;
    }
    llama_log_set(quiet_log, nullptr);
    llama_backend_init();
    print_cpu_backend();

    std::string err;
    run_result stock, offloaded;
    if (!run(path, nullptr, n_decode, stock, err)) {
        fprintf(stderr, "%s: stock run: %s\n", path, err.c_str());
        return 1;
    }
    hobbit_params params = hobbit_default_params();
    // the smallest cache (the most reads), or the share asked for
    const int64_t shared = (int64_t) (share * (double) info.expert_bytes_total);
    params.budget_bytes = shared > info.min_budget_bytes ? shared : info.min_budget_bytes;
    params.mode = mode;
    if (!run(path, &params, n_decode, offloaded, err)) {
        fprintf(stderr, "%s: offloaded run: %s\n", path, err.c_str());
        return 1;
    }
    if (!offloaded.offloaded || offloaded.stats.expert_misses + offloaded.stats.expert_inplace == 0) {
        fprintf(stderr, "%s: the offloaded run did not go through the expert cache\n", path);
        return 1;
    }
    const bool equal = stock.logits.size() == offloaded.logits.size() &&
                       memcmp(stock.logits.data(), offloaded.logits.data(), stock.logits.size() * sizeof(float)) == 0;
    printf("%s: %s, %d MoE layers x %d experts; cache %.1f MB of %.1f MB on %s (%s); %d tokens decoded; "
           "%lld hits, %lld misses, %lld in place, %.1f MB read\n",
           path, info.arch, info.n_layer_moe, info.n_expert, params.budget_bytes / 1048576.0, 
           info.expert_bytes_total / 1048576.0, offloaded.pool_device.c_str(),
           offloaded.stats.mode == HOBBIT_MODE_COOPERATIVE ? "cooperative" : "gpu-centric", n_decode,
           (long long) offloaded.stats.expert_hits, (long long) offloaded.stats.expert_misses,
           (long long) offloaded.stats.expert_inplace, offloaded.stats.bytes_read / 1048576.0);
    if (!equal) {
        printf("offloaded logits differ from stock's\n");
        return 1;
    }
    printf("offloaded logits equal stock's bit for bit\n");
    return 0;
}
