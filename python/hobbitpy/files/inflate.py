"""Widen every routed expert with neurons that contribute exactly zero.

A small trained MoE routes like a real one but its experts are tiny, so reading them
costs nothing. `inflate` makes each expert as large as a real one (n_ff of 8k-14k)
without changing a single output: the new gate/up rows are copies of existing rows
(so the extra neurons compute like real ones), and the down projection gets whole
quantization blocks of zeros for them, so their contribution is exactly 0 and the
logits stay bit-identical. Works on any expert type whose zero block is all zero bytes
(F32, F16, BF16, Q8_0, Q4_0, Q4_K, Q5_K, Q6_K, Q2_K, ...).
"""

from __future__ import annotations

import os
import pathlib

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QT

from ..errors import ModelFileError
from .gguf_fields import field_value
from .model_file import inspect_model
from ..system.outputs import check_free_space, partial_output, publish
from ..system.progress import progress_bar

_WIDENED = (".ffn_gate_exps.weight", ".ffn_up_exps.weight")
_WIDENED_BIAS = (".ffn_gate_exps.bias", ".ffn_up_exps.bias")


def _ggml_shape(t) -> list[int]:
    return [int(x) for x in t.shape]  # GGUFReader gives ggml order: ne0 first


def _row_bytes(qtype: QT, n: int) -> int:
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    return n // block * size


def _longer_rows(raw: np.ndarray, qtype: QT, n_old: int, n_new: int) -> np.ndarray:
    """Rows of n_old elements (bytes of qtype) made n_new long with zero blocks at their end
    (a zero block is zero bytes: it adds exactly 0 to any dot product)."""
    rows = raw.reshape(-1, _row_bytes(qtype, n_old))
    out = np.zeros((rows.shape[0], _row_bytes(qtype, n_new)), np.uint8)
    out[:, : rows.shape[1]] = rows
    return out


def _source_and_new_output(src, dst):
    """The paths, and the source's ModelInfo: clear errors for a missing, truncated or non-GGUF
    source, and for an output that exists (never overwritten) or is the source."""
    src, dst = pathlib.Path(src), pathlib.Path(dst)
    if dst.exists():
        raise FileExistsError(f"{dst}: already exists; inflate never overwrites a file")
    if dst.resolve() == src.resolve():
        raise ValueError(f"{dst}: the output must be a new file")
    info = inspect_model(src)
    if info.n_split > 1:  # a research tool on small models: one file
        raise ModelFileError(f"{src}: part of a model split into {info.n_split} files; inflate reads one file "
                             "(merge it first: llama-gguf-split --merge)")
    return src, dst, info


def inflate(src: str | os.PathLike, dst: str | os.PathLike, n_ff: int, *, progress: bool = True) -> pathlib.Path:
    """Write `dst`: `src` with every routed expert widened to `n_ff` neurons."""
    src, dst, info = _source_and_new_output(src, dst)
    if not info.is_moe:
        raise ModelFileError(f"{src}: a dense model has no experts to inflate")

    reader = gguf.GGUFReader(src)
    arch = info.arch
    ff_key = f"{arch}.expert_feed_forward_length"
    if ff_key not in reader.fields:
        ff_key = f"{arch}.feed_forward_length"
        if any(t.name.endswith((".ffn_up.weight", ".ffn_gate.weight")) for t in reader.tensors):
            raise ModelFileError(f"{src}: {ff_key} also sizes dense FFN layers; inflating them is not supported")
    old_value, _, _ = field_value(reader.fields[ff_key])
    if isinstance(old_value, list):
        raise ModelFileError(f"{src}: {ff_key} differs per layer; not supported")
    n_ff_old = int(old_value)
    if n_ff <= n_ff_old:
        raise ValueError(f"--n-ff {n_ff} must exceed the experts' current width {n_ff_old}")

    plan = []  # (name, new byte/element array builder, new ggml shape, type)
    for t in reader.tensors:
        qtype = QT(t.tensor_type)
        shape = _ggml_shape(t)
        name = t.name
        if name.endswith(".ffn_down_exps.weight"):
            block = gguf.GGML_QUANT_SIZES[qtype][0]
            if shape[0] != n_ff_old or n_ff % block:
                raise ModelFileError(f"{src}: {name} ({qtype.name}) cannot be widened to {n_ff} "
                                     f"(blocks of {block} along {shape[0]} inputs)")
            plan.append((t, "down", [n_ff] + shape[1:]))
        elif name.endswith(".ffn_gate_up_exps.weight"):
            plan.append((t, "gate_up", [shape[0], 2 * n_ff] + shape[2:]))
        elif name.endswith(_WIDENED):
            plan.append((t, "rows", [shape[0], n_ff] + shape[2:]))
        elif name.endswith(_WIDENED_BIAS) or name.endswith(".ffn_gate_up_exps.bias"):
            plan.append((t, "bias", [n_ff * (2 if "gate_up" in name else 1)] + shape[1:]))
        else:
            plan.append((t, "copy", shape))

    def new_data(t, kind):
        qtype = QT(t.tensor_type)
        shape = _ggml_shape(t)
        raw = np.asarray(t.data).view(np.uint8)
        if kind == "down":  # [n_ff_old -> n_ff, n_embd, n_expert]: zero blocks at the end of every row
            return _longer_rows(raw, qtype, n_ff_old, n_ff)
        if kind in ("rows", "gate_up"):  # [n_embd, rows, n_expert]: copies of existing rows
            n_rows = shape[1]
            per_expert = raw.reshape(-1, n_rows, _row_bytes(qtype, shape[0]))
            halves = [per_expert] if kind == "rows" else [per_expert[:, :n_ff_old], per_expert[:, n_ff_old:]]
            idx = np.arange(n_ff) % n_ff_old
            return np.concatenate([h[:, idx] for h in halves], axis=1)
        if kind == "bias":  # [rows, n_expert]: the new neurons' biases are zero
            vals = np.asarray(t.data).reshape(-1, shape[0])
            halves = [vals] if shape[0] == n_ff_old else [vals[:, :n_ff_old], vals[:, n_ff_old:]]
            out = [np.concatenate([h, np.zeros((h.shape[0], n_ff - n_ff_old), h.dtype)], axis=1) for h in halves]
            return np.concatenate(out, axis=1)
        raise AssertionError(kind)

    return write_gguf(reader, arch, dst, {ff_key: n_ff}, {}, plan, new_data, progress, f"inflate to n_ff {n_ff}")


