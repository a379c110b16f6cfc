"""Companion GGUF files: a MoE model's routed experts, and nothing else, in a lower precision.

HOBBIT-style mixed precision loads a less important expert from a low-precision copy
instead of the model. `prepare_companion` writes that copy: every metadata field of the
model (the native runtime indexes a companion with the same code as a model and checks
that both agree), then only the routed expert tensors, same names, shapes and order,
re-quantized by ggml's own quantizer (`ggml_quantize_chunk`, what `llama-quantize`
runs; for Q2_K without an importance matrix, libhobbit's vectorized copy of it, which writes
the same bytes several times faster). The source is read with pread chunk by chunk and back
as numbers by ggml's `to_float`, on threads; the file is written through a partial file
that a failure or a signal removes. The source of the weights is the model itself or,
better, the same model in F16/BF16/F32. Rows that are not whole blocks of the type fall back as
`llama-quant.cpp` does; the file records which tensors did. With an importance matrix
(`hobbitpy imatrix`, or llama-imatrix's file) each expert's rows are quantized weighing
its columns by it, as llama-quantize does, and the lowest-bit types (IQ2_*, IQ1_*) become
available.

With `neuron_layout` the companion serves CORM's neuron-granular reads instead: every expert
tensor in Q8_0 (the model's own Q8_0 blocks come out unchanged), the down projection
transposed so that a neuron's column of W2 is one row of self-contained blocks (CORM
quantizes per neuron for the same reason; that re-quantization is the layout's only loss),
and that row stored right after the neuron's row of W3: the up tensor holds both,
[n_embd, 2 x n_ff, n_expert], row 2f neuron f's up row and row 2f + 1 its down column, and
there is no down tensor. A run of neurons is then one read of both projections (CORM's
neuron bundle), half the requests of two tensors; small requests are what disks are slow at.
Its tensors start on a page (NEURON_LAYOUT_ALIGNMENT), so every bundle starts on a multiple of
512 bytes (a Q8_0 bundle is 17 x 512 bytes per 4096 values of a row): runs of neurons read with
O_DIRECT at a disk's 512-byte granule read no byte of their neighbours.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
import os
import pathlib

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QT

from ..binding import hobbit
from ..binding.ggml import (block_size, can_read_as_float, prepare_quantizer, quantize_into, row_size, rows_as_float,
                            valid_rows)
from .companions import (KEY_FALLBACKS, KEY_IMATRIX, KEY_NEURON_LAYOUT, KEY_OF, KEY_OF_FINGERPRINT, KEY_SOURCE,
                         KEY_TYPE, NEURON_LAYOUT_ALIGNMENT, NEURON_LAYOUT_TYPE, checked_type, companion_type,
                         default_companion_path, default_neuron_layout_path, needs_imatrix)
from ..system.disk import drop_from_page_cache
from ..errors import ModelFileError
from ..files.gguf_fields import field_value
from .imatrix import load_imatrix
from ..files.model_file import model_fingerprint
from ..files.tensor_reads import ModelTensors, TensorReads, n_rows
from ..system.outputs import check_free_space, partial_output, publish
from ..system.progress import progress_bar

EXPERT_SUFFIXES = (".ffn_gate_exps.weight", ".ffn_up_exps.weight", ".ffn_down_exps.weight",
                   ".ffn_gate_up_exps.weight")

# llama-quant.cpp's tensor_type_fallback: the type a tensor gets when its rows are not
# whole blocks of the target type (e.g. DeepSeek-style experts of n_ff 128 in Q2_K)
_FALLBACK = {
    **dict.fromkeys(("IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ4_XS"), "IQ4_NL"),
    **dict.fromkeys(("Q2_0", "Q2_K", "Q3_K", "TQ1_0", "TQ2_0"), "Q4_0"),
    "Q4_K": "Q5_0",
    "Q5_K": "Q5_1",
    "Q6_K": "Q8_0",
}

# the runtime takes a companion only if these agree with its model (expert_index::check_companion)
_SAME_MODEL_KEYS = ("block_count", "expert_count", "expert_used_count", "embedding_length")

_CHUNK_ELEMENTS = 1 << 20  # what one thread dequantizes and quantizes at a time: 4 MB of float32


def prepare_companion(model_path: str | os.PathLike, type_name: str, out_path: str | os.PathLike | None = None,
                      source_path: str | os.PathLike | None = None, threads: int = 2,
                      progress: bool = True, imatrix_path: str | os.PathLike | None = None,
                      neuron_layout: bool = False) -> pathlib.Path:
    """Write the companion of `model_path` holding its routed experts in `type_name`; return its path.

    out_path: default `default_companion_path(model_path, type_name)`; an existing file
    is never overwritten. source_path: the same model in higher precision to quantize
    from (default: the model itself). threads: Python threads quantizing chunks of rows
    (ggml runs without the GIL). Memory: the two largest expert tensors in the new type
    (one written while the next is quantized) plus a few MB per thread (a neuron layout:
    three times its bundled up tensor, up and down quantized apart then interleaved); the
    files are memory-mapped. imatrix_path: an importance matrix of the model's experts
    (needed by IQ2_*/IQ1_* types, used by any type when given).
    Raises ModelFileError (a file is missing, not a GGUF, without experts, or the source is
    another model), ValueError (type, threads, output folder), FileExistsError.
    neuron_layout: the layout of CORM's neuron reads (type Q8_0, up and down bundled by neuron; see the module).
    """
    if neuron_layout and (type_name.upper() != NEURON_LAYOUT_TYPE or imatrix_path is not None):
        raise ValueError(f"a neuron layout is {NEURON_LAYOUT_TYPE}, without an importance matrix")
    qtype = companion_type(type_name, with_imatrix=imatrix_path is not None)
    if threads < 1:
        raise ValueError(f"threads must be at least 1, got {threads}")
    model_path = pathlib.Path(model_path)
    source_path = model_path if source_path is None else pathlib.Path(source_path)
    out = pathlib.Path(out_path) if out_path is not None else (
        default_neuron_layout_path(model_path) if neuron_layout else default_companion_path(model_path, type_name))
    if os.path.lexists(out):  # a dangling symlink too
        raise FileExistsError(f"{out}: already exists; prepare never overwrites a file")
    if not out.parent.is_dir():
        raise ValueError(f"{out}: cannot write it, {out.parent} is not a folder")

    model = source = ModelTensors(model_path)
    if source_path != model_path:
        source = ModelTensors(source_path)
        _check_same_model(model_path, model, source_path, source)
    source_tensors = {t.name: t for t in source.tensors}
    plan = []  # (source tensor, ggml shape written, type written, the down tensor bundled with it or None)
    for t in model.tensors:
        if t.name.endswith(EXPERT_SUFFIXES):
            shape = [int(n) for n in t.shape]  # ggml order: row length first
            down = None
            if neuron_layout and t.name.endswith(".ffn_gate_up_exps.weight"):
                raise ModelFileError(f"{model_path}: '{t.name}' merges gate and up; a neuron layout needs them apart")
            if neuron_layout and _is_down(t.name):
                continue  # bundled with up
            if neuron_layout and t.name.endswith(".ffn_up_exps.weight"):
                down = source_tensors.get(t.name.replace(".ffn_up_exps.", ".ffn_down_exps."))
                if down is None or [int(n) for n in down.shape] != [shape[1], shape[0], *shape[2:]]:
                    raise ModelFileError(f"{model_path}: '{t.name}' has no down projection of the transposed shape "
                                         "beside it; a neuron layout bundles the two")
                shape = [shape[0], 2 * shape[1], *shape[2:]]  # a neuron's up row, then its down column
            row_type = _row_type(qtype, shape[0], t.name, model_path)
            if neuron_layout and row_type != qtype:
                raise ModelFileError(f"{model_path}: '{t.name}' has rows of {shape[0]}, not whole {qtype.name} blocks")
            plan.append((source_tensors[t.name], shape, row_type, down))
    for source_tensor, _, _, down in plan:
        for tensor in (source_tensor, down):
            if tensor is not None:
                _check_readable(tensor, source_path)
    importance = _importance_of(imatrix_path, plan) if imatrix_path is not None else {}

    header_bytes = model.header_bytes  # the model's metadata, copied, and its tensor infos (more than ours)
    data_bytes = sum(row_size(row_type, shape[0]) * int(np.prod(shape[1:])) for _, shape, row_type, _ in plan)
    check_free_space(out.parent, header_bytes + data_bytes, f"{out}")
    # an interrupted run leaves no file under the real name (the partial file is removed, or
    # by the next run if this process is killed)
    with partial_output(out) as tmp:
        writer = gguf.GGUFWriter(tmp, _field(model, "general.architecture"))
        _copy_metadata(model, writer, min_alignment=NEURON_LAYOUT_ALIGNMENT if neuron_layout else None)
        writer.add_string(KEY_OF, model_path.name)
        writer.add_string(KEY_OF_FINGERPRINT, model_fingerprint(model_path))
        writer.add_string(KEY_SOURCE, source_path.name)
        writer.add_string(KEY_TYPE, qtype.name)
        writer.add_array(KEY_FALLBACKS, [f"{t.name}={row_type.name}" for t, _, row_type, _ in plan if row_type != qtype])
        if neuron_layout:
            writer.add_bool(KEY_NEURON_LAYOUT, True)
        if imatrix_path is not None:
            writer.add_string(KEY_IMATRIX, pathlib.Path(imatrix_path).name)
        for t, shape, row_type, _ in plan:
            row_bytes = row_size(row_type, shape[0])
            # numpy order with the row in bytes; GGUFWriter turns it back into elements
            writer.add_tensor_info(t.name, [*reversed(shape[1:]), row_bytes], np.dtype(np.uint8),
                                   row_bytes * int(np.prod(shape[1:])), raw_dtype=row_type)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for row_type in {row_type for _, _, row_type, _ in plan}:
            prepare_quantizer(row_type)
        total = sum(int(t.n_bytes) + (int(down.n_bytes) if down is not None else 0) for t, _, _, down in plan)
        reads = TensorReads(source)
        pool = ThreadPoolExecutor(threads)
        # a tensor is written while the next one is quantized (the cores are the bound: they
        # should not wait for the disk)
        writes = ThreadPoolExecutor(1)
        written = None  # the write in flight
        try:
            with progress_bar(total=total, unit="B", unit_scale=True, unit_divisor=1024, disable=not progress,
                      desc=f"{qtype.name} experts") as bar:
                for t, shape, row_type, down in plan:
                    if down is not None:
                        up_rows = _quantize(t, shape[0], row_type, pool, bar.update, reads)
                        down_rows = _quantize_transposed(down, shape[0], row_type, pool, bar.update, reads)
                        bundled = np.stack([up_rows.reshape(down_rows.shape), down_rows], axis=2)  # [expert, neuron, up|down, row]
                        data = bundled.reshape(-1, bundled.shape[-1])
                    else:
                        data = _quantize(t, shape[0], row_type, pool, bar.update, reads, importance.get(t.name))
                    if written is not None:
                        written.result()
                    written = writes.submit(writer.write_tensor_data, data)
                if written is not None:
                    written.result()
        finally:  # on an error or a signal, the chunks not yet started are dropped, not waited for
            pool.shutdown(wait=True, cancel_futures=True)
            writes.shutdown(wait=True)
            reads.close()
        writer.close()
        # written out, then out of the page cache: at real size gigabytes the run that follows
        # (inside a memory cap, which counts them) would otherwise find taken
        drop_from_page_cache(tmp)
        try:
            publish(tmp, out)
        except FileExistsError:
            raise FileExistsError(f"{out}: already exists; prepare never overwrites a file") from None
    return out




def _row_type(target: QT, n_per_row: int, tensor: str, model_path: pathlib.Path) -> QT:
    """llama-quant.cpp's choice for a tensor whose rows hold n_per_row values."""
    block = block_size(target)
    if n_per_row % block == 0:
        return target
    if block <= 32:
        fallback = target  # no smaller block to demote to
    elif target.name in _FALLBACK:
        fallback = checked_type(_FALLBACK[target.name])
    else:
        raise ValueError(f"{model_path}: tensor '{tensor}' has rows of {n_per_row} values, not whole "
                         f"{target.name} blocks of {block}, and llama.cpp defines no fallback for {target.name}")
    if n_per_row % block_size(fallback):
        return QT.F16
    return fallback


