// hobbit.h - C API of the hobbitpy expert runtime.
//
// The runtime keeps the routed experts of a MoE GGUF model on disk and runs them
// through a budgeted pool of slots in memory, loaded on demand by an I/O thread.
// It plugs into the patched libllama through llama_moe_offload (see llama.h).
//
// Usage sketch:
//     struct hobbit_model_info info;
//     hobbit_inspect_model(path, &info, err, sizeof(err));      // validate, sizes, minimum budget
//     struct hobbit_params p = hobbit_default_params();
//     p.budget_bytes = ...;                                      // >= info.min_budget_bytes
//     hobbit_request_offload(&p, err, sizeof(err));              // arms the next model load on this thread
//     model = llama_model_load_from_file(path, mparams);         // the runtime attaches itself
//     rt = hobbit_runtime_of_model(model);                       // borrowed, freed with the model
//     ... llama_decode ...; hobbit_runtime_get_stats(rt, &stats);
//
// No C++ exception crosses this boundary: entry points return a hobbit_status and
// write a message naming the file and the problem into err.

#pragma once

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(_WIN32)
#    define HOBBIT_API __declspec(dllexport)
#else
#    define HOBBIT_API __attribute__((visibility("default")))
#endif

struct llama_model;
struct llama_vocab;
typedef struct hobbit_runtime hobbit_runtime;

enum hobbit_status {
    HOBBIT_STATUS_OK             =  0,
    HOBBIT_STATUS_ERROR_IO       = -1, // cannot open or read a file
    HOBBIT_STATUS_ERROR_FORMAT   = -2, // not a GGUF, truncated, inconsistent tensors
    HOBBIT_STATUS_ERROR_BUDGET   = -3, // budget below the minimum
    HOBBIT_STATUS_ERROR_NOT_MOE  = -4, // the model has no routed experts
    HOBBIT_STATUS_ERROR_INVALID  = -5, // bad argument
    HOBBIT_STATUS_ERROR_INTERNAL = -6,
};

enum hobbit_policy {
    HOBBIT_POLICY_LRU      = 0, // least recently used
    HOBBIT_POLICY_LFU      = 1, // least frequently used in this sequence
    HOBBIT_POLICY_LHU      = 2, // least often used at high precision in this sequence (HOBBIT §3.4)
    HOBBIT_POLICY_FLD      = 3, // farthest layer distance: the layer that comes again last
    HOBBIT_POLICY_RANDOM   = 4,
    HOBBIT_POLICY_WEIGHTED = 5, // HOBBIT eq. 3: policy_weights mix LRU, LFU, LHU and FLD
    HOBBIT_POLICY_ARC      = 6, // adaptive replacement cache (Megiddo & Modha; Fate §4.4)
    HOBBIT_POLICY_POPULARITY = 7, // Fiddler's static placement: evicts the expert a profile saw selected least (ties:
                                  // least recently used), so the popular experts, warmed first, stay for the session;
                                  // needs expert_popularity
    HOBBIT_POLICY_SCORE      = 8, // importance-driven scheduling §5.3: evicts the expert with the lowest router score
                                  // averaged over the last HOBBIT_SCORE_HISTORY tokens, selected or not (ties: least
                                  // recently used); the layer being computed stays pinned (its "protection shield")
    HOBBIT_POLICY_FREQUENCY  = 9, // LFU seeded by a profile and aged: evicts the expert the run selected least, a
                                  // profile (expert_popularity, optional) counting as a few tokens' selections
                                  // before the first, the counts halved as they grow (ties: least recently used)
};

#define HOBBIT_SCORE_HISTORY 16

// precision levels: 0 is the model's own experts (high) or a companion at the precision chosen
// for it, then optional companion files with the same experts at lower precision (`hobbitpy
// prepare`): [high, low] or [high, mid, low]
#define HOBBIT_MAX_LEVELS 3
#define HOBBIT_AUTO_LOW_SHARE 0.85f
// with Fate's prompt share (prefill_low_share) and a decode that wants the high level only, the
// low level holds a prompt's least popular experts of two layers (the one computing, the next
// one prefetched), and never more than this share of the budget (the rest is decode's)
#define HOBBIT_PROMPT_LOW_MAX_SHARE 0.15f
// the least popular experts that hold a share of a prompt's selections are about twice as many
// as that share of the experts (measured on 512-token windows at share 0.2: 3 of 8 experts a
// layer on ref-mixtral, 10 of 24 on ref-deepseek, medians; uniform routing would need 2 and 5)
#define HOBBIT_PROMPT_LOW_SKEW 2.0f

