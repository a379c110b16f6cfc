// hobbit-expert-index.cpp - a GGUF model's routed experts indexed: where every expert's slice
// of every projection lies (in which part of a split model), every metadata value llama.cpp
// would assert on checked first, a companion checked against its model, the fingerprint.

#include "hobbit-expert-store.h"

#include "hobbit-error.h"

#include "ggml.h"
#include "gguf.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string_view>
#include <unordered_map>

static const char * proj_tensor_suffix[LLAMA_MOE_PROJ_COUNT] = {
    "ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight", "ffn_gate_up_exps.weight",
};

bool expert_layer_layout::has_experts() const {
    return proj[LLAMA_MOE_PROJ_DOWN].present || proj[LLAMA_MOE_PROJ_UP].present || proj[LLAMA_MOE_PROJ_GATE_UP].present;
}

bool expert_layer_layout::same_signature(const expert_layer_layout & other) const {
    for (int p = 0; p < LLAMA_MOE_PROJ_COUNT; ++p) {
        const auto & a = proj[p];
        const auto & b = other.proj[p];
        if (a.present != b.present || a.type != b.type || a.ne[0] != b.ne[0] || a.ne[1] != b.ne[1]) {
            return false;
        }
    }
    return true;
}

uint64_t expert_layer_layout::n_bytes() const {
    uint64_t n = 0;
    for (const auto & p : proj) {
        n += p.present ? p.n_bytes : 0;
    }
    return n;
}

static std::string errno_text() {
    return std::strerror(errno);
}

// integer metadata of any width; -1 if absent
static int64_t gguf_get_int(const gguf_context * ctx, const std::string & key) {
    const int64_t id = gguf_find_key(ctx, key.c_str());
    if (id < 0) {
        return -1;
    }
    switch (gguf_get_kv_type(ctx, id)) {
        case GGUF_TYPE_UINT8:  return gguf_get_val_u8(ctx, id);
        case GGUF_TYPE_INT8:   return gguf_get_val_i8(ctx, id);
        case GGUF_TYPE_UINT16: return gguf_get_val_u16(ctx, id);
        case GGUF_TYPE_INT16:  return gguf_get_val_i16(ctx, id);
        case GGUF_TYPE_UINT32: return gguf_get_val_u32(ctx, id);
        case GGUF_TYPE_INT32:  return gguf_get_val_i32(ctx, id);
        case GGUF_TYPE_UINT64: return (int64_t) gguf_get_val_u64(ctx, id);
        case GGUF_TYPE_INT64:  return gguf_get_val_i64(ctx, id);
        default:               return -1;
    }
}

// an integer key, or the largest of an integer array (per-layer values); -1 if missing
static int64_t gguf_get_int_max(const gguf_context * ctx, const std::string & key) {
    const int64_t id = gguf_find_key(ctx, key.c_str());
    if (id < 0 || gguf_get_kv_type(ctx, id) != GGUF_TYPE_ARRAY) {
        return gguf_get_int(ctx, key);
    }
    const enum gguf_type t = gguf_get_arr_type(ctx, id);
    int64_t best = -1;
    for (size_t i = 0; i < gguf_get_arr_n(ctx, id); ++i) {
        const void * d = gguf_get_arr_data(ctx, id);
        int64_t v = -1;
        switch (t) {
            case GGUF_TYPE_UINT32: v = ((const uint32_t *) d)[i]; break;
            case GGUF_TYPE_INT32:  v = ((const int32_t *) d)[i];  break;
            default: return -1;
        }
        best = std::max(best, v);
    }
    return best;
}

// limits of the llama.cpp underneath (llama-hparams.h)
static constexpr int64_t LLAMA_MAX_LAYERS_LIMIT  = 512;
static constexpr int64_t LLAMA_MAX_EXPERTS_LIMIT = 1024;

// llama.cpp's load_hparams checks these with GGML_ASSERT: a value out of range aborts the
// process, the application that loaded the model with it, and with llama-cpp-python's
// stderr muted nothing is printed. They are checked here first, each error naming the key
// and the range llama.cpp allows.
// a token for an error message: printable ASCII as is, other bytes as \xNN, at most 40
static std::string printable(std::string_view s) {
    std::string out;
    for (size_t i = 0; i < s.size() && out.size() < 40; ++i) {
        const unsigned char c = (unsigned char) s[i];
        if (c >= 0x20 && c < 0x7f && c != '"' && c != '\\') {
            out += (char) c;
        } else {
            char hex[5];
            snprintf(hex, sizeof(hex), "\\x%02x", c);
            out += hex;
        }
    }
    return out;
}

