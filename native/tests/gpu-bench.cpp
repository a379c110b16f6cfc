// hobbit-gpu-bench: one configuration of a MoE GGUF timed the way a user on a GPU compares them,
// with nothing but the libraries (no Python; device-check.sh runs it on a machine that has no
// llama-cpp-python): a prompt of random tokens in one batch, then greedy decoding.
//
//   hobbit-gpu-bench MODEL.gguf CONFIG [--prompt N] [--decode N] [--threads N]
//
// CONFIG, each what llama.cpp's or hobbitpy's flag of the same name sets:
//   stock            every layer on the GPU (llama.cpp's default, -ngl all)
//   exps-cpu         -ot exps=CPU: the routed experts in host memory, computed there (llama.cpp's
//                    scheduler copies them to the GPU for a wide batch), the rest on the GPU
//   n-cpu-moe=N      --n-cpu-moe N: the experts of the first N layers in host memory
//   hobbit=MB[:MODE] the experts through hobbitpy's cache of MB in device memory (MODE gpu-centric
//                    or cooperative), one precision: stock's logits bit for bit
//
// One JSON line on stdout: prefill and decode tokens a second, the device memory the model and its
// context took (the device's free memory before and after), and for hobbit the cache's hits,
// misses and bytes loaded into the device pools a decoded token (bytes over PCIe); the logits of
// the last token are hashed so that runs can be compared. Exit 0: measured; 1: a run failed; 2: bad input.
#include "hobbit.h"
#include "llama.h"
#include "ggml-backend.h"

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace {

const char * const EXPS = "\\.ffn_(up|down|gate|gate_up)_(ch|)exps";  // llama.cpp's LLM_FFN_EXPS_REGEX

struct options {
    const char * model = nullptr;
    std::string config;
    int n_prompt = 512;
    int n_decode = 32;
    int n_threads = 8;
};

void quiet_log(ggml_log_level level, const char * text, void *) {
    if (level == GGML_LOG_LEVEL_ERROR) {
        fputs(text, stderr);
    }
}

bool parse_int(const char * s, int lo, int hi, int & out) {
    char * end = nullptr;
    const long v = strtol(s, &end, 10);
    if (end == s || *end != '\0' || v < lo || v > hi) {
        return false;
    }
    out = (int) v;
    return true;
}

// the first GPU's free bytes, or -1 without one
int64_t device_free_bytes() {
    ggml_backend_dev_t gpu = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_GPU);
    if (gpu == nullptr) {
        return -1;
    }
    size_t free = 0, total = 0;
    ggml_backend_dev_memory(gpu, &free, &total);
    return (int64_t) free;
}

double now_s() {
    return ggml_time_us() / 1e6;
}

}  // namespace