// I/O threads reading experts: more cannot keep a disk busier, and each holds its own buffers
#define HOBBIT_MAX_IO_THREADS 64
// a row reader's buffer (n_row_readers): the longest read it makes; a longer run of neuron rows is
// cut into reads of this size for several readers
#define HOBBIT_ROW_READ_BYTES (64 * 1024)

// what a hit at another precision than the wanted one does (mixed precision)
enum hobbit_hit_policy {
    HOBBIT_HIT_FOUND   = 0, // use the copy found, at whatever precision
    HOBBIT_HIT_UPGRADE = 1, // use it, and load the wanted precision in the background when it was lower and the
                            // expert is some token's first (top-1) selection
    HOBBIT_HIT_EXACT   = 2, // serve exactly the wanted precision (load it when missing; skip when the rule says skip)
    HOBBIT_HIT_AT_LEAST = 3, // a copy at the wanted precision or a higher one serves; a miss loads the wanted one:
                             // never lower than the rule asks (HOBBIT's dynamic loading with the model's precision
                             // kept for every hit), unless this very ubatch holds every such slot
};

// where a missed expert runs (HOBBIT §4, Fiddler's Algorithm 1)
enum hobbit_mode {
    HOBBIT_MODE_GPU_CENTRIC = 0, // load it into a pool slot (in place only when a ubatch needs more experts than the pools hold)
    HOBBIT_MODE_COOPERATIVE = 1, // compute it in place on the model's mapped weights (the cache fills by prefetch and warm-up)
    HOBBIT_MODE_AUTO        = 2, // per expert and ubatch, by the latency model measured at start-up
    HOBBIT_MODE_BALANCED    = 3, // per wave, the misses split between loads and in place so that both take
                                 // even time (importance-driven scheduling's Algorithm 2; hobbit-executor-choice.h)
};

// weights of HOBBIT's eq. 3; they should sum to 1
struct hobbit_policy_weights {
    float lru, lfu, lhu, fld;
};

#define HOBBIT_PREFETCH_WIDTH_FATE (-1)