// llama.cpp's vocabulary loader asserts (aborts the process) on a token list that holds a
// token twice; a list of another type or length is its own clean error there
static void check_tokenizer(const gguf_context * ctx, const std::string & path) {
    const int64_t id = gguf_find_key(ctx, "tokenizer.ggml.tokens");
    if (id < 0 || gguf_get_kv_type(ctx, id) != GGUF_TYPE_ARRAY || gguf_get_arr_type(ctx, id) != GGUF_TYPE_STRING) {
        return;
    }
    const size_t n = gguf_get_arr_n(ctx, id);
    std::unordered_map<std::string_view, size_t> seen;
    seen.reserve(n);
    for (size_t i = 0; i < n; ++i) {
        const auto [it, fresh] = seen.emplace(gguf_get_arr_str(ctx, id, i), i);
        if (!fresh) {
            throw hobbit_error(HOBBIT_STATUS_ERROR_FORMAT, path + ": tokenizer.ggml.tokens holds \"" + printable(it->first) +
                "\" twice (tokens " + std::to_string(it->second) + " and " + std::to_string(i) +
                "); llama.cpp needs every token once");
        }
    }
}

static void check_llama_hparams(const gguf_context * ctx, const std::string & arch, const std::string & path) {
    const auto has = [&](const std::string & key) { return gguf_find_key(ctx, key.c_str()) >= 0; };
    const auto fail = [&](const std::string & key, int64_t value, const std::string & allowed) {
        throw hobbit_error(HOBBIT_STATUS_ERROR_FORMAT, path + ": " + key + " is " +
            (has(key) ? std::to_string(value) : std::string("missing")) + "; llama.cpp needs " + allowed);
    };
    const std::string k_layer = arch + ".block_count";
    const int64_t n_layer = gguf_get_int(ctx, k_layer);
    if (!has(k_layer) || n_layer < 1 || n_layer > LLAMA_MAX_LAYERS_LIMIT) {
        fail(k_layer, n_layer, "1.." + std::to_string(LLAMA_MAX_LAYERS_LIMIT));
    }
    const std::string k_nextn = arch + ".nextn_predict_layers";
    const int64_t n_nextn = gguf_get_int(ctx, k_nextn);
    if (has(k_nextn) && (n_nextn < 0 || n_nextn > n_layer)) {
        fail(k_nextn, n_nextn, "0.." + std::to_string(n_layer) + " (the block count)");
    }
    const std::string k_expert = arch + ".expert_count";
    const int64_t n_expert = has(k_expert) ? gguf_get_int(ctx, k_expert) : 0;
    if (n_expert < 0 || n_expert > LLAMA_MAX_EXPERTS_LIMIT) {
        fail(k_expert, n_expert, "0.." + std::to_string(LLAMA_MAX_EXPERTS_LIMIT));
    }
    const std::string k_used = arch + ".expert_used_count";
    const int64_t n_used = has(k_used) ? gguf_get_int_max(ctx, k_used) : 0; // a value, or the largest per layer
    if (n_expert > 0 && (n_used < 1 || n_used > n_expert)) {
        fail(k_used, n_used, "1.." + std::to_string(n_expert) + " (the expert count)");
    }
    if (n_expert == 0 && n_used != 0) {
        fail(k_used, n_used, "0 for a model without experts (" + k_expert + " is 0 or missing)");
    }
    const std::string k_groups = arch + ".expert_group_count";
    const int64_t n_groups = has(k_groups) ? gguf_get_int(ctx, k_groups) : 0;
    if (n_expert > 0 && (n_groups < 0 || n_groups >= n_expert)) {
        fail(k_groups, n_groups, "0.." + std::to_string(n_expert - 1) + " (below the expert count)");
    }
    if (n_expert == 0 && n_groups != 0) {
        fail(k_groups, n_groups, "0 for a model without experts");
    }
    if (n_groups > 1) {
        const std::string k_group_used = arch + ".expert_group_used_count";
        const int64_t n_group_used = has(k_group_used) ? gguf_get_int(ctx, k_group_used) : 0;
        if (n_expert % n_groups != 0) {
            fail(k_groups, n_groups, "a divisor of the expert count (" + std::to_string(n_expert) + ")");
        }
        if (n_group_used < 1 || n_group_used >= n_groups) {
            fail(k_group_used, n_group_used, "1.." + std::to_string(n_groups - 1) + " (below the group count)");
        }
    }
}