int main(int argc, char ** argv) {
    options o;
    bool ok = argc >= 3;
    if (ok) {
        o.model = argv[1];
        o.config = argv[2];
    }
    for (int i = 3; ok && i < argc; i += 2) {
        const bool has_value = i + 1 < argc;
        if (has_value && strcmp(argv[i], "--prompt") == 0) {
            ok = parse_int(argv[i + 1], 1, 8192, o.n_prompt);
        } else if (has_value && strcmp(argv[i], "--decode") == 0) {
            ok = parse_int(argv[i + 1], 1, 1024, o.n_decode);
        } else if (has_value && strcmp(argv[i], "--threads") == 0) {
            ok = parse_int(argv[i + 1], 1, 256, o.n_threads);
        } else {
            ok = false;
        }
    }
    if (!ok) {
        fprintf(stderr, "usage: %s MODEL.gguf stock|exps-cpu|n-cpu-moe=N|hobbit=MB[:gpu-centric|cooperative] "
                        "[--prompt N] [--decode N] [--threads N]\n", argv[0]);
        return 2;
    }
    hobbit_model_info info = {};
    char msg[512] = {};
    if (hobbit_inspect_model(o.model, &info, msg, sizeof msg) != HOBBIT_STATUS_OK) {
        fprintf(stderr, "%s\n", msg);
        return 2;
    }
    llama_log_set(quiet_log, nullptr);
    llama_backend_init();
    ggml_backend_dev_t cpu = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);

    // the configuration: tensor overrides (kept alive until the model is loaded) or hobbit's params
    std::vector<std::string> patterns;
    std::vector<llama_model_tensor_buft_override> overrides;
    bool offload = false;
    hobbit_params params = hobbit_default_params();
    if (o.config == "exps-cpu") {
        patterns.emplace_back(EXPS);
    } else if (o.config.rfind("n-cpu-moe=", 0) == 0) {
        int n = 0;
        if (!parse_int(o.config.c_str() + strlen("n-cpu-moe="), 0, info.n_layer, n)) {
            fprintf(stderr, "%s: n-cpu-moe must be 0..%d\n", o.config.c_str(), info.n_layer);
            return 2;
        }
        for (int il = 0; il < n; ++il) {  // as llama.cpp's llm_add_n_cpu_ffn_overrides
            patterns.push_back("blk\\." + std::to_string(il) + EXPS);
        }
    } else if (o.config.rfind("hobbit=", 0) == 0) {
        const std::string spec = o.config.substr(strlen("hobbit="));
        const size_t colon = spec.find(':');
        int mb = 0;
        if (!parse_int(spec.substr(0, colon).c_str(), 1, 1 << 24, mb)) {
            fprintf(stderr, "%s: the cache size must be a number of MB\n", o.config.c_str());
            return 2;
        }
        params.budget_bytes = (int64_t) mb * 1048576;
        const std::string mode = colon == std::string::npos ? "gpu-centric" : spec.substr(colon + 1);
        if (mode == "gpu-centric") {
            params.mode = HOBBIT_MODE_GPU_CENTRIC;
        } else if (mode == "cooperative") {
            params.mode = HOBBIT_MODE_COOPERATIVE;
        } else {
            fprintf(stderr, "%s: the mode must be gpu-centric or cooperative\n", o.config.c_str());
            return 2;
        }
        offload = true;
    } else if (o.config != "stock") {
        fprintf(stderr, "%s: unknown configuration\n", o.config.c_str());
        return 2;
    }
    for (const std::string & p : patterns) {
        overrides.push_back({p.c_str(), ggml_backend_dev_buffer_type(cpu)});
    }
    overrides.push_back({nullptr, nullptr});

    const int64_t free_before = device_free_bytes();
    if (offload && hobbit_request_offload(&params, msg, sizeof msg) != HOBBIT_STATUS_OK) {
        fprintf(stderr, "%s: %s\n", o.model, msg);
        return 2;
    }
    llama_model_params mp = llama_model_default_params();
    mp.tensor_buft_overrides = patterns.empty() ? nullptr : overrides.data();
    const double t_load = now_s();
    llama_model * model = llama_model_load_from_file(o.model, mp);
    if (model == nullptr) {
        fprintf(stderr, "%s: %s\n", o.model,
                offload && hobbit_last_attach_error(msg, sizeof msg) ? msg : "llama.cpp could not load the model");
        return 1;
    }
    llama_context_params cp = llama_context_default_params();
    cp.n_ctx = o.n_prompt + o.n_decode + 16;
    cp.n_batch = o.n_prompt;
    cp.n_ubatch = o.n_prompt < 512 ? o.n_prompt : 512;
    cp.n_threads = cp.n_threads_batch = o.n_threads;
    llama_context * ctx = llama_init_from_model(model, cp);
    if (ctx == nullptr) {
        llama_model_free(model);
        fprintf(stderr, "%s: llama.cpp could not create a context\n", o.model);
        return 1;
    }
    const double load_s = now_s() - t_load;
    const int64_t free_after = device_free_bytes();
    hobbit_runtime * rt = hobbit_runtime_of_model(model);
    if (offload && rt == nullptr) {
        fprintf(stderr, "%s: the model was not offloaded (every expert fits, or the runtime refused)\n", o.model);
        return 1;
    }

    const llama_vocab * vocab = llama_model_get_vocab(model);
    const int n_vocab = llama_vocab_n_tokens(vocab);
    std::vector<llama_token> prompt(o.n_prompt);
    uint64_t state = 0x9e3779b97f4a7c15ull;
    for (llama_token & t : prompt) {  // a fixed pseudo-random prompt: every run the same tokens
        state = state * 6364136223846793005ull + 1442695040888963407ull;
        t = (llama_token) ((state >> 33) % (uint64_t) n_vocab);
    }
    const double t_prompt = now_s();
    bool run_ok = llama_decode(ctx, llama_batch_get_one(prompt.data(), (int32_t) prompt.size())) == 0;
    const double prefill_s = now_s() - t_prompt;
    hobbit_stats after_prompt = {};
    if (rt) {
        hobbit_runtime_get_stats(rt, &after_prompt);
    }
    uint64_t logits_hash = 1469598103934665603ull;  // FNV-1a over the last token's logits' bytes
    const double t_decode = now_s();
    for (int i = 0; run_ok && i < o.n_decode; ++i) {
        const float * logits = llama_get_logits_ith(ctx, -1);
        llama_token next = 0;
        for (int v = 1; v < n_vocab; ++v) {
            if (logits[v] > logits[next]) {
                next = v;
            }
        }
        if (i == o.n_decode - 1) {
            const unsigned char * b = (const unsigned char *) logits;
            for (size_t k = 0; k < (size_t) n_vocab * sizeof(float); ++k) {
                logits_hash = (logits_hash ^ b[k]) * 1099511628211ull;
            }
        }
        run_ok = llama_decode(ctx, llama_batch_get_one(&next, 1)) == 0;
    }
    const double decode_s = now_s() - t_decode;
    hobbit_stats end = {};
    std::string pool_device = "none";
    if (rt) {
        hobbit_runtime_get_stats(rt, &end);
        pool_device = hobbit_runtime_pool_device(rt);
    }
    llama_free(ctx);
    llama_model_free(model);
    if (!run_ok) {
        fprintf(stderr, "%s: llama_decode failed (%s)\n", o.model, o.config.c_str());
        return 1;
    }
    const long long decode_hits = end.expert_hits - after_prompt.expert_hits;
    const long long decode_misses = end.expert_misses - after_prompt.expert_misses;
    printf("{\"config\": \"%s\", \"prompt_tokens\": %d, \"decode_tokens\": %d, \"prefill_tok_s\": %.3f, "
           "\"decode_tok_s\": %.3f, \"load_s\": %.2f, \"device_bytes_used\": %lld, \"pool_device\": \"%s\", "
           "\"budget_bytes\": %lld, \"decode_hits\": %lld, \"decode_misses\": %lld, \"decode_hit_ratio\": %s, "
           "\"decode_bytes_loaded_per_token\": %s, \"prefill_bytes_loaded\": %lld, \"logits_hash\": \"%016llx\"}\n",
           o.config.c_str(), o.n_prompt, o.n_decode, o.n_prompt / prefill_s, o.n_decode / decode_s, load_s,
           free_before >= 0 && free_after >= 0 ? (long long) (free_before - free_after) : -1LL, pool_device.c_str(),
           (long long) end.budget_bytes, decode_hits, decode_misses,
           rt && decode_hits + decode_misses > 0 ? std::to_string((double) decode_hits / (decode_hits + decode_misses)).c_str() : "null",
           rt ? std::to_string((end.bytes_read - after_prompt.bytes_read) / (double) o.n_decode).c_str() : "null",
           (long long) after_prompt.bytes_read, (unsigned long long) logits_hash);
    return 0;
}