def _check_readable(t, source_path: pathlib.Path) -> None:
    """Fail now, not after an hour of quantizing, on a tensor ggml cannot read back as numbers."""
    if not can_read_as_float(int(t.tensor_type)):
        raise ModelFileError(f"{source_path}: tensor '{t.name}' is {QT(t.tensor_type).name}, which ggml cannot "
                             "read back as numbers; give an F16/BF16/F32 source")


def _field(reader: gguf.GGUFReader | ModelTensors, key: str):
    if key not in reader.fields:
        return None
    value = field_value(reader.fields[key])[0]
    return value.decode() if isinstance(value, bytes) else value


def _check_same_model(model_path, model, source_path, source) -> None:
    """The source must hold the model's experts: what the runtime checks of a companion."""
    arch, source_arch = _field(model, "general.architecture"), _field(source, "general.architecture")
    differences = [] if arch == source_arch else [f"architecture {source_arch}, the model's is {arch}"]
    for key in _SAME_MODEL_KEYS:
        mine, theirs = _field(model, f"{arch}.{key}"), _field(source, f"{source_arch}.{key}")
        if mine != theirs:
            differences.append(f"{key} {theirs}, the model's is {mine}")
    shapes = {t.name: [int(n) for n in t.shape] for t in model.tensors if t.name.endswith(EXPERT_SUFFIXES)}
    source_shapes = {t.name: [int(n) for n in t.shape] for t in source.tensors if t.name.endswith(EXPERT_SUFFIXES)}
    tensor_differences = [f"tensor '{name}' has shape {source_shapes[name]}, the model's is {shape}"
                          for name, shape in shapes.items() if name in source_shapes and source_shapes[name] != shape]
    tensor_differences += [f"tensor '{name}' missing" for name in shapes if name not in source_shapes]
    tensor_differences += [f"tensor '{name}' not in the model" for name in source_shapes if name not in shapes]
    if len(tensor_differences) > 3:
        tensor_differences = tensor_differences[:3] + [f"{len(tensor_differences) - 3} more tensor differences"]
    differences += tensor_differences
    if differences:
        raise ModelFileError(f"{source_path} is not a source for {model_path}, it is another model: "
                             + "; ".join(differences))


