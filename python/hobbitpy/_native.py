"""The native libraries: where they are, and the cffi binding of hobbit.h.

libllama and libggml* (patched llama.cpp) and libhobbit (the expert runtime) are
installed in ``hobbitpy/lib``. llama-cpp-python loads that libllama through
``LLAMA_CPP_LIB_PATH``, which ``hobbitpy/__init__.py`` sets before importing it, so
its ``Llama`` and ``libhobbit`` share one llama.cpp in the process.
"""

from __future__ import annotations

import os
import pathlib
import sysconfig

import cffi


def _package_data_root() -> pathlib.Path:
    """The folder holding lib/ and data/: next to this file in a wheel install; in an
    editable install the built files stay in site-packages while the sources do not."""
    here = pathlib.Path(__file__).resolve().parent
    candidates = [here] + [pathlib.Path(sysconfig.get_path(k)) / "hobbitpy" for k in ("platlib", "purelib")]
    for root in candidates:
        if (root / "lib" / "libhobbit.so").exists():
            return root
    raise ImportError("hobbitpy's native libraries are missing (looked in "
                      + ", ".join(str(c / "lib") for c in candidates) + "); reinstall hobbitpy")


_ROOT = _package_data_root()
DATA_DIR = _ROOT / "data"
# HOBBITPY_LIB_DIR: the libraries of another build of the same sources (the sanitizer
# build of scripts/check-sanitizers.sh) instead of the installed ones
LIB_DIR = pathlib.Path(os.environ["HOBBITPY_LIB_DIR"]) if os.environ.get("HOBBITPY_LIB_DIR") else _ROOT / "lib"