struct hobbit_params {
    int64_t budget_bytes;    // bytes for expert slots; >= hobbit_model_info.min_budget_bytes
    enum hobbit_policy policy;                  // which cached expert to evict
    struct hobbit_policy_weights policy_weights; // HOBBIT_POLICY_WEIGHTED only
    uint64_t seed;                              // HOBBIT_POLICY_RANDOM only
    int32_t prefetch_layers; // 0 = load on demand only; 1 = during decode, also prefetch the experts the next layer's router picks on this layer's input
    int32_t prefetch_width;  // experts prefetched per predicted layer, best first: 0 = the model's k (its top-k); more
                             // widens the set past the top-k (Fate §4.3: the expert a prediction misses is mostly
                             // ranked just below it), at most n_expert; HOBBIT_PREFETCH_WIDTH_FATE = Fate's rule, the
                             // experts above the 75th percentile of the predicted scores (a quarter), at least k + 1
    int32_t shallow_layers;  // -1 = one pool per expert signature, shared by every MoE layer; >= 0 = a pool per MoE layer
                             // (Fate's shallow-favoring allocation, §4.4: the first shallow_layers MoE layers hold all
                             // of their experts, the rest of the budget is split evenly over the deeper ones; the
                             // policy ranks within a layer), at the highest precision level; a lower level is one pool
                             // shared by every layer. The budget must hold every layer's top-k; no expert_levels
    bool    prefill_popular_first; // a wide ubatch (a prompt) loads the next MoE layer's experts while this one
                                   // computes: true = in descending order of the tokens its router is predicted to
                                   // send to each (Fate §4.5; needs prefetch_layers >= 1 for the router), so the
                                   // room the pools have goes to the experts most of the prompt will use; false = in
                                   // expert order
    float   prefill_low_share; // Fate §4.5 (popularity-aware hybrid quantization; lossy; n_level > 1): in a prompt's
                               // ubatch, the least popular experts whose tokens together make up at most this share
                               // of its selections are served at the lowest level (loaded there when missing, and
                               // the next layer's predicted least popular prefetched there); 0 = off
    float   substitute_alpha;  // importance-driven scheduling's expert-cache router (its Algorithm 1; lossy): in
                               // decode, a selection scoring below (1 + alpha) times the best unselected score (β)
                               // that is not cached is replaced by the best cached unselected expert scoring in
                               // [(1 - alpha) β, β], its gate weight renormalized; 0 = off (exact)
    float   neuron_threshold; // CORM's neuron sparsity (§4.1-4.2; lossy): in every MoE layer after the first, a
                              // selected expert's neurons whose |SiLU| of the gate projection of the previous MoE
                              // layer's input is below this add nothing (computed as zero); < 0 = off (exact); 0 =
                              // on, every neuron kept (exact too). Needs separate gate and up projections
    float   neuron_limit;     // with neuron_threshold: an expert keeping more than this share of its neurons runs
                              // whole (CORM's upper limit, 0.75 for Mixtral)
    bool    neuron_reads;     // with neuron_threshold and level_paths[0] a companion of `prepare --neuron-layout`:
                              // read experts neuron by neuron, W1 first (hobbit-neuron-reads.h) instead of
                              // predicting from the previous layer: the gate projection whole, then the rows of
                              // up and down its activations keep (every MoE layer, the first too); one level
    bool    direct_io;       // read with O_DIRECT (bypassing the page cache) where the file system allows it
    bool    cpu_repack;      // pools on the CPU in the buffer type that repacks a type it has kernels for (Q4_0,
                             // Q4_K, IQ4_NL, ...), as llama.cpp places weights by default; false: plain host memory,
                             // as with its --no-repack. Give it the model load's use_extra_bufts: pooled experts then
                             // compute with the kernels stock uses at that setting, and give its bits
    int32_t n_io_threads;    // threads reading experts (2 keeps the disk busy while one copies; 1 = strict queue order)
    int32_t n_row_readers;   // with neuron_reads: threads reading neuron rows only, each with a buffer of
                             // HOBBIT_ROW_READ_BYTES per level (0..HOBBIT_MAX_IO_THREADS; 0 = the n_io_threads read
                             // them): rows are many small reads, which a disk serves at its bandwidth only with
                             // many in flight, and the whole-slice buffers of n_io_threads are too dear for that
    int32_t neuron_bridge;   // with neuron_reads: a gap of at most this many rows between two runs of missing kept
                             // neurons is read with them (one request instead of two, for the gap's bytes); 0 or more

    // mixed precision (HOBBIT §3.2); n_level = 1 serves every expert from the model at its own precision
    int32_t n_level;                                // 1..HOBBIT_MAX_LEVELS
    const char * level_paths[HOBBIT_MAX_LEVELS];    // [1..n_level-1]: expert-only GGUF of the same model (copied at request);
                                                    // [0]: NULL = the model's own experts are the high level, else a
                                                    // companion is (a precision ladder: the model file's experts are
                                                    // then never read, and nothing runs in place)
    float   level_shares[HOBBIT_MAX_LEVELS];        // how the budget above the minimum is split among the levels; all 0 =
                                                    // automatic: the lowest level gets room for all of its experts, up to
                                                    // HOBBIT_AUTO_LOW_SHARE of the budget, the others share the rest evenly
                                                    // (with prefill_low_share and t1 = 1: room for two layers' share of a
                                                    // prompt's experts, up to HOBBIT_PROMPT_LOW_MAX_SHARE)
    float   t1;            // a selection's score (eq. 2) <= t1: high precision
    float   t_mid;         // three levels: score <= t_mid: the middle level
    float   t2;            // score > t2: a missed expert is skipped (no output this token)
    bool    skip_cached;   // score > t2: skipped even when cached (its compute saved, not only its load), also with
                           // one level or a static placement; false: only a missed expert is (HOBBIT)
    enum hobbit_hit_policy hit_policy; // a hit at another precision than the wanted one
    enum hobbit_mode mode; // where missed experts run; in place needs an expert type the CPU does not repack
    int64_t page_cache_room_bytes; // memory left for the page cache beside the pools (auto mode computes a wide
                                   // ubatch's misses in place only within it: under a tight memory cap faulted-in
                                   // weights would evict each other); -1 = no limit known
    bool    warm_low;      // at start, fill the lowest level's pool with its experts in the background: every
                           // selection then has a copy in memory (a hit at the precision found) once it is done;
                           // then the free slots of the higher levels (with several levels or a high companion)
    // a static placement: the level each expert is served at, [n_layer_moe][n_expert] in the order of the
    // layers that have experts (e.g. the experts that carry the most gate weight high, the rest low, as many
    // high as the budget holds: `hobbitpy tune`'s "placed" ladders). The thresholds t1/t_mid are then not
    // used, and t2 skips only with skip_cached; the budget is split among the levels by the bytes placed at
    // each (exactly those bytes when it holds them all), and warm-up loads each expert at its level. NULL:
    // none (copied at request)
    const int8_t * expert_levels;
    int32_t n_expert_levels; // entries in expert_levels (n_layer_moe * n_expert), 0 with NULL
    // a popularity profile (Fiddler §3: how often a trace of calibration text selected each expert),
    // [n_layer_moe][n_expert] in the order of the layers that have experts: what HOBBIT_POLICY_POPULARITY ranks
    // by, HOBBIT_POLICY_FREQUENCY's prior, and the order warm-up fills the pools in (most popular first, also
    // with one precision level; the highest level's pools too when warm_low is off).
    // NULL: none (copied at request)
    const float * expert_popularity;
    int32_t n_expert_popularity; // entries in expert_popularity, 0 with NULL
};

