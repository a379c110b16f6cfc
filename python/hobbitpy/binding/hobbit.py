"""libhobbit's C API as Python functions: the only calls into it outside this folder.

Each takes and gives Python values or the cffi structs of `hobbit.h` (built with `ffi`),
owns the error buffer a call writes into, and raises what its status means: a
`ModelFileError` for a file, a `TokenizeError` for text, a `HobbitError` otherwise.
"""

from __future__ import annotations

import ctypes
import os

from ..errors import HobbitError, ModelFileError, TokenizeError
from .native import error_buffer, ffi, lib, to_str

OK = lib.HOBBIT_STATUS_OK
ROW_READ_BYTES = lib.HOBBIT_ROW_READ_BYTES  # what one neuron row read spans (hobbit.h)
PREFETCH_WIDTH_FATE = lib.HOBBIT_PREFETCH_WIDTH_FATE


def address(function) -> int:
    """A C function's address, for the callbacks llama.cpp takes (cb_eval, the abort callback)."""
    return int(ffi.cast("uintptr_t", function))


# ---------------------------------------------------------------- model files

def inspect_model(path: str):
    """struct hobbit_model_info of a GGUF file; ModelFileError naming the file and the problem."""
    info = ffi.new("struct hobbit_model_info *")
    err = error_buffer()
    if lib.hobbit_inspect_model(path.encode(), info, err, len(err)) != OK:
        raise ModelFileError(to_str(err))
    return info


def model_parts(path: str, n_split: int) -> list[str]:
    """The files of a model of n_split parts, named as llama.cpp finds them from the first."""
    size = n_split * (len(os.fsencode(path)) + 1) + 64  # every part's name is as long as the first's
    out = ffi.new("char[]", size)
    err = error_buffer()
    if lib.hobbit_model_parts(path.encode(), out, size, err, len(err)) != OK:
        raise ModelFileError(to_str(err))
    return [os.fsdecode(name) for name in ffi.buffer(out)[:].split(b"\0")[:n_split]]


def layer_expert_bytes(path: str, n_layer: int) -> list[int]:
    """One expert's bytes in each MoE layer of a GGUF of at most n_layer layers, in layer order."""
    out = ffi.new("int64_t[]", max(1, n_layer))
    n = ffi.new("int32_t *")
    err = error_buffer()
    if lib.hobbit_layer_expert_bytes(os.fsencode(path), out, len(out), n, err, len(err)) != OK:
        raise ModelFileError(to_str(err))
    return list(out[0:n[0]])


def model_fingerprint(path: str) -> str:
    out = ffi.new("char[]", 32)
    err = error_buffer()
    if lib.hobbit_model_fingerprint(path.encode(), out, len(out), err, len(err)) != OK:
        raise ModelFileError(to_str(err))
    return ffi.string(out).decode()


# ---------------------------------------------------------------- tokens

def vocab_of(llama_vocab):
    """llama-cpp-python's ctypes pointer to a llama_vocab as this binding's."""
    return ffi.cast("const struct llama_vocab *", ctypes.cast(llama_vocab, ctypes.c_void_p).value)


def tokenize(vocab, text: bytes, n_max: int, add_bos: bool, special: bool) -> tuple[int, list[int]]:
    """llama.cpp's tokenizer on a llama_vocab pointer: (n, ids); n < 0 asks for -n slots.
    TokenizeError for text the vocabulary cannot encode (llama.cpp would abort)."""
    tokens = ffi.new("int32_t[]", max(1, n_max))
    n = ffi.new("int32_t *")
    err = error_buffer()
    if lib.hobbit_tokenize(vocab, text, len(text), tokens, n_max, add_bos, special, n, err, len(err)) != OK:
        raise TokenizeError(to_str(err))
    return n[0], list(tokens[0:max(0, n[0])])


# ---------------------------------------------------------------- settings

def default_params():
    """A new struct hobbit_params holding the C API's defaults (hobbit-params.cpp)."""
    return ffi.new("struct hobbit_params *", lib.hobbit_default_params())


def param_ranges() -> list[tuple[str, float, float, bool]]:
    """(name, min, max, integer) of each numeric field of hobbit_params."""
    n = ffi.new("int32_t *")
    table = lib.hobbit_param_ranges(n)
    return [(ffi.string(table[i].name).decode(), table[i].min, table[i].max, bool(table[i].integer))
            for i in range(n[0])]