def write_gguf(reader, arch: str, dst: pathlib.Path, replace: dict, add: dict, plan: list, new_data, progress: bool,
               desc: str, types: dict | None = None) -> pathlib.Path:
    """Write dst: reader's metadata with the values of `replace` (key: value, the source's type
    kept) and the keys of `add` (key: (value, GGUFValueType)), and the tensors of `plan` ((tensor,
    kind, new ggml shape)) as new_data(tensor, kind) gives their bytes ("copy": the source's),
    each in its type in `types` (name: GGMLQuantizationType; default: the source's); through a
    partial file, so a failure or a signal leaves nothing."""
    types = {t.name: (types or {}).get(t.name, QT(t.tensor_type)) for t, _, _ in plan}
    sizes = {t.name: _row_bytes(types[t.name], shape[0]) * int(np.prod(shape[1:])) for t, _, shape in plan}
    check_free_space(dst.parent, reader.data_offset + sum(sizes.values()), str(dst))
    with partial_output(dst) as tmp:
        writer = gguf.GGUFWriter(tmp, arch)
        for key, field in reader.fields.items():
            if key.startswith("GGUF.") or key == "general.architecture":
                continue
            value, vtype, sub = field_value(field)
            writer.add_key_value(key, replace.get(key, value), vtype, sub_type=sub)
        for key, (value, vtype) in add.items():
            writer.add_key_value(key, value, vtype)
        for t, kind, new_shape in plan:
            qtype = types[t.name]
            # numpy order, innermost dimension in bytes (GGUFWriter turns it back into elements)
            byte_shape = list(reversed(new_shape))
            byte_shape[-1] = _row_bytes(qtype, new_shape[0])
            writer.add_tensor_info(t.name, byte_shape, np.dtype(np.uint8), sizes[t.name], raw_dtype=qtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        with progress_bar(total=len(plan), unit="tensor", disable=not progress, desc=desc) as bar:
            for t, kind, _ in plan:
                data = np.asarray(t.data) if kind == "copy" else new_data(t, kind)
                writer.write_tensor_data(np.ascontiguousarray(data).view(np.uint8))
                bar.update(1)
        writer.close()
        publish(tmp, dst)
    return dst


# tensors whose rows are read along the hidden size (ne0 = n_embd): zero columns
_EMBD_IN = (".attn_q.weight", ".attn_k.weight", ".attn_v.weight",
            ".ffn_gate_inp.weight", ".ffn_gate_exps.weight", ".ffn_up_exps.weight", ".ffn_gate_inp_shexp.weight",
            ".ffn_gate_shexp.weight", ".ffn_up_shexp.weight", ".ffn_gate.weight", ".ffn_up.weight",
            ".ffn_down_exps.bias", ".attn_output.bias", ".ffn_down.bias")
# ... whose rows are written along it (ne1 = n_embd): zero rows
_EMBD_OUT = (".attn_output.weight", ".ffn_down_exps.weight", ".ffn_down_shexp.weight", ".ffn_down.weight")
# RMSNorm weights over the hidden size: scaled, zeros for the new dimensions
_EMBD_NORMS = (".attn_norm.weight", ".ffn_norm.weight", ".post_attention_norm.weight")
# the same outside the blocks (whole names)
_EMBD_IN_TOP, _EMBD_NORMS_TOP = ("token_embd.weight", "output.weight"), ("output_norm.weight",)
# architectures whose attention llama.cpp sizes by key_length x heads, not by the hidden size
_PADDABLE = ("llama", "gpt-oss")
# what does not touch the hidden size in the architectures this is tested on (llama, qwen2moe, gpt-oss)
_EMBD_FREE = (".attn_q.bias", ".attn_k.bias", ".attn_v.bias", ".ffn_gate_inp.bias", ".attn_sinks.weight",
              ".ffn_gate_exps.bias", ".ffn_up_exps.bias")


def pad_embedding(src: str | os.PathLike, dst: str | os.PathLike, n_embd: int, *, progress: bool = True) -> pathlib.Path:
    """Write `dst`: `src` with its hidden size padded to `n_embd` dimensions that stay exactly zero.

    Every weight reading the hidden state gets zero columns, every weight writing it zero rows
    (quantized zero blocks are zero bytes), so the new dimensions are 0 everywhere and add 0 to
    every dot product. RMSNorm then divides by a mean over n_embd: with n_embd / n = 4^k its
    result is 2^k times larger, so the norm weights are divided by 2^k and eps by 4^k, both
    exact in floating point, and the logits stay bit-identical. The heads keep their size
    (attention.key_length / value_length written). What it is for: rows as long as a real
    model's (a neuron of 4096 Q8_0 weights is about a page), on which neuron-granular reads
    can be measured (CORM)."""
    src, dst, info = _source_and_new_output(src, dst)
    arch = info.arch
    if arch not in _PADDABLE:
        raise ModelFileError(f"{src}: padding the hidden size is done for {', '.join(_PADDABLE)} only (llama.cpp "
                             f"sizes {arch}'s attention by the hidden size, not by its heads)")
    reader = gguf.GGUFReader(src)
    n_old = info.n_embd
    ratio = n_embd // n_old if n_embd % n_old == 0 else 0
    k = (ratio.bit_length() - 1) // 2 if ratio else 0
    if ratio < 4 or 4 ** k != ratio:
        raise ValueError(f"--n-embd {n_embd} must be {n_old} times a power of 4 (the norm's scaling is exact then)")
    plan = []
    for t in reader.tensors:
        qtype = QT(t.tensor_type)
        shape = _ggml_shape(t)
        name = t.name
        block = gguf.GGML_QUANT_SIZES[qtype][0]
        in_block = name.startswith("blk.")
        if (name.endswith(_EMBD_IN) if in_block else name in _EMBD_IN_TOP) and shape[0] == n_old and n_embd % block == 0:
            plan.append((t, "cols", [n_embd] + shape[1:]))
        elif in_block and name.endswith(_EMBD_OUT) and len(shape) >= 2 and shape[1] == n_old:
            plan.append((t, "rows", [shape[0], n_embd] + shape[2:]))
        elif ((name.endswith(_EMBD_NORMS) if in_block else name in _EMBD_NORMS_TOP) and shape == [n_old]
              and qtype == QT.F32):
            plan.append((t, "norm", [n_embd]))
        elif in_block and (name.endswith(_EMBD_FREE) or n_old not in shape):
            plan.append((t, "copy", shape))
        else:
            raise ModelFileError(f"{src}: {name} {shape} ({qtype.name}): padding the hidden size does not know "
                                 f"this tensor")

    def new_data(t, kind):
        qtype = QT(t.tensor_type)
        shape = _ggml_shape(t)
        raw = np.asarray(t.data).view(np.uint8)
        if kind == "cols":  # every row longer by zero blocks
            return _longer_rows(raw, qtype, n_old, n_embd)
        if kind == "rows":  # [ne0, n_old -> n_embd, ...]: zero rows after each matrix's own
            mats = raw.reshape(-1, n_old, _row_bytes(qtype, shape[0]))
            out = np.zeros((mats.shape[0], n_embd, mats.shape[2]), np.uint8)
            out[:, :n_old] = mats
            return out
        if kind == "norm":
            out = np.zeros(n_embd, np.float32)
            out[:n_old] = np.asarray(t.data, np.float32) / np.float32(2 ** k)
            return out
        raise AssertionError(kind)

    eps_key = f"{arch}.attention.layer_norm_rms_epsilon"
    if eps_key not in reader.fields:
        raise ModelFileError(f"{src}: no {eps_key}: padding the hidden size needs RMSNorm's epsilon")
    eps, _, _ = field_value(reader.fields[eps_key])
    replace = {f"{arch}.embedding_length": n_embd, eps_key: float(np.float32(eps) / np.float32(4 ** k))}
    add = {}
    for key, size in ((f"{arch}.attention.key_length", info.n_embd_head_k),
                      (f"{arch}.attention.value_length", info.n_embd_head_v)):
        if key not in reader.fields:
            add[key] = (size, gguf.GGUFValueType.UINT32)
    return write_gguf(reader, arch, dst, replace, add, plan, new_data, progress, f"pad the hidden size to {n_embd}")