// The range of each numeric field of hobbit_params that has one, inclusive (HUGE_VAL: no bound on
// that side; NaN is outside every range): hobbit_request_offload and the runtime refuse a value
// outside it, and hobbitpy's OffloadConfig checks its options by this same table
struct hobbit_param_range {
    const char * name;   // the field of hobbit_params
    double       min;
    double       max;
    bool         integer; // an int32_t field (else a float)
};

struct hobbit_model_info {
    char    arch[64];              // general.architecture
    int32_t n_layer;               // transformer blocks
    int32_t n_layer_moe;           // blocks with routed experts (0 = dense model)
    int32_t n_expert;              // routed experts per MoE block
    int32_t n_expert_used;         // experts selected per token
    int32_t n_embd;                // hidden size
    int64_t expert_bytes;          // bytes of one expert of the first MoE block, all projections (the size of its slot)
    int64_t expert_bytes_total;    // bytes of every routed expert in the file
    int64_t min_budget_bytes;      // smallest budget: one token's top-k in every pool (one pool per expert signature)
    int64_t file_bytes;            // size of the GGUF file (of all its parts, split)
    bool    uniform;               // every MoE block has the same expert shapes and types (else one pool per signature)
    int32_t n_split;               // files the model is split into (split.count; 1 = one file)
    // what sizes a context's buffers (KV cache, compute buffer, logits), read from the metadata and tensor shapes
    int32_t n_vocab;               // rows of token_embd
    int32_t n_head;                // attention heads (the largest, when given per layer)
    int32_t n_head_kv;             // key/value heads (the largest)
    int32_t n_embd_head_k;         // key length per head
    int32_t n_embd_head_v;         // value length per head
    int32_t n_ff_expert;           // width of a routed expert's gate/up rows (the largest)
    int32_t n_ff_dense;            // width of a dense FFN or shared expert (the largest; 0 = none)
    int32_t n_ctx_train;           // context length the model was trained with
    int64_t max_slice_bytes;       // the largest slice of one expert's projection: what a reader's buffer holds
};