def _copy_metadata(model: ModelTensors, writer: gguf.GGUFWriter, min_alignment: int | None = None) -> None:
    """Every field of the model but the split layout (a companion is one file) and the
    reader's own GGUF.* entries; the tensors' alignment raised to min_alignment when given
    (both are powers of two, so the larger is a multiple of the other)."""
    alignment = None
    for key, field in model.fields.items():
        if key.startswith(("GGUF.", "split.", "hobbitpy.companion.")) or key == "general.architecture":
            continue
        value, vtype, sub_type = field_value(field)
        if key == "general.alignment":
            alignment = int(value)
        else:
            writer.add_key_value(key, value, vtype, sub_type=sub_type)
    if min_alignment is not None:
        alignment = max(alignment or gguf.GGUF_DEFAULT_ALIGNMENT, min_alignment)
    if alignment is not None:
        writer.add_custom_alignment(alignment)  # the tensor offsets must follow it too


def _importance_of(imatrix_path, plan) -> dict[str, np.ndarray]:
    """tensor name -> [n_expert, n_per_row] column weights, checked against the plan: a
    matrix of another model, or one missing a tensor, is refused before any work."""
    matrix = load_imatrix(imatrix_path)
    importance = {}
    for t, shape, row_type, _ in plan:
        weights = matrix.get(t.name)
        if weights is None:
            if needs_imatrix(row_type):
                raise ModelFileError(f"{imatrix_path}: no importance matrix for '{t.name}' (a matrix of another model?)")
            continue
        if weights.shape != (shape[2], shape[0]):
            raise ModelFileError(f"{imatrix_path}: the matrix of '{t.name}' is {weights.shape[0]} x {weights.shape[1]}; "
                                 f"the tensor has {shape[2]} experts of rows of {shape[0]} (a matrix of another model?)")
        importance[t.name] = weights
    return importance


