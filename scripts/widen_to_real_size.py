#!/usr/bin/env python3
"""Make a real-size MoE GGUF from a small trained one: its hidden size and expert width widened
to a real model's with dimensions and neurons that contribute exactly zero, quantized as
llama.cpp's quantizer does (Q4_K_M, as published; Q3_K_M and Q2_K, the smaller files a user
would download instead), written tensor by tensor (never the whole model in memory).

The source is an F32 GGUF of scripts/train_reference_moe.py ("qwen3-30b-a3b" or
"mixtral-8x7b"), or this script's output of it at its own size (--n-embd and --n-ff the
source's: the seed a repository can keep, a few tens of MB, whose blocks the real-size file
is assembled from byte for byte, as from the F32 file): the routing is learned, the file has the real depth, expert count, top-k,
hidden size and expert width, so every expert is as many bytes as the real model's and the
routers choose as a trained router does. What stays small: the vocabulary (4,096 tokens, not
151,936 or 32,000) and the attention heads, so the resident weights are smaller than the real
model's (the report says by how much).

How each weight is widened (the same rules as `hobbitpy inflate` / `pad_embedding`, applied
to numbers before quantizing instead of to quantized bytes):
- the hidden size n -> N = n * 4^k: weights reading the hidden state get zero columns, weights
  writing it zero rows, RMSNorm weights are divided by 2^k and epsilon by 4^k (exact);
- the experts n_ff -> N_ff: a new neuron's gate and up rows copy an existing neuron's (so it
  computes like a trained one), its down weights are zero (it adds exactly 0).
Types: llama.cpp's own rules for each tensor of these architectures (src/llama-quant.cpp,
e.g. Q4_K_M: experts' gate/up Q4_K, down Q6_K in the layers `use_more_bits` picks; output
Q6_K; 8-expert models' attn_k/attn_v Q8_0); norms and routers F32. Each row is quantized by
ggml itself, from the trained numbers (as a published file is made from the original
weights); since a block's bytes depend on that block alone, the real part of each distinct
row is quantized once and the zero blocks and copied rows are assembled from those bytes.

    python scripts/widen_to_real_size.py small-F32.gguf OUT.gguf --n-embd 2048 --n-ff 768
"""

from __future__ import annotations

import argparse
import pathlib
import re
import sys

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QT

from hobbitpy.binding.ggml import quantize_rows
from hobbitpy.files.gguf_fields import field_value
from hobbitpy.files.inflate import write_gguf


# source types read as numbers (and quantized here); any other is a seed's bytes, copied
FLOATS = (QT.F32, QT.F16)


def use_more_bits(i_layer: int, n_layer: int) -> bool:  # llama-quant.cpp
    return i_layer < n_layer // 8 or i_layer >= 7 * n_layer // 8 or (i_layer - n_layer // 8) % 3 == 2


FTYPES = {"Q4_K_M": (QT.Q4_K, gguf.LlamaFileType.MOSTLY_Q4_K_M), "Q3_K_M": (QT.Q3_K, gguf.LlamaFileType.MOSTLY_Q3_K_M),
          "Q2_K": (QT.Q2_K, gguf.LlamaFileType.MOSTLY_Q2_K)}


def llama_quant_type(ftype: str, name: str, n_layer: int, n_expert: int, n_gqa: int) -> QT:
    """The type llama.cpp's quantizer gives this tensor in this file type (llama-quant.cpp's
    llama_tensor_get_type for these architectures, rows whole K-quant blocks)."""
    default = FTYPES[ftype][0]
    m = re.match(r"blk\.(\d+)\.", name)
    layer = int(m.group(1)) if m else -1
    eight = n_expert == 8
    if name == "output.weight":
        return QT.Q6_K
    if name.endswith("attn_v.weight"):
        if eight:
            return QT.Q8_0
        return {"Q4_K_M": QT.Q6_K if use_more_bits(layer, n_layer) else QT.Q4_K,
                "Q3_K_M": QT.Q5_K if layer < 2 else QT.Q4_K,
                "Q2_K": QT.Q4_K if n_gqa >= 4 else QT.Q3_K}[ftype]
    if name.endswith("attn_k.weight"):
        return QT.Q8_0 if eight else default
    if name.endswith("attn_output.weight"):
        return QT.Q5_K if eight else {"Q4_K_M": QT.Q4_K, "Q3_K_M": QT.Q4_K, "Q2_K": QT.Q3_K}[ftype]
    if name.endswith("ffn_down_exps.weight"):
        return {"Q4_K_M": QT.Q6_K if use_more_bits(layer, n_layer) else QT.Q4_K,
                "Q3_K_M": QT.Q5_K if layer < n_layer // 16 else QT.Q4_K,
                "Q2_K": QT.Q3_K}[ftype]
    return default