struct hobbit_stats {
    int64_t expert_hits;           // selected experts found in the pool (counted once per layer and ubatch)
    int64_t expert_misses;         // selected experts loaded on demand
    int64_t expert_inplace;        // selected experts computed in place from the mapped file (no free slot in a large ubatch)
    int64_t bytes_read;            // bytes read from the file into slots (on demand and prefetch)
    int64_t n_reads;               // expert loads completed
    int64_t prefetch_issued;       // prefetch loads queued
    int64_t prefetch_used;         // prefetched experts later selected while still cached
    int64_t loads_overlapped;      // loads that completed while the graph computed between two MoE layers, no dispatch waiting
    int64_t stall_us;              // time dispatch waited for loads
    int64_t io_us;                 // time from a load's first read to its last, summed over loads
    int64_t peak_pool_bytes;       // most slot bytes ever holding an expert
    int64_t budget_bytes;          // budget the pool was sized from
    int64_t pool_bytes;            // bytes allocated for slots (n_slot * expert_bytes) and neuron rows
    int32_t n_slot;                // slots in the pool
    bool    direct_io;             // O_DIRECT actually in use
    int32_t n_level;               // precision levels in use
    int64_t served[HOBBIT_MAX_LEVELS]; // selections (token, expert) served at each level (0 = high)
    int64_t n_skipped;             // selections skipped: score above t2 and not cached (or, skip_cached, cached too)
    int64_t upgrades;              // background loads of the wanted precision after a lower-precision hit
    int64_t prefetch_wasted;       // prefetched experts evicted or dropped before any use
    int64_t warm_loads;            // loads queued at start to fill the pools, the lowest level first (warm_low)
    int32_t mode;                  // enum hobbit_mode in effect (gpu-centric when in place is not possible)
    double  load_bytes_per_s;      // latency model (auto mode): one load's bandwidth at start-up
    double  map_bytes_per_s;       // and faulting the same bytes in through the mapping
    int64_t demand_bytes_read;     // of bytes_read, what a dispatch waited for (on-demand loads; the rest ran in the background)
    int64_t dispatch_us;           // time the dispatch ops spent deciding and bookkeeping (their waits are stall_us)
    int64_t background_bytes_read; // of bytes_read, what loaded in the background (prefetch, upgrades, warm-up)
    int64_t n_substituted;         // selections replaced by a cached expert of similar score (substitute_alpha)
    int64_t neuron_selections;     // neuron_threshold: selections whose neurons the previous layer's input predicted
                                   // (every MoE layer after the first), or, with neuron_reads, their gate's activations
    int64_t neuron_whole;          // ... of them run whole (more than neuron_limit of their neurons kept)
    double  neuron_kept;           // ... the sum over them of the share of neurons kept (1 for a whole one)
    int64_t neuron_reads;          // neuron_reads: read requests of runs of neurons' rows (of up and of down)
};

// counters of one pool (one per expert signature; index 0 .. n_pool-1)
struct hobbit_pool_stats {
    int64_t hits;
    int64_t misses;
    int64_t bytes_read;
    int64_t expert_bytes;          // bytes of one slot
    int32_t n_slot;
    int32_t n_layer;               // MoE layers this pool serves
    int32_t level;                 // precision level (0 = the model's own experts)
    int32_t type;                  // ggml type of its down projection
};

// one routing trace replayed through one cache (hobbit_simulate_cache)
struct hobbit_sim_trace {
    int32_t n_tokens;
    int32_t n_layer;               // MoE layers in the trace
    int32_t n_expert;
    int32_t n_expert_used;
    const int32_t * experts;        // [n_tokens][n_layer][n_expert_used]; -1 = none
    const uint8_t * seq_start;      // [n_tokens], 1 where a sequence begins (sequence-level records reset); may be NULL
    const uint8_t * high_precision; // [n_tokens][n_layer][n_expert_used], 0 = served at low precision; NULL = all high
    const float *   scores;         // [n_tokens][n_layer][n_expert] router scores (probabilities), for substitution and
                                    // the score policy; may be NULL
    const float *   popularity;     // [n_layer][n_expert] the profile the "popularity" policy ranks by; NULL for the others
    const int32_t * predicted;      // [n_tokens][n_layer][n_lookahead][n_expert_used] the predictor's guesses for the
                                    // next layers, as the trace recorded them; NULL = no prefetch
    int32_t n_lookahead;
    int32_t prefetch_layers;        // after each layer, load the next P layers' guesses (P <= n_lookahead; not belady)
};

struct hobbit_sim_result {
    int64_t accesses;              // distinct (token, layer, expert) selections
    int64_t hits;
    int64_t misses_high;
    int64_t misses_low;
    double  miss_penalty;          // misses_high + misses_low * low_miss_cost (HOBBIT §3.4)
    int64_t substituted;           // selections served by a cached expert of similar score instead (substitute_alpha)
    int64_t prefetched;            // experts loaded ahead of their layer (prefetch_layers): read too
    int64_t prefetch_used;         // of those, selected before they were evicted
};

HOBBIT_API struct hobbit_params hobbit_default_params(void);
// the ranges of hobbit_params' numeric fields (n entries; a static table)
HOBBIT_API const struct hobbit_param_range * hobbit_param_ranges(int32_t * n);

// validate a GGUF file and describe its experts; works for dense models too (n_layer_moe = 0)
HOBBIT_API enum hobbit_status hobbit_inspect_model(const char * path, struct hobbit_model_info * info, char * err, size_t err_size);