namespace {

using gguf_ptr = std::unique_ptr<gguf_context, decltype(&gguf_free)>;

// one file's GGUF header, checked: a regular file, a GGUF, every tensor's data inside it
gguf_ptr open_header(const std::string & path, int64_t & file_bytes) {
    struct stat st;
    if (stat(path.c_str(), &st) != 0) {
        throw hobbit_error(HOBBIT_STATUS_ERROR_IO, path + ": cannot open model file: " + errno_text());
    }
    if (S_ISDIR(st.st_mode)) {
        throw hobbit_error(HOBBIT_STATUS_ERROR_IO, path + ": is a directory, not a GGUF model file");
    }
    if (!S_ISREG(st.st_mode)) {
        // a FIFO would block open() until a writer comes; a device is no model file either
        throw hobbit_error(HOBBIT_STATUS_ERROR_IO, path + ": is not a regular file (a FIFO, socket or device), not a GGUF model file");
    }
    file_bytes = st.st_size;
    {
        const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
        if (fd < 0) {
            throw hobbit_error(HOBBIT_STATUS_ERROR_IO, path + ": cannot open model file: " + errno_text());
        }
        char magic[4] = {0, 0, 0, 0};
        const ssize_t n = pread(fd, magic, sizeof(magic), 0);
        close(fd);
        if (n != (ssize_t) sizeof(magic) || memcmp(magic, "GGUF", 4) != 0) {
            throw hobbit_error(HOBBIT_STATUS_ERROR_FORMAT, path + ": not a GGUF file (it does not start with the GGUF magic)");
        }
    }
    gguf_init_params gparams = { /*no_alloc*/ true, /*ctx*/ nullptr };
    gguf_ptr ctx(gguf_init_from_file(path.c_str(), gparams), gguf_free);
    if (!ctx) {
        throw hobbit_error(HOBBIT_STATUS_ERROR_FORMAT, path + ": the GGUF header is corrupt or truncated");
    }
    // every tensor's data must lie inside the file: a truncated download fails here, not mid-run
    const uint64_t data_offset = gguf_get_data_offset(ctx.get());
    for (int64_t t = 0; t < gguf_get_n_tensors(ctx.get()); ++t) {
        const uint64_t end = data_offset + gguf_get_tensor_offset(ctx.get(), t) + gguf_get_tensor_size(ctx.get(), t);
        if (end > (uint64_t) file_bytes) {
            throw hobbit_error(HOBBIT_STATUS_ERROR_FORMAT, path + ": truncated: tensor '" + gguf_get_tensor_name(ctx.get(), t) +
                "' ends at byte " + std::to_string(end) + " but the file has " + std::to_string(file_bytes) + " bytes");
        }
    }
    return ctx;
}

// a split model's part number (split.no, from 0) and count (split.count); 0 and 1 for one file
std::pair<int64_t, int64_t> split_of(const gguf_context * ctx) {
    return { std::max<int64_t>(0, gguf_get_int(ctx, "split.no")), std::max<int64_t>(1, gguf_get_int(ctx, "split.count")) };
}

// a split model's file names, llama.cpp's (llama_split_prefix, llama_split_path), from its first
std::vector<std::string> split_part_paths(const std::string & first, int n_split) {
    std::vector<char> buf(first.size() + 64);
    const int32_t n = llama_split_prefix(buf.data(), buf.size(), first.c_str(), 0, n_split);
    if (n <= 0) {
        char name[64];
        snprintf(name, sizeof(name), "NAME-00001-of-%05d.gguf", n_split);
        throw hobbit_error(HOBBIT_STATUS_ERROR_FORMAT, first + ": the first of a model split into " + std::to_string(n_split) +
            " files, but not named as llama.cpp finds the others (" + name + ")");
    }
    const std::string prefix(buf.data(), n);
    std::vector<std::string> paths;
    for (int i = 0; i < n_split; ++i) {
        const int32_t m = llama_split_path(buf.data(), buf.size(), prefix.c_str(), i, n_split);
        paths.emplace_back(buf.data(), m);
    }
    return paths;
}

}  // namespace