def _is_down(name: str) -> bool:
    return name.endswith(".ffn_down_exps.weight")


def _quantize_rows(values: np.ndarray, row_type: QT, dst: np.ndarray, importance: np.ndarray | None = None) -> int:
    """values [rows, n_per_row] float32 into dst (row_type's rows of bytes); the bytes written.
    Q2_K without an importance matrix goes through libhobbit's copy of ggml's quantizer (the
    same bytes, several times faster: hobbit-quantize.cpp)."""
    rows, n_per_row = values.shape
    if row_type == QT.Q2_K and importance is None and n_per_row % 256 == 0:
        return hobbit.quantize_q2_k(values, dst)
    return quantize_into(values, row_type, dst, importance)


def _quantize_transposed(t, n_embd: int, row_type: QT, pool: ThreadPoolExecutor, on_bytes_read,
                         reads: TensorReads) -> np.ndarray:
    """Stacked experts `t` ([n_ff, n_embd, n_expert] in ggml order) with each expert's matrix
    transposed, [n_embd, n_ff]: row f is neuron f's column, quantized by itself in row_type;
    [n_expert, n_ff, row bytes]."""
    n_ff = int(t.shape[0])
    n_expert = n_rows(t) // n_embd
    row_bytes = row_size(row_type, n_embd)
    quantized = np.empty((n_expert, n_ff, row_bytes), np.uint8)

    def quantize_expert(e: int) -> int:
        raw = reads.rows(t, e * n_embd, n_embd)  # the expert's rows
        values = rows_as_float(raw, int(t.tensor_type), n_ff).reshape(n_embd, n_ff)
        columns = np.ascontiguousarray(values.T)
        n_bytes = _quantize_rows(columns, row_type, quantized[e])
        if not valid_rows(row_type, quantized[e], n_bytes):
            raise ModelFileError(f"{reads.path(t)}: tensor '{t.name}' expert {e} gives invalid {row_type.name} blocks "
                                 "(values that are not finite?)")
        return raw.nbytes

    for n_bytes_read in pool.map(quantize_expert, range(n_expert)):
        on_bytes_read(n_bytes_read)
    reads.done(t)
    return quantized


