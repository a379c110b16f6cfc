"""Importance matrix of a model's routed experts, collected on a text, and read back.

ggml's quantizer weighs each column's rounding error by how large that column's inputs
are (the "importance matrix" llama-imatrix collects): with it the low-bit types keep more of
what the model computes, and the lowest ones (IQ2_XXS, IQ2_XS, IQ2_S, IQ1_*) refuse to work
without it. `hobbitpy imatrix` collects it for the expert tensors only — the copies
`prepare` writes — from a stock run of the model on a text (libhobbit's graph callback,
the same accumulation as llama-imatrix), and writes it in llama.cpp's GGUF imatrix layout,
so `llama-quantize --imatrix` reads it too and `prepare --imatrix` reads llama-imatrix's.
"""

from __future__ import annotations

import ctypes
import os
import pathlib
import tempfile

import numpy as np

from ..binding import hobbit
from ..errors import HobbitError, ModelFileError
from ..files.model_file import inspect_model
from ..system.outputs import OutputExistsError, new_output_error, write_new
from ..files.tokens import tokenize_text

# llama.cpp's common/imatrix-loader.h
KEY_DATASETS = "imatrix.datasets"
KEY_CHUNK_COUNT = "imatrix.chunk_count"
KEY_CHUNK_SIZE = "imatrix.chunk_size"
SUMS_SUFFIX = ".in_sum2"
COUNTS_SUFFIX = ".counts"


def default_imatrix_path(model_path: str | os.PathLike) -> pathlib.Path:
    """Where `hobbitpy imatrix` writes by default: next to the model."""
    model_path = pathlib.Path(model_path)
    return model_path.with_name(f"{model_path.stem}.imatrix.gguf")