expert_index expert_index::from_file(const std::string & path) {
    expert_index idx;
    idx.path = path;
    idx.parts = { path };
    hobbit_model_info & info = idx.info;

    std::vector<gguf_ptr> headers;
    headers.push_back(open_header(path, info.file_bytes));
    const auto [split_no, n_split] = split_of(headers[0].get());
    if (n_split > 1 && split_no != 0) {
        std::vector<char> prefix(path.size() + 1);
        const int32_t n = llama_split_prefix(prefix.data(), prefix.size(), path.c_str(), (int) split_no, (int) n_split);
        std::vector<char> first(path.size() + 64);
        const std::string hint = n > 0 && llama_split_path(first.data(), first.size(), prefix.data(), 0, (int) n_split) > 0
            ? std::string(" (") + first.data() + ")" : std::string();
        throw hobbit_error(HOBBIT_STATUS_ERROR_FORMAT, path + ": part " + std::to_string(split_no + 1) + " of a model split into " +
            std::to_string(n_split) + " files; give its first part" + hint);
    }
    if (n_split > 1) {
        idx.parts = split_part_paths(path, (int) n_split);
        idx.parts[0] = path;  // as given (llama_split_path spells the same file)
        for (int i = 1; i < n_split; ++i) {
            int64_t bytes = 0;
            try {
                headers.push_back(open_header(idx.parts[i], bytes));
            } catch (const hobbit_error & e) {
                throw hobbit_error(e.status, path + ": part " + std::to_string(i + 1) + " of " + std::to_string(n_split) +
                                   " of this split model: " + e.what());
            }
            const auto [no, count] = split_of(headers.back().get());
            if (no != i || count != n_split) {
                throw hobbit_error(HOBBIT_STATUS_ERROR_FORMAT, idx.parts[i] + ": says it is part " + std::to_string(no + 1) + " of " +
                    std::to_string(count) + ", but its name makes it part " + std::to_string(i + 1) + " of " +
                    std::to_string(n_split) + " of " + path);
            }
            info.file_bytes += bytes;
        }
    }
    // every tensor, by name: the part it is in and its index there (llama.cpp refuses a name twice)
    std::unordered_map<std::string, std::pair<int, int64_t>> tensors;
    for (int i = 0; i < (int) headers.size(); ++i) {
        for (int64_t t = 0; t < gguf_get_n_tensors(headers[i].get()); ++t) {
            const std::string name = gguf_get_tensor_name(headers[i].get(), t);
            if (!tensors.emplace(name, std::make_pair(i, t)).second) {
                throw hobbit_error(HOBBIT_STATUS_ERROR_FORMAT, idx.parts[i] + ": tensor '" + name + "' is in an earlier part too");
            }
        }
    }
    const int64_t n_tensors_expected = n_split > 1 ? gguf_get_int(headers[0].get(), "split.tensors.count") : -1;
    if (n_tensors_expected >= 0 && n_tensors_expected != (int64_t) tensors.size()) {
        throw hobbit_error(HOBBIT_STATUS_ERROR_FORMAT, path + ": split.tensors.count says " + std::to_string(n_tensors_expected) +
            " tensors, its " + std::to_string(n_split) + " parts hold " + std::to_string(tensors.size()));
    }
    // the model's metadata is in its first file
    const gguf_ptr & ctx = headers[0];

    const int64_t arch_id = gguf_find_key(ctx.get(), "general.architecture");
    if (arch_id < 0 || gguf_get_kv_type(ctx.get(), arch_id) != GGUF_TYPE_STRING) {
        throw hobbit_error(HOBBIT_STATUS_ERROR_FORMAT, path + ": no general.architecture in the GGUF metadata; not a model file");
    }
    const std::string arch = gguf_get_val_str(ctx.get(), arch_id);
    snprintf(info.arch, sizeof(info.arch), "%s", arch.c_str());

    check_llama_hparams(ctx.get(), arch, path); // before anything is sized from them
    check_tokenizer(ctx.get(), path);
    for (auto [key, field] : { std::pair<const char *, std::string *>{ "hobbitpy.companion.of", &idx.made_of },
                               std::pair<const char *, std::string *>{ "hobbitpy.companion.of_fingerprint", &idx.made_of_fingerprint } }) {
        const int64_t id = gguf_find_key(ctx.get(), key);
        if (id >= 0 && gguf_get_kv_type(ctx.get(), id) == GGUF_TYPE_STRING) {
            *field = gguf_get_val_str(ctx.get(), id);
        }
    }
    const int64_t layout_id = gguf_find_key(ctx.get(), "hobbitpy.companion.neuron_layout");
    idx.neuron_layout = layout_id >= 0 && gguf_get_kv_type(ctx.get(), layout_id) == GGUF_TYPE_BOOL &&
                        gguf_get_val_bool(ctx.get(), layout_id);
    info.n_layer       = (int32_t) std::max<int64_t>(0, gguf_get_int(ctx.get(), arch + ".block_count"));
    info.n_expert      = (int32_t) std::max<int64_t>(0, gguf_get_int(ctx.get(), arch + ".expert_count"));
    info.n_expert_used = (int32_t) std::max<int64_t>(0, gguf_get_int(ctx.get(), arch + ".expert_used_count"));
    info.n_embd        = (int32_t) std::max<int64_t>(0, gguf_get_int(ctx.get(), arch + ".embedding_length"));
    info.n_split       = (int32_t) n_split;
    info.uniform       = true;
    info.n_head        = (int32_t) std::max<int64_t>(1, gguf_get_int_max(ctx.get(), arch + ".attention.head_count"));
    info.n_head_kv     = (int32_t) std::max<int64_t>(1, gguf_get_int_max(ctx.get(), arch + ".attention.head_count_kv"));
    if (gguf_get_int_max(ctx.get(), arch + ".attention.head_count_kv") < 0) {
        info.n_head_kv = info.n_head;
    }
    const int64_t head_k = gguf_get_int(ctx.get(), arch + ".attention.key_length");
    const int64_t head_v = gguf_get_int(ctx.get(), arch + ".attention.value_length");
    info.n_embd_head_k = (int32_t) (head_k > 0 ? head_k : info.n_embd / info.n_head);
    info.n_embd_head_v = (int32_t) (head_v > 0 ? head_v : info.n_embd_head_k);
    info.n_ctx_train   = (int32_t) std::max<int64_t>(0, gguf_get_int(ctx.get(), arch + ".context_length"));
    for (const auto & [name, where] : tensors) {
        const int64_t * ne = gguf_get_tensor_ne(headers[where.first].get(), where.second);
        const auto ends_with = [&](const char * suffix) {
            const size_t n = strlen(suffix);
            return name.size() >= n && name.compare(name.size() - n, n, suffix) == 0;
        };
        if (name == "token_embd.weight") {
            info.n_vocab = (int32_t) ne[1];
        } else if (ends_with("ffn_gate_exps.weight") || ends_with("ffn_up_exps.weight") || ends_with("ffn_gate_up_exps.weight")) {
            info.n_ff_expert = std::max(info.n_ff_expert, (int32_t) ne[1]);
        } else if (ends_with("ffn_up.weight") || ends_with("ffn_up_shexp.weight")) {
            info.n_ff_dense = std::max(info.n_ff_dense, (int32_t) ne[1]);
        }
    }

    idx.layers.resize(info.n_layer);
    const expert_layer_layout * first = nullptr;
    for (int il = 0; il < info.n_layer; ++il) {
        expert_layer_layout & layer = idx.layers[il];
        for (int p = 0; p < LLAMA_MOE_PROJ_COUNT; ++p) {
            const std::string name = "blk." + std::to_string(il) + "." + proj_tensor_suffix[p];
            const auto found = tensors.find(name);
            if (found == tensors.end()) {
                continue;
            }
            const gguf_context * part = headers[found->second.first].get();
            const int64_t t = found->second.second;
            expert_proj_layout & pl = layer.proj[p];
            const int64_t * ne = gguf_get_tensor_ne(part, t);
            pl.present = true;
            pl.part    = found->second.first;
            pl.type    = gguf_get_tensor_type(part, t);
            pl.ne[0]   = ne[0];
            pl.ne[1]   = ne[1];
            pl.ne[2]   = ne[2];
            if (ne[2] != info.n_expert || ne[3] != 1) {
                throw hobbit_error(HOBBIT_STATUS_ERROR_FORMAT, path + ": tensor '" + name + "' has " + std::to_string(ne[2]) +
                    " experts but the metadata says " + std::to_string(info.n_expert));
            }
            pl.n_bytes = ggml_row_size((ggml_type) pl.type, ne[0]) * ne[1];
            pl.offset  = gguf_get_data_offset(part) + gguf_get_tensor_offset(part, t);
        }
        // a neuron layout's up holds down too (prepare --neuron-layout): down is not there
        const bool has_down = idx.neuron_layout ? layer.proj[LLAMA_MOE_PROJ_UP].present : layer.proj[LLAMA_MOE_PROJ_DOWN].present;
        if (has_down != (layer.proj[LLAMA_MOE_PROJ_UP].present || layer.proj[LLAMA_MOE_PROJ_GATE_UP].present) ||
            (idx.neuron_layout && layer.proj[LLAMA_MOE_PROJ_DOWN].present)) {
            throw hobbit_error(HOBBIT_STATUS_ERROR_FORMAT, path + ": layer " + std::to_string(il) + " has an incomplete set of expert tensors");
        }
        if (!layer.has_experts()) {
            continue;
        }
        info.n_layer_moe++;
        info.expert_bytes_total += (int64_t) layer.n_bytes() * info.n_expert;
        for (int p = 0; p < LLAMA_MOE_PROJ_COUNT; ++p) {
            // a neuron layout's up (with down) is read by runs of neurons, never whole: the
            // readers' buffers need not hold it (read_at reads long runs in parts)
            const bool whole = layer.proj[p].present && !(idx.neuron_layout && p == LLAMA_MOE_PROJ_UP);
            info.max_slice_bytes = std::max<int64_t>(info.max_slice_bytes, whole ? (int64_t) layer.proj[p].n_bytes : 0);
        }
        if (first == nullptr) {
            first = &layer;
        }
        // the runtime keeps one pool per signature, each holding at least one token's top-k
        bool seen = false;
        for (int j = 0; j < il && !seen; ++j) {
            seen = idx.layers[j].has_experts() && idx.layers[j].same_signature(layer);
        }
        if (!seen) {
            info.min_budget_bytes += (int64_t) layer.n_bytes() * info.n_expert_used;
        }
        info.uniform = info.uniform && first->same_signature(layer);
    }
    if (first != nullptr) {
        info.expert_bytes = (int64_t) first->n_bytes();
    }
    return idx;
}