def widened_rows(values: np.ndarray, row_source: np.ndarray, n_cols: int, qtype: QT, quantized: bool) -> np.ndarray:
    """values [..., R, C] -> [..., len(row_source), n_cols] in qtype: row j is row row_source[j]
    padded with zero columns, or all zeros where row_source[j] < 0. values are float32, or
    (quantized) the rows' bytes in qtype already, whole blocks. Returns bytes (or float32)."""
    lead, n_real_rows = values.shape[:-2], values.shape[-2]
    has_source = row_source >= 0
    if qtype == QT.F32:
        out = np.zeros(lead + (len(row_source), n_cols), np.float32)
        out[..., has_source, :values.shape[-1]] = values[..., row_source[has_source], :]
        return out
    if quantized:
        real_bytes = values
    else:
        block, _ = gguf.GGML_QUANT_SIZES[qtype]
        n_real_cols = values.shape[-1]
        n_quantized = -(-n_real_cols // block) * block  # the blocks that hold real numbers
        real = np.zeros((int(np.prod(lead, dtype=np.int64)) * n_real_rows, n_quantized), np.float32)
        real[:, :n_real_cols] = values.reshape(-1, n_real_cols)
        real_bytes = quantize_rows(real, qtype).reshape(lead + (n_real_rows, -1))
    zero_row = quantize_rows(np.zeros((1, n_cols), np.float32), qtype)[0]
    out = np.empty(lead + (len(row_source), len(zero_row)), np.uint8)
    out[...] = zero_row
    out[..., has_source, : real_bytes.shape[-1]] = real_bytes[..., row_source[has_source], :]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src", help="F32 GGUF of train_reference_moe.py, or this script's output of it at its own size")
    ap.add_argument("dst")
    ap.add_argument("--n-embd", type=int, required=True, help="the real hidden size (the small one times 4^k)")
    ap.add_argument("--n-ff", type=int, required=True, help="the real expert width (a multiple of the small one)")
    ap.add_argument("--name", help="general.name of the output")
    ap.add_argument("--ftype", choices=list(FTYPES), default="Q4_K_M", help="llama.cpp's file type to write")
    ap.add_argument("--f32", action="store_true", help="every tensor F32 (a check: the logits equal the source's)")
    a = ap.parse_args()

    src, dst = pathlib.Path(a.src), pathlib.Path(a.dst)
    if dst.exists():
        print(f"{dst}: already exists; not overwritten", file=sys.stderr)
        return 2
    reader = gguf.GGUFReader(src)
    arch = field_value(reader.fields["general.architecture"])[0].decode()
    get = lambda key: field_value(reader.fields[f"{arch}.{key}"])[0]
    n_embd, n_layer, n_expert = int(get("embedding_length")), int(get("block_count")), int(get("expert_count"))
    ff_key = "expert_feed_forward_length" if f"{arch}.expert_feed_forward_length" in reader.fields else \
        "feed_forward_length"
    n_ff = int(get(ff_key))
    ratio = a.n_embd // n_embd
    k = (ratio.bit_length() - 1) // 2
    if a.n_embd % n_embd or 4 ** k != ratio or a.n_ff % n_ff:
        print(f"{src}: --n-embd must be {n_embd} x 4^k and --n-ff a multiple of {n_ff}", file=sys.stderr)
        return 2

    norms = ("attn_norm.weight", "ffn_norm.weight", "output_norm.weight")
    reads_hidden = ("token_embd.weight", "output.weight", "attn_q.weight", "attn_k.weight", "attn_v.weight",
                    "ffn_gate_inp.weight")
    plan = []  # (tensor, kind, new ggml shape, type)
    n_gqa = int(get("attention.head_count")) // int(get("attention.head_count_kv"))
    typed = (lambda name: QT.F32) if a.f32 else (lambda name: llama_quant_type(a.ftype, name, n_layer, n_expert, n_gqa))
    for t in reader.tensors:
        shape = [int(x) for x in t.shape]
        name = t.name
        if name.endswith(norms):
            plan.append((t, "norm", [a.n_embd], QT.F32))
        elif name.endswith(("ffn_gate_exps.weight", "ffn_up_exps.weight")):
            plan.append((t, "neurons", [a.n_embd, a.n_ff, n_expert], typed(name)))
        elif name.endswith("ffn_down_exps.weight"):
            plan.append((t, "down", [a.n_ff, a.n_embd, n_expert], typed(name)))
        elif name.endswith("attn_output.weight"):
            plan.append((t, "hidden_rows", [shape[0], a.n_embd], typed(name)))
        elif name.endswith(reads_hidden):
            qtype = QT.F32 if name.endswith("ffn_gate_inp.weight") else typed(name)
            plan.append((t, "hidden_cols", [a.n_embd, shape[1]], qtype))
        elif name.endswith(("attn_q_norm.weight", "attn_k_norm.weight")):
            plan.append((t, "copy", shape, QT.F32))
        else:
            print(f"{src}: {name} {shape}: not a tensor this script widens", file=sys.stderr)
            return 2

    def new_data(t, kind):
        _, _, _, qtype = by_tensor[t.name]
        quantized = QT(t.tensor_type) not in FLOATS  # its rows' bytes in qtype already (checked below)
        values = np.asarray(t.data, np.uint8 if quantized else np.float32)  # numpy order: innermost dimension last
        if kind == "norm":
            out = np.zeros(a.n_embd, np.float32)
            out[:n_embd] = values / np.float32(2 ** k)
            return out
        if kind == "hidden_cols":  # [rows, n_embd] -> [rows, N]
            return widened_rows(values, np.arange(values.shape[0]), a.n_embd, qtype, quantized)
        if kind == "hidden_rows":  # [n_embd, cols] -> [N, cols]: zero rows
            source = np.where(np.arange(a.n_embd) < n_embd, np.arange(a.n_embd), -1)
            return widened_rows(values, source, int(t.shape[0]), qtype, quantized)
        if kind == "neurons":  # [E, n_ff, n_embd] -> [E, N_ff, N]: copied rows, zero columns
            return widened_rows(values, np.arange(a.n_ff) % n_ff, a.n_embd, qtype, quantized)
        if kind == "down":  # [E, n_embd, n_ff] -> [E, N, N_ff]: zero rows, the new neurons' columns zero
            source = np.where(np.arange(a.n_embd) < n_embd, np.arange(a.n_embd), -1)
            return widened_rows(values, source, a.n_ff, qtype, quantized)
        raise AssertionError(kind)

    by_tensor = {t.name: (t, kind, shape, qtype) for t, kind, shape, qtype in plan}
    for t, _, _, qtype in plan:  # a quantized source is this script's output at the same size (a seed)
        if QT(t.tensor_type) not in (*FLOATS, qtype):
            print(f"{src}: {t.name} is {QT(t.tensor_type).name}, not F32, F16 or the {qtype.name} of {a.ftype}: widen "
                  f"train_reference_moe.py's F32 file, or this script's {a.ftype} of it at its own size",
                  file=sys.stderr)
            return 2
    for t, _, shape, qtype in plan:
        if shape[0] % gguf.GGML_QUANT_SIZES[qtype][0]:
            print(f"{src}: {t.name}: rows of {shape[0]} are not whole {qtype.name} blocks", file=sys.stderr)
            return 2

    def n_bytes(shape, qtype):
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        return shape[0] // block * size * int(np.prod(shape[1:]))

    total = sum(n_bytes(shape, qtype) for _, _, shape, qtype in plan)
    eps_key = f"{arch}.attention.layer_norm_rms_epsilon"
    replace = {f"{arch}.embedding_length": a.n_embd, f"{arch}.{ff_key}": a.n_ff,
               eps_key: float(np.float32(field_value(reader.fields[eps_key])[0]) / np.float32(4 ** k)),
               "general.file_type": int(gguf.LlamaFileType.ALL_F32 if a.f32 else FTYPES[a.ftype][1])}
    if a.name:
        replace["general.name"] = a.name
    write_gguf(reader, arch, dst, replace, {}, [(t, kind, shape) for t, kind, shape, _ in plan], new_data, True,
               f"write {dst.name}", types={t.name: qtype for t, _, _, qtype in plan})
    experts = sum(n_bytes(shape, qtype) for t, _, shape, qtype in plan if "_exps." in t.name)
    print(f"{dst}: {total / 1e9:.2f} GB, experts {experts / 1e9:.2f} GB, the rest {(total - experts) / 1e9:.2f} GB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