def collect_imatrix(model_path: str | os.PathLike, text_path: str | os.PathLike, out_path: str | os.PathLike | None = None,
                    *, n_ctx: int | None = None, max_tokens: int | None = None, n_threads: int | None = None,
                    replace: bool = False, repack: bool = True) -> pathlib.Path:
    """Run the model (stock llama.cpp, every expert mapped) over the text in windows of n_ctx
    tokens (default 512, at most the model's training context) and write the experts'
    importance matrix; return its path. A new file (with replace, over a regular file; never
    through a symlink). repack: expert_input_sums' (off where the file does not fit beside
    the repacked copy: run_plan.repack_fits)."""
    model_path = pathlib.Path(model_path)
    out = default_imatrix_path(model_path) if out_path is None else pathlib.Path(out_path)
    error = new_output_error(out, replace)  # checked before minutes of work, and again when written
    if error is not None:
        raise OutputExistsError(error) if os.path.lexists(out) else ValueError(error)
    info = inspect_model(model_path)  # a missing, truncated or foreign file: one clear error
    if not info.is_moe:
        raise ModelFileError(f"{model_path}: no routed expert tensors (ffn_*_exps); nothing to collect")
    if n_ctx is None:
        n_ctx = min(512, info.n_ctx_train or 512)
    if n_ctx < 2:
        raise ValueError(f"the window must be at least 2 tokens, got {n_ctx}")
    try:
        text = pathlib.Path(text_path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise HobbitError(f"{text_path}: cannot read it as UTF-8 text ({e})") from None
    ids = tokenize_text(model_path, text, max_tokens)
    entries, n_chunks = expert_input_sums(model_path, ids, n_ctx, n_threads, repack)
    return write_imatrix(out, entries, dataset=pathlib.Path(text_path).name, chunk_count=n_chunks, chunk_size=n_ctx,
                         replace=replace)


def expert_input_sums(model_path: str | os.PathLike, ids: list[int], n_ctx: int, n_threads: int | None = None,
                      repack: bool = True) -> tuple[dict[str, tuple[np.ndarray, np.ndarray]], int]:
    """Run stock llama.cpp (every expert mapped) over the tokens in windows of n_ctx, each from
    an empty context, and return, for every expert tensor, ([n_expert, n_col] the sums of its
    inputs' squares, [n_expert, 1] the tokens each expert saw), and the windows run. repack:
    the CPU backend's repacked copy of the weights (off, the pass reads the mapping: a model
    larger than the memory passes through the page cache)."""
    import llama_cpp
    from llama_cpp import _internals

    collector = hobbit.imatrix_collector()
    # the backends, as llama_cpp.Llama loads them first (a portable build's CPU backend is a
    # module nothing has loaded yet); loading again later is a no-op
    model_params = llama_cpp.llama_model_default_params()
    model_params.use_extra_bufts = repack
    with llama_cpp._utils.suppress_stdout_stderr(disable=False):  # llama.cpp's load log: not for the terminal
        llama_cpp.llama_backend_init()  # ggml's "loaded ... backend" line
        model = _internals.LlamaModel(path_model=os.fspath(model_path), params=model_params, verbose=False)
    params = llama_cpp.llama_context_default_params()
    params.n_ctx = params.n_batch = params.n_ubatch = n_ctx
    params.n_threads = params.n_threads_batch = n_threads or os.cpu_count() or 1
    params.cb_eval = llama_cpp.ggml_backend_sched_eval_callback(hobbit.IMATRIX_CALLBACK)
    params.cb_eval_user_data = ctypes.c_void_p(hobbit.address(collector))
    with llama_cpp._utils.suppress_stdout_stderr(disable=False):
        context = _internals.LlamaContext(model=model, params=params, verbose=False)
    batch = _internals.LlamaBatch(n_tokens=n_ctx, embd=0, n_seq_max=1, verbose=False)
    n_chunks = 0
    try:
        for start in range(0, len(ids), n_ctx):  # every window starts afresh, as llama-imatrix's chunks do
            window = ids[start: start + n_ctx]
            context.kv_cache_clear()
            # every token's output: llama.cpp computes the last layer for the output rows only
            batch.set_batch(window, n_past=0, logits_all=True)
            context.decode(batch)
            n_chunks += 1
    except RuntimeError as e:  # llama_decode's status
        raise HobbitError(f"{model_path}: llama.cpp could not decode the text ({e})") from None
    finally:
        with llama_cpp._utils.suppress_stdout_stderr(disable=False):  # the context's closing log line
            batch.close()
            context.close()
            model.close()
    entries = _entries(collector)
    if not entries:
        raise HobbitError(f"{model_path}: no expert matmul was seen while decoding; no importance matrix")
    return entries, n_chunks


def expert_input_power(model_path: str | os.PathLike, ids: list[int], n_ctx: int,
                       n_threads: int | None = None) -> dict[str, np.ndarray]:
    """tensor name -> [n_expert, n_col] each expert's mean squared input per column over the
    tokens (expert_input_sums in windows of n_ctx, normalized as llama-quantize does). Repacking
    off: the pass reads the mapping, as stock's best run does where memory is short."""
    sums, _ = expert_input_sums(model_path, ids, n_ctx, n_threads, repack=False)
    return {name: mean_squares(total, counts) for name, (total, counts) in sums.items()}


def _entries(collector) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    entries = {}
    for name, n_col, n_mat, copy in hobbit.imatrix_entries(collector):
        sums = np.zeros((n_mat, n_col), np.float32)
        counts = np.zeros((n_mat, 1), np.float32)
        copy(sums, counts)
        entries[name] = (sums, counts)
    return entries


def mean_squares(sums: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """[n_mat, n_col] each column's mean squared input, from the sums and [n_mat, 1] token counts
    (llama-quantize's normalization: a matrix no token reached weighs every column 1)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(counts > 0, sums / np.where(counts > 0, counts, 1), 1.0).astype(np.float32)


def write_imatrix(out: str | os.PathLike, entries: dict[str, tuple[np.ndarray, np.ndarray]], *, dataset: str,
                  chunk_count: int, chunk_size: int, replace: bool = False) -> pathlib.Path:
    """Write entries (weight name -> ([n_mat, n_col] sums of squares, [n_mat, 1] token counts))
    in llama.cpp's GGUF imatrix layout (outputs.write_new: a new file unless replace)."""
    import gguf

    with tempfile.TemporaryDirectory() as folder:  # GGUFWriter writes to a path: staged, then written new
        staging = pathlib.Path(folder) / "imatrix.gguf"
        writer = gguf.GGUFWriter(staging, arch=None)
        writer.add_type("imatrix")
        writer.add_array(KEY_DATASETS, [dataset])
        writer.add_uint32(KEY_CHUNK_COUNT, chunk_count)
        writer.add_uint32(KEY_CHUNK_SIZE, chunk_size)
        for name, (sums, counts) in entries.items():
            writer.add_tensor(name + SUMS_SUFFIX, np.ascontiguousarray(sums, np.float32))
            writer.add_tensor(name + COUNTS_SUFFIX, np.ascontiguousarray(counts, np.float32))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        data = staging.read_bytes()
    return write_new(out, data, replace)


def load_imatrix(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """weight name -> [n_mat, n_col] mean squared input per column (llama-quantize's
    normalization: sum / count; a matrix no token reached weighs every column 1).
    Reads the GGUF layout (hobbitpy's or llama-imatrix's). Raises ModelFileError."""
    import gguf

    path = pathlib.Path(path)
    try:
        reader = gguf.GGUFReader(path)
    except (OSError, ValueError) as e:
        raise ModelFileError(f"{path}: cannot read it as a GGUF importance matrix ({e})") from None
    field = reader.get_field("general.type")
    if field is None or field.contents() != "imatrix":
        raise ModelFileError(f"{path}: not an importance matrix (a GGUF whose general.type is \"imatrix\", "
                             "as `hobbitpy imatrix` or llama-imatrix write it)")
    tensors = {t.name: t for t in reader.tensors}
    result = {}
    for name, t in tensors.items():
        if not name.endswith(SUMS_SUFFIX):
            continue
        weight = name[: -len(SUMS_SUFFIX)]
        counts_tensor = tensors.get(weight + COUNTS_SUFFIX)
        if counts_tensor is None:
            raise ModelFileError(f"{path}: '{name}' has no '{weight}{COUNTS_SUFFIX}' beside it")
        n_mat = int(counts_tensor.n_elements)
        sums = np.asarray(t.data, np.float32).reshape(-1)
        if n_mat == 0 or sums.size % n_mat:
            raise ModelFileError(f"{path}: '{name}' holds {sums.size} values, not a whole row for each of {n_mat} matrices")
        sums = sums.reshape(n_mat, -1)
        counts = np.asarray(counts_tensor.data, np.float32).reshape(n_mat, 1)
        mean = mean_squares(sums, counts)
        if not np.all(np.isfinite(mean)) or np.any(mean < 0):
            raise ModelFileError(f"{path}: '{name}' holds values that are not finite or negative")
        result[weight] = mean
    if not result:
        raise ModelFileError(f"{path}: holds no importance matrix entries ('*{SUMS_SUFFIX}' tensors)")
    return result