# mirrors native/include/hobbit.h (cffi ABI mode computes the layouts from this)
_CDEF = """
typedef struct hobbit_runtime hobbit_runtime;
struct llama_model;
struct llama_vocab;

enum hobbit_status {
    HOBBIT_STATUS_OK             =  0,
    HOBBIT_STATUS_ERROR_IO       = -1,
    HOBBIT_STATUS_ERROR_FORMAT   = -2,
    HOBBIT_STATUS_ERROR_BUDGET   = -3,
    HOBBIT_STATUS_ERROR_NOT_MOE  = -4,
    HOBBIT_STATUS_ERROR_INVALID  = -5,
    HOBBIT_STATUS_ERROR_INTERNAL = -6,
};

enum hobbit_policy {
    HOBBIT_POLICY_LRU      = 0,
    HOBBIT_POLICY_LFU      = 1,
    HOBBIT_POLICY_LHU      = 2,
    HOBBIT_POLICY_FLD      = 3,
    HOBBIT_POLICY_RANDOM   = 4,
    HOBBIT_POLICY_WEIGHTED = 5,
    HOBBIT_POLICY_ARC      = 6,
    HOBBIT_POLICY_POPULARITY = 7,
    HOBBIT_POLICY_SCORE      = 8,
};

struct hobbit_policy_weights {
    float lru, lfu, lhu, fld;
};

#define HOBBIT_MAX_LEVELS 3
#define HOBBIT_MAX_IO_THREADS 64
#define HOBBIT_ROW_READ_BYTES 65536

struct hobbit_params {
    int64_t budget_bytes;
    enum hobbit_policy policy;
    struct hobbit_policy_weights policy_weights;
    uint64_t seed;
    int32_t prefetch_layers;
    int32_t prefetch_width;
    int32_t shallow_layers;
    bool    prefill_popular_first;
    float   prefill_low_share;
    float   substitute_alpha;
    float   neuron_threshold;
    float   neuron_limit;
    bool    neuron_reads;
    bool    direct_io;
    int32_t n_io_threads;
    int32_t n_row_readers;
    int32_t neuron_bridge;
    int32_t n_level;
    const char * level_paths[HOBBIT_MAX_LEVELS];
    float   level_shares[HOBBIT_MAX_LEVELS];
    float   t1;
    float   t_mid;
    float   t2;
    bool    skip_cached;
    int     hit_policy;
    int     mode;
    int64_t page_cache_room_bytes;
    bool    warm_low;
    const int8_t * expert_levels;
    int32_t n_expert_levels;
    const float * expert_popularity;
    int32_t n_expert_popularity;
};

struct hobbit_model_info {
    char    arch[64];
    int32_t n_layer;
    int32_t n_layer_moe;
    int32_t n_expert;
    int32_t n_expert_used;
    int32_t n_embd;
    int64_t expert_bytes;
    int64_t expert_bytes_total;
    int64_t min_budget_bytes;
    int64_t file_bytes;
    bool    uniform;
    int32_t n_split;
    int32_t n_vocab;
    int32_t n_head;
    int32_t n_head_kv;
    int32_t n_embd_head_k;
    int32_t n_embd_head_v;
    int32_t n_ff_expert;
    int32_t n_ff_dense;
    int32_t n_ctx_train;
    int64_t max_slice_bytes;
};

struct hobbit_stats {
    int64_t expert_hits;
    int64_t expert_misses;
    int64_t expert_inplace;
    int64_t bytes_read;
    int64_t n_reads;
    int64_t prefetch_issued;
    int64_t prefetch_used;
    int64_t loads_overlapped;
    int64_t stall_us;
    int64_t io_us;
    int64_t peak_pool_bytes;
    int64_t budget_bytes;
    int64_t pool_bytes;
    int32_t n_slot;
    bool    direct_io;
    int32_t n_level;
    int64_t served[HOBBIT_MAX_LEVELS];
    int64_t n_skipped;
    int64_t upgrades;
    int64_t prefetch_wasted;
    int64_t warm_loads;
    int32_t mode;
    double  load_bytes_per_s;
    double  map_bytes_per_s;
    int64_t demand_bytes_read;
    int64_t dispatch_us;
    int64_t background_bytes_read;
    int64_t n_substituted;
    int64_t neuron_selections;
    int64_t neuron_whole;
    double  neuron_kept;
    int64_t neuron_reads;
};

struct hobbit_pool_stats {
    int64_t hits;
    int64_t misses;
    int64_t bytes_read;
    int64_t expert_bytes;
    int32_t n_slot;
    int32_t n_layer;
    int32_t level;
    int32_t type;
};

struct hobbit_sim_trace {
    int32_t n_tokens;
    int32_t n_layer;
    int32_t n_expert;
    int32_t n_expert_used;
    const int32_t * experts;
    const uint8_t * seq_start;
    const uint8_t * high_precision;
    const float *   scores;
    const float *   popularity;
    const int32_t * predicted;
    int32_t n_lookahead;
    int32_t prefetch_layers;
};

struct hobbit_sim_result {
    int64_t accesses;
    int64_t hits;
    int64_t misses_high;
    int64_t misses_low;
    double  miss_penalty;
    int64_t substituted;
    int64_t prefetched;
    int64_t prefetch_used;
};

struct hobbit_params hobbit_default_params(void);
enum hobbit_status hobbit_inspect_model(const char * path, struct hobbit_model_info * info, char * err, size_t err_size);
enum hobbit_status hobbit_model_fingerprint(const char * path, char * out, size_t out_size, char * err, size_t err_size);
enum hobbit_status hobbit_model_parts(const char * path, char * out, size_t out_size, char * err, size_t err_size);
enum hobbit_status hobbit_tokenize(const struct llama_vocab * vocab, const char * text, int32_t text_len,
                                   int32_t * tokens, int32_t n_tokens_max, bool add_special,
                                   bool parse_special, int32_t * n_tokens, char * err, size_t err_size);
enum hobbit_status hobbit_request_offload(const struct hobbit_params * params, char * err, size_t err_size);
void hobbit_cancel_offload_request(void);
bool hobbit_last_attach_error(char * buf, size_t size);
hobbit_runtime * hobbit_runtime_of_model(const struct llama_model * model);
void hobbit_runtime_get_stats(const hobbit_runtime * rt, struct hobbit_stats * stats);
const char * hobbit_runtime_pool_device(const hobbit_runtime * rt);
enum hobbit_status hobbit_pool_plan_per_layer(int32_t n_layer, int64_t expert_bytes, int32_t n_expert_used,
                                              int32_t n_expert, int64_t budget_bytes, int32_t n_shallow,
                                              int32_t * slots, char * err, size_t err_size);
void hobbit_runtime_reset_stats(hobbit_runtime * rt);
bool hobbit_runtime_get_error(const hobbit_runtime * rt, char * buf, size_t size);
void hobbit_runtime_clear_error(hobbit_runtime * rt);
bool hobbit_runtime_get_pool_stats(const hobbit_runtime * rt, int32_t pool, struct hobbit_pool_stats * stats);
enum hobbit_status hobbit_runtime_trace_begin(hobbit_runtime * rt, int32_t lookahead, bool keep_inputs, char * err,
                                              size_t err_size);
int64_t hobbit_runtime_trace_size(const hobbit_runtime * rt, int32_t * n_moe_layer, int32_t * lookahead);
void hobbit_runtime_trace_copy(const hobbit_runtime * rt, int64_t n, int32_t * experts, float * weights,
                               float * probs, int32_t * predicted, float * inputs);
void hobbit_runtime_trace_end(hobbit_runtime * rt);
void hobbit_runtime_new_sequence(hobbit_runtime * rt);
enum hobbit_status hobbit_simulate_cache(const struct hobbit_sim_trace * trace, const char * policy,
                                         const struct hobbit_policy_weights * weights, int32_t n_slot,
                                         uint64_t seed, double low_miss_cost, float substitute_alpha,
                                         struct hobbit_sim_result * result, char * err, size_t err_size);
bool hobbit_abort_callback(void * rt);
size_t hobbit_quantize_q2_K(const float * src, void * dst, int64_t nrows, int64_t n_per_row);
struct hobbit_raw_allocator {
    void * ctx;
    void * (*malloc)(void * ctx, size_t size);
    void * (*calloc)(void * ctx, size_t count, size_t size);
    void * (*realloc)(void * ctx, void * ptr, size_t size);
    void (*free)(void * ctx, void * ptr);
};
void hobbit_heap_budget_wrap(const struct hobbit_raw_allocator * current, struct hobbit_raw_allocator * wrapped);
void hobbit_heap_budget_open(int64_t bytes);
bool hobbit_heap_budget_close(void);
typedef struct hobbit_imatrix hobbit_imatrix;
struct ggml_tensor;
hobbit_imatrix * hobbit_imatrix_new(void);
void hobbit_imatrix_free(hobbit_imatrix * im);
bool hobbit_imatrix_collect(struct ggml_tensor * t, bool ask, void * im);
int32_t hobbit_imatrix_count(hobbit_imatrix * im);
bool hobbit_imatrix_entry(hobbit_imatrix * im, int32_t i, char * name, size_t name_size, int64_t * n_col, int64_t * n_mat);
void hobbit_imatrix_copy(hobbit_imatrix * im, int32_t i, float * sums, float * counts);
struct hobbit_neuron_sim {
    int32_t n_tokens;
    int32_t n_layer;
    int32_t n_expert;
    int32_t n_expert_used;
    int32_t n_neuron;
    const int32_t * experts;
    const uint8_t * need_w1;
    const uint8_t * need_rest;
    int64_t neuron_bytes;
    int64_t budget_bytes;
    double  limit;
};
struct hobbit_neuron_sim_result {
    int64_t accesses;
    int64_t hits;
    int64_t whole;
    int64_t bytes_read;
    int64_t requests;
};
enum hobbit_status hobbit_simulate_neurons(const struct hobbit_neuron_sim * sim, struct hobbit_neuron_sim_result * result,
                                           char * err, size_t err_size);
typedef struct hobbit_neuron_mask hobbit_neuron_mask;
hobbit_neuron_mask * hobbit_neuron_mask_new(float theta, bool predicted, float limit);
void hobbit_neuron_mask_free(hobbit_neuron_mask * m);
bool hobbit_neuron_mask_apply(struct ggml_tensor * t, bool ask, void * m);
bool hobbit_neuron_mask_stats(hobbit_neuron_mask * m, int64_t * n_selections, int64_t * n_whole, double * kept_share);
"""

ffi = cffi.FFI()
ffi.cdef(_CDEF)
lib = ffi.dlopen(str(LIB_DIR / "libhobbit.so"))

ERROR_BUFFER_SIZE = 1024


def error_buffer():
    """A char buffer for the ``err`` argument of the C API."""
    return ffi.new("char[]", ERROR_BUFFER_SIZE)


def to_str(buf) -> str:
    return ffi.string(buf).decode("utf-8", "replace")