// the fingerprint of a model's experts (16 hex digits and a NUL into out, out_size >= 17): what a
// companion records of the model it was made of, checked when the companion is used
HOBBIT_API enum hobbit_status hobbit_model_fingerprint(const char * path, char * out, size_t out_size, char * err, size_t err_size);

// one expert's bytes, all its projections, in each MoE layer of a GGUF (a model or a companion), in
// layer order, into out (n_max entries); *n: the MoE layers. Read from the header alone (a llama.cpp
// mix gives some layers a wider down type). ERROR_INVALID if out is too small
HOBBIT_API enum hobbit_status hobbit_layer_expert_bytes(const char * path, int64_t * out, int32_t n_max, int32_t * n,
                                                        char * err, size_t err_size);

// the files a model is made of (its one file, or the parts of a split model named as llama.cpp
// finds them from the first), each followed by a NUL, into out; ERROR_INVALID if out is too small
HOBBIT_API enum hobbit_status hobbit_model_parts(const char * path, char * out, size_t out_size, char * err, size_t err_size);

// llama_tokenize, with what llama.cpp's tokenizer throws (a vocabulary without the byte
// tokens its fallback looks up) turned into a status and a message instead of an abort.
// *n_tokens: as llama_tokenize returns it (negative: the tokens needed, n_tokens_max too small)
HOBBIT_API enum hobbit_status hobbit_tokenize(const struct llama_vocab * vocab, const char * text, int32_t text_len,
                                              int32_t * tokens, int32_t n_tokens_max, bool add_special,
                                              bool parse_special, int32_t * n_tokens, char * err, size_t err_size);

// arm the next llama_model_load_from_file() on this thread to attach an expert runtime
HOBBIT_API enum hobbit_status hobbit_request_offload(const struct hobbit_params * params, char * err, size_t err_size);

// disarm a request whose load did not happen (the load consumes it otherwise)
HOBBIT_API void hobbit_cancel_offload_request(void);

// why the runtime could not attach during the last load on this thread; false if it did
HOBBIT_API bool hobbit_last_attach_error(char * buf, size_t size);

// the runtime attached to a model, or NULL; owned by the model
HOBBIT_API hobbit_runtime * hobbit_runtime_of_model(const struct llama_model * model);

HOBBIT_API void hobbit_runtime_get_stats(const hobbit_runtime * rt, struct hobbit_stats * stats);
HOBBIT_API void hobbit_runtime_reset_stats(hobbit_runtime * rt);
// the device the expert pools live on, as ggml names it ("CPU", "CUDA0", ...); owned by ggml
HOBBIT_API const char * hobbit_runtime_pool_device(const hobbit_runtime * rt);

// last error of the runtime (a failed read during decode); returns true and fills buf if there is one
HOBBIT_API bool hobbit_runtime_get_error(const hobbit_runtime * rt, char * buf, size_t size);
HOBBIT_API void hobbit_runtime_clear_error(hobbit_runtime * rt);

// counters of pool i of the runtime; false if there is no such pool
HOBBIT_API bool hobbit_runtime_get_pool_stats(const hobbit_runtime * rt, int32_t pool, struct hobbit_pool_stats * stats);

// start recording routing (clears what was recorded): for every token and MoE layer, the
// selected experts, gate weights, router probabilities and, for 1..lookahead (<= 4) layers
// ahead, that layer's router's top-k on this layer's router input; keep_inputs: the router
// inputs too (n_embd floats per token and layer)
HOBBIT_API enum hobbit_status hobbit_runtime_trace_begin(hobbit_runtime * rt, int32_t lookahead, bool keep_inputs,
                                                         char * err, size_t err_size);
// tokens recorded so far (complete in every MoE layer); lookahead in use written to *lookahead
HOBBIT_API int64_t hobbit_runtime_trace_size(const hobbit_runtime * rt, int32_t * n_moe_layer, int32_t * lookahead);
// copy the first n tokens: experts/weights [n][n_moe_layer][n_expert_used], probs
// [n][n_moe_layer][n_expert], predicted [n][n_moe_layer][lookahead][n_expert_used], inputs
// [n][n_moe_layer][n_embd] (zeros unless kept); pointers may be NULL
HOBBIT_API void hobbit_runtime_trace_copy(const hobbit_runtime * rt, int64_t n, int32_t * experts, float * weights,
                                          float * probs, int32_t * predicted, float * inputs);
// stop recording and free the record
HOBBIT_API void hobbit_runtime_trace_end(hobbit_runtime * rt);

