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
from tqdm import tqdm

from .errors import ModelFileError
from .gguf_fields import field_value

_WIDENED = (".ffn_gate_exps.weight", ".ffn_up_exps.weight")
_WIDENED_BIAS = (".ffn_gate_exps.bias", ".ffn_up_exps.bias")


def _ggml_shape(t) -> list[int]:
    return [int(x) for x in t.shape]  # GGUFReader gives ggml order: ne0 first


def _row_bytes(qtype: QT, n: int) -> int:
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    return n // block * size


def inflate(src: str | os.PathLike, dst: str | os.PathLike, n_ff: int, *, progress: bool = True) -> pathlib.Path:
    """Write `dst`: `src` with every routed expert widened to `n_ff` neurons."""
    src, dst = pathlib.Path(src), pathlib.Path(dst)
    if dst.exists():
        raise FileExistsError(f"{dst}: already exists; inflate never overwrites a file")
    if dst.resolve() == src.resolve():
        raise ValueError(f"{dst}: the output must be a new file")
    from .model_file import inspect_model
    info = inspect_model(src)  # clear errors for missing, truncated, non-GGUF files
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
        if kind == "copy":
            return raw
        if kind == "down":  # [n_ff_old -> n_ff, n_embd, n_expert]: zero blocks at the end of every row
            rows = raw.reshape(-1, _row_bytes(qtype, n_ff_old))
            out = np.zeros((rows.shape[0], _row_bytes(qtype, n_ff)), np.uint8)
            out[:, : rows.shape[1]] = rows
            return out
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

    tmp = dst.with_name(dst.name + ".tmp")
    try:
        writer = gguf.GGUFWriter(tmp, arch)
        for key, field in reader.fields.items():
            if key.startswith("GGUF.") or key == "general.architecture":
                continue
            value, vtype, sub = field_value(field)
            if key == ff_key:
                value = n_ff
            writer.add_key_value(key, value, vtype, sub_type=sub)
        for t, kind, new_shape in plan:
            qtype = QT(t.tensor_type)
            n_elems = int(np.prod(new_shape))
            nbytes = n_elems // gguf.GGML_QUANT_SIZES[qtype][0] * gguf.GGML_QUANT_SIZES[qtype][1]
            # numpy order, innermost dimension in bytes (GGUFWriter turns it back into elements)
            byte_shape = list(reversed(new_shape))
            byte_shape[-1] = _row_bytes(qtype, new_shape[0])
            writer.add_tensor_info(t.name, byte_shape, np.dtype(np.uint8), nbytes, raw_dtype=qtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        with tqdm(total=len(plan), unit="tensor", disable=not progress, desc=f"inflate to n_ff {n_ff}") as bar:
            for t, kind, _ in plan:
                writer.write_tensor_data(np.ascontiguousarray(new_data(t, kind)).view(np.uint8))
                bar.update(1)
        writer.close()
        os.replace(tmp, dst)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return dst