# ---------------------------------------------------------------- the runtime

def request_offload(params) -> None:
    """The next model llama.cpp loads gets a runtime with these params (struct hobbit_params *)."""
    err = error_buffer()
    if lib.hobbit_request_offload(params, err, len(err)) != 0:
        raise HobbitError(to_str(err))


def cancel_offload_request() -> None:
    lib.hobbit_cancel_offload_request()


def last_attach_error() -> str | None:
    """Why the last requested runtime could not attach to its model, or None."""
    why = error_buffer()
    return to_str(why) if lib.hobbit_last_attach_error(why, len(why)) else None


def runtime_of_model(model_address: int):
    """The runtime attached to a loaded llama_model (its address), or ffi.NULL."""
    return lib.hobbit_runtime_of_model(ffi.cast("struct llama_model *", model_address))


ABORT_CALLBACK = address(lib.hobbit_abort_callback)  # ggml's abort callback, its data the runtime


def runtime_error(runtime) -> str | None:
    """The runtime's failure (an expert it could not read), cleared as it is read; or None."""
    msg = error_buffer()
    if not lib.hobbit_runtime_get_error(runtime, msg, len(msg)):
        return None
    lib.hobbit_runtime_clear_error(runtime)
    return to_str(msg)


def runtime_stats(runtime=None):
    """struct hobbit_stats of the runtime since load or the last reset (zeros without one)."""
    s = ffi.new("struct hobbit_stats *")
    if runtime is not None and runtime != ffi.NULL:
        lib.hobbit_runtime_get_stats(runtime, s)
    return s


def stats_as_dict(s) -> dict:
    """A struct hobbit_stats as a dict: each counter, and the per-level arrays cut to its levels."""
    out = {}
    for name in dir(s):
        value = getattr(s, name)
        out[name] = value if isinstance(value, (bool, int, float)) else [int(v) for v in value][:s.n_level]
    return out


def replay_trace(model_path: str, params, trace):
    """struct hobbit_stats of a recorded routing (struct hobbit_replay_trace *) served by the cache params makes."""
    s = ffi.new("struct hobbit_stats *")
    err = error_buffer()
    if lib.hobbit_replay_trace(os.fsencode(model_path), params, trace, s, err, len(err)) != 0:
        raise HobbitError(to_str(err))
    return s


def reset_stats(runtime) -> None:
    lib.hobbit_runtime_reset_stats(runtime)


def pool_device(runtime) -> str:
    """Where the runtime's pools live: "CPU", or a GPU ("CUDA0")."""
    return to_str(lib.hobbit_runtime_pool_device(runtime))


def pool_stats(runtime, i: int):
    """struct hobbit_pool_stats of the runtime's pool i, or None past the last."""
    s = ffi.new("struct hobbit_pool_stats *")
    return s if lib.hobbit_runtime_get_pool_stats(runtime, i, s) else None


def new_sequence(runtime) -> None:
    lib.hobbit_runtime_new_sequence(runtime)


def trace_begin(runtime, lookahead: int, with_inputs: bool) -> None:
    err = error_buffer()
    if lib.hobbit_runtime_trace_begin(runtime, lookahead, with_inputs, err, len(err)) != 0:
        raise HobbitError(to_str(err))


def trace_size(runtime, n_layer, depth) -> int:
    """Tokens recorded since trace_begin (n_layer and depth: int32_t * the runtime fills)."""
    return lib.hobbit_runtime_trace_size(runtime, n_layer, depth)


def trace_copy(runtime, n: int, experts, weights, probs, predicted, inputs) -> None:
    lib.hobbit_runtime_trace_copy(runtime, n, experts, weights, probs, predicted, inputs)


def trace_end(runtime) -> None:
    lib.hobbit_runtime_trace_end(runtime)


# ---------------------------------------------------------------- simulators and plans

def pool_plan_per_layer(n_layer: int, expert_bytes: int, n_expert_used: int, n_expert: int, budget_bytes: int,
                        shallow_layers: int) -> list[int]:
    """The slots of each MoE layer's pool as the runtime deals a budget."""
    slots = ffi.new("int32_t[]", n_layer)
    err = error_buffer()
    if lib.hobbit_pool_plan_per_layer(n_layer, expert_bytes, n_expert_used, n_expert, budget_bytes, shallow_layers,
                                      slots, err, len(err)) != 0:
        raise HobbitError(to_str(err))
    return list(slots)