// a new sequence begins: sequence-level policy records (LFU, LHU) reset
HOBBIT_API void hobbit_runtime_new_sequence(hobbit_runtime * rt);

// replay a trace through a cache of n_slot slots under policy ("lru", "lfu", "lhu", "fld",
// "random", "weighted" with weights, "arc", "popularity" with the trace's popularity, "score"
// with its scores, or "belady": the offline optimum) - the runtime's own
// policy code, offline. substitute_alpha > 0 (needs the trace's scores): each selection first
// goes through the runtime's substitution (hobbit_params.substitute_alpha); not with belady,
// whose future is the trace as routed
// the slots of each of n_layer MoE layers' pools (a pool per layer, hobbit_params.shallow_layers)
// as the runtime deals budget_bytes: one token's top-k each, the first n_shallow whole while
// the budget lasts, then the others a slot each in turn; experts of expert_bytes in every layer
HOBBIT_API enum hobbit_status hobbit_pool_plan_per_layer(int32_t n_layer, int64_t expert_bytes, int32_t n_expert_used,
                                                         int32_t n_expert, int64_t budget_bytes, int32_t n_shallow,
                                                         int32_t * slots, char * err, size_t err_size);

HOBBIT_API enum hobbit_status hobbit_simulate_cache(const struct hobbit_sim_trace * trace, const char * policy,
                                                    const struct hobbit_policy_weights * weights, int32_t n_slot,
                                                    uint64_t seed, double low_miss_cost, float substitute_alpha,
                                                    struct hobbit_sim_result * result, char * err, size_t err_size);

// a run's routing as the runtime served it, ubatch by ubatch (hobbit_replay_trace)
struct hobbit_replay_trace {
    int32_t n_tokens;
    int32_t n_layer;               // the model's MoE layers
    int32_t n_expert;
    int32_t n_expert_used;
    const int32_t * experts;        // [n_tokens][n_layer][n_expert_used]; -1 = none
    const float *   weights;        // [n_tokens][n_layer][n_expert_used] their gate weights
    const uint8_t * ubatch_start;   // [n_tokens], 1 where a ubatch begins; NULL = every token its own
    const uint8_t * seq_start;      // [n_tokens], 1 where a sequence begins (the policies' records reset); may be NULL
};

// what the runtime that params would make of the model at path counts serving the trace (the
// expert cache itself, driven as the dispatch drives it, every load completing at once): hits,
// misses, bytes read, selections served at each level, the pools' size. gpu-centric without
// prefetch, substitution or neuron options only (what the trace alone decides)
HOBBIT_API enum hobbit_status hobbit_replay_trace(const char * model_path, const struct hobbit_params * params,
                                                  const struct hobbit_replay_trace * trace, struct hobbit_stats * stats,
                                                  char * err, size_t err_size);

// a trace's selections with the neurons each needs, replayed through CORM's neuron cache
// (hobbit-neuron-sim-cache.h): a cached expert holds some of its neurons, a selection reads the
// ones it needs and lacks, the whole expert above limit (0: always whole, expert-granular)
struct hobbit_neuron_sim {
    int32_t n_tokens;
    int32_t n_layer;               // MoE layers in the trace
    int32_t n_expert;
    int32_t n_expert_used;
    int32_t n_neuron;              // neurons of an expert (n_ff)
    const int32_t * experts;       // [n_tokens][n_layer][n_expert_used]; -1 = none
    const uint8_t * need_w1;       // [n_tokens][n_layer][n_expert_used][(n_neuron + 7) / 8]: rows of W1 needed, bit i
                                   // of byte i / 8 = neuron i; NULL = every neuron
    const uint8_t * need_rest;     // the same for the rows of W3 and columns of W2
    int64_t neuron_bytes;          // one neuron of one projection
    int64_t budget_bytes;
    double  limit;
};

struct hobbit_neuron_sim_result {
    int64_t accesses;              // selections replayed
    int64_t hits;                  // ... that read nothing
    int64_t whole;                 // ... over the limit: the whole expert needed
    int64_t bytes_read;
    int64_t requests;              // reads, one per run of consecutive neurons per projection
};

HOBBIT_API enum hobbit_status hobbit_simulate_neurons(const struct hobbit_neuron_sim * sim,
                                                      struct hobbit_neuron_sim_result * result, char * err,
                                                      size_t err_size);