def _quantize(t, n_per_row: int, row_type: QT, pool: ThreadPoolExecutor, on_bytes_read, reads: TensorReads,
              importance: np.ndarray | None = None) -> np.ndarray:
    """Tensor `t` in row_type, quantized chunk by chunk of rows on the pool's threads;
    importance: [n_expert, n_per_row] column weights (chunks then stay within one expert)."""
    n_total = n_rows(t)
    row_bytes = row_size(row_type, n_per_row)
    quantized = np.empty((n_total, row_bytes), np.uint8)
    step = max(1, _CHUNK_ELEMENTS // n_per_row)
    n_matrix = importance.shape[0] if importance is not None else 1
    rows_per_matrix = n_total // n_matrix
    starts = [(m, first) for m in range(n_matrix)
              for first in range(m * rows_per_matrix, (m + 1) * rows_per_matrix, step)]

    def quantize_chunk(start: tuple[int, int]) -> int:
        matrix, first = start
        n = min(step, (matrix + 1) * rows_per_matrix - first)
        part = reads.rows(t, first, n)
        values = rows_as_float(part, int(t.tensor_type), n_per_row)
        dst = quantized[first: first + n]
        n_bytes = _quantize_rows(values, row_type, dst, None if importance is None else importance[matrix])
        if not valid_rows(row_type, dst, n_bytes):
            raise ModelFileError(f"{reads.path(t)}: tensor '{t.name}' rows {first}..{first + n - 1} give "
                                 f"invalid {row_type.name} blocks (values that are not finite?)")
        return part.nbytes

    for n_bytes_read in pool.map(quantize_chunk, starts):
        on_bytes_read(n_bytes_read)
    reads.done(t)
    return quantized
