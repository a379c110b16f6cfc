// test-common.cpp - the native unit tests' shared helpers (test-common.h).
#include "test-common.h"

uint8_t pattern(int il, int p, int e, size_t b) {
    return (uint8_t) (il*131 + p*37 + e*17 + b*7 + (b >> 8));
}

std::string write_model(const std::string & path, int n_ff) {
    ggml_init_params ip = { 64*ggml_tensor_overhead(), nullptr, true };
    ggml_context * ctx = ggml_init(ip);
    gguf_context * g = gguf_init_empty();
    gguf_set_val_str(g, "general.architecture", "llama");
    gguf_set_val_u32(g, "llama.block_count", N_LAYER);
    gguf_set_val_u32(g, "llama.expert_count", N_EXPERT);
    gguf_set_val_u32(g, "llama.expert_used_count", N_USED);
    std::vector<std::vector<uint8_t>> data;
    data.reserve(16);
    for (int il = 0; il < N_LAYER; il += 2) {
        const char * names[3] = { "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps" };
        for (int p = 0; p < 3; ++p) {
            const int64_t n_in = p == 2 ? n_ff : N_EMBD, n_out = p == 2 ? N_EMBD : n_ff;
            ggml_tensor * t = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, n_in, n_out, N_EXPERT);
            ggml_set_name(t, ("blk." + std::to_string(il) + "." + names[p] + ".weight").c_str());
            data.emplace_back(ggml_nbytes(t));
            const size_t per = ggml_nbytes(t) / N_EXPERT;
            for (int e = 0; e < N_EXPERT; ++e) {
                for (size_t b = 0; b < per; ++b) {
                    data.back()[e*per + b] = pattern(il, p, e, b);
                }
            }
            gguf_add_tensor(g, t);
            gguf_set_tensor_data(g, t->name, data.back().data());
        }
    }
    CHECK(gguf_write_to_file(g, path.c_str(), false));
    gguf_free(g);
    ggml_free(ctx);
    return path;
}

void check_expert_bytes(const std::vector<std::vector<uint8_t>> & buf, int il, int e) {
    for (int p = 0; p < 3; ++p) {
        for (size_t b = 0; b < buf[p].size(); ++b) {
            CHECK(buf[p][b] == pattern(il, p, e, b));
        }
    }
}

bool aborts(const std::function<void()> & fn) {
    fflush(stdout);
    const pid_t pid = fork();
    if (pid == 0) {
        setenv("GGML_NO_BACKTRACE", "1", 1); // (a debugger attached to print it: seconds)
        freopen("/dev/null", "w", stderr);    // the assert's message
        fn();
        _exit(0);
    }
    int status = 0;
    waitpid(pid, &status, 0);
    return WIFSIGNALED(status) && WTERMSIG(status) == SIGABRT;
}

neuron_bits bits(int n, std::initializer_list<int> set) {
    neuron_bits b(n);
    for (int i : set) {
        b.set(i);
    }
    return b;
}