// importance matrix of the routed experts (what llama-imatrix collects, expert tensors only):
// per "*_exps" tensor and expert, the sum over the tokens routed to it of each input column's
// square, and the token count. Pass hobbit_imatrix_collect as a stock context's cb_eval with
// the collector as its user data, decode text, then read the entries (in name order).
typedef struct hobbit_imatrix hobbit_imatrix;
struct ggml_tensor;
HOBBIT_API hobbit_imatrix * hobbit_imatrix_new(void);
HOBBIT_API void hobbit_imatrix_free(hobbit_imatrix * im);
HOBBIT_API bool hobbit_imatrix_collect(struct ggml_tensor * t, bool ask, void * im);
// entries collected; -1 if a node had a layout the collector does not know (no matrix then)
HOBBIT_API int32_t hobbit_imatrix_count(hobbit_imatrix * im);
// entry i's weight name, columns and matrices (experts); pointers may be NULL
HOBBIT_API bool hobbit_imatrix_entry(hobbit_imatrix * im, int32_t i, char * name, size_t name_size,
                                     int64_t * n_col, int64_t * n_mat);
// entry i's sums [n_mat][n_col] and token counts [n_mat], as float (llama.cpp's file layout)
HOBBIT_API void hobbit_imatrix_copy(hobbit_imatrix * im, int32_t i, float * sums, float * counts);

// CORM's sparse neurons priced on a stock context (hobbit-neuron-mask.cpp): pass
// hobbit_neuron_mask_apply as its cb_eval with the mask as user data; after each routed
// expert's gate projection, the neurons with |SiLU(W1 x)| <= theta are zeroed (add nothing),
// x the layer's own input (predicted false: an oracle) or the previous MoE layer's (predicted:
// CORM's one-layer-ahead prediction; the first MoE layer whole). A selection keeping more
// than limit of its neurons is computed whole (CORM loads the whole expert then).
typedef struct hobbit_neuron_mask hobbit_neuron_mask;
HOBBIT_API hobbit_neuron_mask * hobbit_neuron_mask_new(float theta, bool predicted, float limit);
HOBBIT_API void hobbit_neuron_mask_free(hobbit_neuron_mask * m);
HOBBIT_API bool hobbit_neuron_mask_apply(struct ggml_tensor * t, bool ask, void * m);
// selections seen, how many were computed whole, and the mean share of neurons kept; false if
// the mask failed (a gate output it could not read, or no memory): the logits were not priced
HOBBIT_API bool hobbit_neuron_mask_stats(hobbit_neuron_mask * m, int64_t * n_selections, int64_t * n_whole,
                                         double * kept_share);

// Q2_K blocks of nrows rows of n_per_row floats (a multiple of 256), byte for byte what
// ggml_quantize_chunk writes for Q2_K without an importance matrix, several times faster
// (hobbit-quantize.cpp); returns the bytes written, 0 if n_per_row is not whole blocks
HOBBIT_API size_t hobbit_quantize_q2_K(const float * src, void * dst, int64_t nrows, int64_t n_per_row);

// A bound on the bytes one thread's Python code may ask for while a budget is open
// (hobbit-heap-budget.cpp): hobbit_raw_allocator has the layout of CPython's PyMemAllocatorEx.
// hobbit_heap_budget_wrap fills `wrapped` with an allocator that calls `current` (the raw
// domain's, from PyMem_GetAllocator); install it with PyMem_SetAllocator, GIL held. While this
// thread's budget is open, a request past what is left (other than a page or less) gets NULL,
// a MemoryError in Python; close returns whether one did.
struct hobbit_raw_allocator {
    void * ctx;
    void * (*malloc)(void * ctx, size_t size);
    void * (*calloc)(void * ctx, size_t count, size_t size);
    void * (*realloc)(void * ctx, void * ptr, size_t size);
    void (*free)(void * ctx, void * ptr);
};
HOBBIT_API void hobbit_heap_budget_wrap(const struct hobbit_raw_allocator * current,
                                        struct hobbit_raw_allocator * wrapped);
HOBBIT_API void hobbit_heap_budget_open(int64_t bytes);
HOBBIT_API bool hobbit_heap_budget_close(void);

// ggml abort callback (llama_set_abort_callback with data = the runtime): stops a decode
// whose expert loads failed, so it returns an error instead of garbage
HOBBIT_API bool hobbit_abort_callback(void * rt);

#ifdef __cplusplus
}
#endif