std::string expert_index::fingerprint() const {
    if (!fingerprint_cache.empty()) {
        return fingerprint_cache;
    }
    std::vector<int> fds(parts.size(), -1);
    std::string error;
    for (size_t i = 0; i < parts.size() && error.empty(); ++i) {
        fds[i] = open(parts[i].c_str(), O_RDONLY | O_CLOEXEC);
        if (fds[i] < 0) {
            error = parts[i] + ": cannot open model file: " + errno_text();
        }
        // no readahead: the kernel's would read up to read_ahead_kb around each 4 KB read, megabytes
        // of experts in the page cache (charged to a memory cap, counted by no budget) that a
        // ladder never reads again
        posix_fadvise(fds[i], 0, 0, POSIX_FADV_RANDOM);
    }
    if (error.empty()) {
        try {
            fingerprint_cache = fingerprint_of(fds);
        } catch (const hobbit_error & e) {
            error = e.what();
        }
    }
    for (const int fd : fds) {
        if (fd >= 0) {
            close(fd);
        }
    }
    if (!error.empty()) {
        throw hobbit_error(HOBBIT_STATUS_ERROR_IO, error);
    }
    return fingerprint_cache;
}

std::string expert_index::fingerprint_of(const std::vector<int> & fds) const {
    uint64_t h = 0xcbf29ce484222325ull; // FNV-1a 64
    std::vector<uint8_t> buf;
    for (const expert_layer_layout & layer : layers) {
        for (const expert_proj_layout & p : layer.proj) {
            if (!p.present) {
                continue;
            }
            const uint64_t size = p.n_bytes * (uint64_t) p.ne[2];
            const uint64_t n = std::min<uint64_t>(4096, size);
            for (const uint64_t at : { p.offset, p.offset + size - n }) {
                buf.resize(n);
                const ssize_t got = pread(fds[p.part], buf.data(), n, (off_t) at);
                if (got != (ssize_t) n) {
                    throw hobbit_error(HOBBIT_STATUS_ERROR_IO, parts[p.part] + ": cannot read the experts to fingerprint them: " +
                                       (got < 0 ? errno_text() : std::string("unexpected end of file")));
                }
                for (uint8_t b : buf) {
                    h = (h ^ b) * 0x100000001b3ull;
                }
            }
        }
    }
    char hex[17];
    snprintf(hex, sizeof(hex), "%016llx", (unsigned long long) h);
    return hex;
}

