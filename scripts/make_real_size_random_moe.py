#!/usr/bin/env python3
"""Write a random-weight qwen3moe GGUF of Qwen3-30B-A3B's exact shape (48 layers, 128 experts,
top-8, hidden size 2048, expert width 768, 32 query and 4 key-value heads of 128, Qwen2's
151,936-token vocabulary): about 18 GB with Q4_K experts and Q8_0 attention, embeddings and
output, the shape and types a user's Q4_K_M file of that model has.

Random weights are the hard case for an expert cache: every weight carries signal and the
routers have no skew. What is written is a real model's bytes, computed by llama.cpp as any
other; only how the numbers were chosen is not a real model's.

Written tensor by tensor, never the whole model in memory, and fast: each kind of row
(its type, its length) is drawn and quantized by ggml once, as a pool of ROW_POOL distinct
rows, and every tensor of that kind is assembled from rows drawn from the pool (two experts
share no more rows than chance gives). The structure (names, order, keys) is that of
hobbitpy.files.synthetic_moe's qwen3moe, taken from a small one made first.

    python scripts/make_real_size_random_moe.py OUT.gguf [--n-layer 48] [--seed 0]
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import tempfile

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QT

from hobbitpy.binding.ggml import quantize_rows
from hobbitpy.files.inflate import write_gguf
from hobbitpy.files.synthetic_moe import make_synthetic_moe

# Qwen3-30B-A3B (its config.json)
N_EMBD, N_FF_EXPERT, N_EXPERT, N_EXPERT_USED = 2048, 768, 128, 8
N_HEAD, N_HEAD_KV, HEAD_DIM = 32, 4, 128
ROW_POOL = 4096
EXPERT_TYPE, DENSE_TYPE = QT.Q4_K, QT.Q8_0


def vocab_gguf() -> pathlib.Path:
    """Qwen2's vocabulary as llama.cpp ships it (in the llama.cpp source the build fetched)."""
    root = pathlib.Path(__file__).resolve().parents[1] / "build"
    found = sorted(root.glob("*/_llama/*/vendor/llama.cpp/models/ggml-vocab-qwen2.gguf"))
    if not found:
        sys.exit(f"error: no ggml-vocab-qwen2.gguf under {root} (run the README's install first)")
    return found[0]


def new_shape(name: str, n_vocab: int) -> tuple[list[int], QT]:
    """A tensor's ggml shape (ne0 first) and type at the real size."""
    suffix = name.split(".", 2)[-1] if name.startswith("blk.") else name
    shapes = {
        "token_embd.weight": ([N_EMBD, n_vocab], DENSE_TYPE), "output.weight": ([N_EMBD, n_vocab], DENSE_TYPE),
        "output_norm.weight": ([N_EMBD], QT.F32), "attn_norm.weight": ([N_EMBD], QT.F32),
        "ffn_norm.weight": ([N_EMBD], QT.F32),
        "attn_q.weight": ([N_EMBD, N_HEAD * HEAD_DIM], DENSE_TYPE),
        "attn_k.weight": ([N_EMBD, N_HEAD_KV * HEAD_DIM], DENSE_TYPE),
        "attn_v.weight": ([N_EMBD, N_HEAD_KV * HEAD_DIM], DENSE_TYPE),
        "attn_output.weight": ([N_HEAD * HEAD_DIM, N_EMBD], DENSE_TYPE),
        "attn_q_norm.weight": ([HEAD_DIM], QT.F32), "attn_k_norm.weight": ([HEAD_DIM], QT.F32),
        "ffn_gate_inp.weight": ([N_EMBD, N_EXPERT], QT.F32),
        "ffn_gate_exps.weight": ([N_EMBD, N_FF_EXPERT, N_EXPERT], EXPERT_TYPE),
        "ffn_up_exps.weight": ([N_EMBD, N_FF_EXPERT, N_EXPERT], EXPERT_TYPE),
        "ffn_down_exps.weight": ([N_FF_EXPERT, N_EMBD, N_EXPERT], EXPERT_TYPE),
    }
    if suffix not in shapes:
        raise ValueError(f"{name}: a tensor this script does not know")
    return shapes[suffix]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=pathlib.Path)
    ap.add_argument("--n-layer", type=int, default=48)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.out.exists():
        sys.exit(f"error: {args.out} exists; remove it first")
    rng = np.random.default_rng(args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        # the structure: a small qwen3moe of the same depth, expert count and heads
        template = make_synthetic_moe(pathlib.Path(tmp) / "template.gguf", "qwen3moe", vocab_gguf=vocab_gguf(),
                                      n_layer=args.n_layer, n_expert=N_EXPERT, n_expert_used=N_EXPERT_USED,
                                      n_embd=64, n_ff=64, n_head=N_HEAD, n_head_kv=N_HEAD_KV)
        reader = gguf.GGUFReader(str(template))
        n_vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
        plan, types = [], {}
        for t in reader.tensors:
            shape, qtype = new_shape(t.name, n_vocab)
            plan.append((t, "new", shape))
            types[t.name] = qtype
        pools: dict[tuple[QT, int], np.ndarray] = {}

        # synthetic_moe's scales: linear weights N(0, 1/fan-in) (activations stay O(1)), the
        # embeddings N(0, 1) (each token's own state), the router N(0, 1) (different tokens
        # pick different experts: routing without skew), norms 1
        def rows_of(qtype: QT, n_per_row: int, n_rows: int, std: float) -> np.ndarray:
            key = (qtype, n_per_row, std)
            if key not in pools:
                values = rng.standard_normal((ROW_POOL, n_per_row), dtype=np.float32) * np.float32(std)
                pools[key] = quantize_rows(values, int(qtype))
            return pools[key][rng.integers(0, ROW_POOL, n_rows)]

        def new_data(t, kind):
            shape, qtype = new_shape(t.name, n_vocab)
            n_rows = int(np.prod(shape[1:]))
            if t.name.endswith("ffn_gate_inp.weight"):  # the router: every row its own
                return rng.standard_normal((n_rows, shape[0]), dtype=np.float32)
            if qtype == QT.F32:
                return np.ones(shape[0], np.float32)  # norms
            std = 1.0 if t.name == "token_embd.weight" else 1.0 / np.sqrt(shape[0])
            return rows_of(qtype, shape[0], n_rows, std)

        head_keys = {f"qwen3moe.{k}": v for k, v in (
            ("embedding_length", N_EMBD), ("feed_forward_length", 6144), ("expert_feed_forward_length", N_FF_EXPERT),
            ("attention.key_length", HEAD_DIM), ("attention.value_length", HEAD_DIM),
            ("rope.dimension_count", HEAD_DIM))}
        replace = {**head_keys, "general.file_type": int(gguf.LlamaFileType.MOSTLY_Q4_K_M)}
        missing = [k for k in replace if k not in reader.fields]
        if missing:
            raise ValueError(f"the template has no {', '.join(missing)}")
        write_gguf(reader, "qwen3moe", args.out, replace, {}, plan, new_data, True, "tensors", types)
    print(f"wrote {args.out} ({args.out.stat().st_size / 1e9:.2f} GB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