def simulate_cache(trace, policy: str, weights, n_slot: int, seed: int, low_miss_cost: float, alpha: float):
    """struct hobbit_sim_result of a trace (struct hobbit_sim_trace *) through a policy."""
    r = ffi.new("struct hobbit_sim_result *")
    err = error_buffer()
    if lib.hobbit_simulate_cache(trace, policy.encode(), weights, n_slot, seed, low_miss_cost, alpha, r, err,
                                 len(err)) != 0:
        raise HobbitError(to_str(err))
    return r


def simulate_neurons(sim):
    """struct hobbit_neuron_sim_result of one neuron-cache replay (struct hobbit_neuron_sim *)."""
    out = ffi.new("struct hobbit_neuron_sim_result *")
    err = error_buffer()
    if lib.hobbit_simulate_neurons(sim, out, err, len(err)) != 0:
        raise HobbitError(to_str(err))
    return out


# ---------------------------------------------------------------- quantizing and importance

def quantize_q2_k(values, dst) -> int:
    """float32 [rows, n_per_row] into Q2_K rows (libhobbit's copy of ggml's quantizer: the same
    bytes, faster); the bytes written."""
    rows, n_per_row = values.shape
    return lib.hobbit_quantize_q2_K(ffi.from_buffer("float[]", values), ffi.from_buffer(dst), rows, n_per_row)


def imatrix_collector():
    """A new collector of the experts' importance matrix (freed with its last reference)."""
    collector = ffi.gc(lib.hobbit_imatrix_new(), lib.hobbit_imatrix_free)
    if collector == ffi.NULL:
        raise MemoryError("no memory for the importance matrix collector")
    return collector


IMATRIX_CALLBACK = address(lib.hobbit_imatrix_collect)  # llama.cpp's cb_eval, its data a collector


def imatrix_entries(collector) -> list[tuple[str, int, int, object]]:
    """(name, n_col, n_mat, copy) of each tensor the collector saw; copy(sums, counts) fills
    float32 arrays [n_mat, n_col] and [n_mat, 1]."""
    n = lib.hobbit_imatrix_count(collector)
    if n < 0:
        raise HobbitError("an expert matmul had a layout the importance matrix collector does not know")
    entries = []
    name = ffi.new("char[]", 256)
    n_col, n_mat = ffi.new("int64_t *"), ffi.new("int64_t *")
    for i in range(n):
        lib.hobbit_imatrix_entry(collector, i, name, len(name), n_col, n_mat)

        def copy(sums, counts, i=i):
            lib.hobbit_imatrix_copy(collector, i, ffi.from_buffer("float[]", sums), ffi.from_buffer("float[]", counts))

        entries.append((ffi.string(name).decode(), n_col[0], n_mat[0], copy))
    return entries


def neuron_mask(theta: float, predicted: bool, limit: float):
    """A new neuron mask (CORM's, priced on a stock context; freed with its last reference)."""
    mask = lib.hobbit_neuron_mask_new(theta, predicted, limit)
    if mask == ffi.NULL:
        raise MemoryError("no memory for the neuron mask")
    return ffi.gc(mask, lib.hobbit_neuron_mask_free)


NEURON_MASK_CALLBACK = address(lib.hobbit_neuron_mask_apply)  # llama.cpp's cb_eval, its data a mask


def neuron_mask_stats(mask) -> tuple[int, int, float] | None:
    """(selections, whole, mean share kept) the mask saw; None when it failed to read a gate."""
    n, whole, kept = ffi.new("int64_t *"), ffi.new("int64_t *"), ffi.new("double *")
    if not lib.hobbit_neuron_mask_stats(mask, n, whole, kept):
        return None
    return n[0], whole[0], kept[0]


# ---------------------------------------------------------------- the heap budget

def heap_budget_wrap(current, wrapped) -> None:
    """Fill `wrapped` (struct hobbit_raw_allocator *) with an allocator counting into the budget around `current`."""
    lib.hobbit_heap_budget_wrap(current, wrapped)


def heap_budget_open(max_bytes: int) -> None:
    lib.hobbit_heap_budget_open(max_bytes)


def heap_budget_close() -> bool:
    """Close this thread's budget; whether a request failed for it."""
    return bool(lib.hobbit_heap_budget_close())