void expert_index::check_companion(const expert_index & companion) const {
    const auto mismatch = [&](const std::string & what) {
        return hobbit_error(HOBBIT_STATUS_ERROR_FORMAT, companion.path + " does not hold the experts of " + path + ": " + what);
    };
    const hobbit_model_info & a = info;
    const hobbit_model_info & b = companion.info;
    if (std::string(a.arch) != b.arch) {
        throw mismatch(std::string("architecture ") + b.arch + ", the model's is " + a.arch);
    }
    const std::pair<const char *, std::pair<int64_t, int64_t>> sizes[] = {
        { "block_count",       { a.n_layer,       b.n_layer } },
        { "expert_count",      { a.n_expert,      b.n_expert } },
        { "expert_used_count", { a.n_expert_used, b.n_expert_used } },
        { "embedding_length",  { a.n_embd,        b.n_embd } },
    };
    for (const auto & [key, v] : sizes) {
        if (v.first != v.second) {
            throw mismatch(std::string(key) + " " + std::to_string(v.second) + ", the model's is " + std::to_string(v.first));
        }
    }
    for (int il = 0; il < a.n_layer; ++il) {
        for (int p = 0; p < LLAMA_MOE_PROJ_COUNT; ++p) {
            const expert_proj_layout & pa = layers[il].proj[p];
            const expert_proj_layout & pb = companion.layers[il].proj[p];
            const std::string name = "blk." + std::to_string(il) + "." + proj_tensor_suffix[p];
            // a neuron layout bundles each neuron's down column with its up row: down's rows are in up
            const bool bundled = companion.neuron_layout && p == LLAMA_MOE_PROJ_UP;
            const bool in_up   = companion.neuron_layout && p == LLAMA_MOE_PROJ_DOWN;
            if (in_up && pb.present) {
                throw mismatch("tensor '" + name + "' is there; a neuron layout holds down within up");
            }
            if (!in_up && pa.present != pb.present) {
                throw mismatch("tensor '" + name + "' is " + (pb.present ? "there but not in the model" : "missing"));
            }
            const int64_t ne1 = bundled ? pb.ne[1] / 2 : pb.ne[1];
            if (pa.present && pb.present && (pa.ne[0] != pb.ne[0] || pa.ne[1] != ne1 || (bundled && pb.ne[1] % 2 != 0) ||
                                             pa.ne[2] != pb.ne[2])) {
                throw mismatch("tensor '" + name + "' has shape [" + std::to_string(pb.ne[0]) + ", " + std::to_string(pb.ne[1]) + ", " +
                               std::to_string(pb.ne[2]) + "], the model's is [" + std::to_string(pa.ne[0]) + ", " +
                               std::to_string(pa.ne[1]) + ", " + std::to_string(pa.ne[2]) + "]");
            }
        }
    }
    // the same shapes are not the same model: another model's experts would serve silently
    if (!companion.made_of_fingerprint.empty() && companion.made_of_fingerprint != fingerprint()) {
        throw mismatch("it was made of the experts of another model (" + companion.made_of + ", fingerprint " +
                       companion.made_of_fingerprint + "; this one's is " + fingerprint() + ")");
    }
}
