#!/usr/bin/env python3
"""Give a trained F32 GGUF the outlier channels of a real model, without changing what it
computes: the same logits in full precision, a real model's sensitivity to quantization.

Why: a small model trained for hours on two cores loses far less to quantization than a real
one (its Q2_K costs +2 % perplexity; a real 7B's +11.7 %), because its weights are evenly
spread. A real LLM's are not: a few hidden channels carry activations tens of times larger
than the rest ("massive activations", LLM.int8()'s outlier features), and the weights that
read them differ in scale from their neighbours. A quantizer gives each block one scale, set
by its largest weight, so a block holding an outlier quantizes its other weights coarsely.
That is where a real model's quantization error comes from, and what this script adds.

How, exactly (every change is a scaling that its consumer undoes, so the function is kept):
- hidden channels: for the chosen channels c, each RMSNorm weight gamma_c is divided by s and
  column c of every matrix reading that norm's output (attention q/k/v, the router, the
  experts' gate and up, the output head) multiplied by s;
- expert neurons: for the chosen neurons d of each expert, row d of `up` is divided by s and
  column d of `down` multiplied by s (SwiGLU is linear in `up`);
- value dimensions: for the chosen dimensions j of each KV head, row j of `attn_v` is divided
  by s and the columns of `attn_output` that read it multiplied by s.
The rows divided by s lose nothing (a row's blocks scale with it); the columns multiplied by s
are the outliers. The channels are the same in every layer, as a real model's are; the
neurons are drawn per expert. Full-precision logits change only by float rounding (checked
by `--check`, against the source on the text given).

    python scripts/harden_outlier_channels.py SRC-F32.gguf OUT-F32.gguf --scale 8 --channels 8 --neurons 8 \
        [--check held-out.txt]
"""

from __future__ import annotations

import argparse
import pathlib
import re
import sys

import gguf
import numpy as np

from hobbitpy.files.gguf_fields import field_value
from hobbitpy.files.inflate import write_gguf
from hobbitpy.files.tokens import tokenize_text
from hobbitpy.measure.evaluate import evaluate_against, measure_reference
from hobbitpy.settings.config import OffloadConfig

# matrices whose input is the output of each norm (llama / Mixtral tensor names)
READERS = {"attn_norm": ("attn_q", "attn_k", "attn_v"),
           "ffn_norm": ("ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_gate", "ffn_up"),
           "output_norm": ("output",)}


def outlier_plan(reader: gguf.GGUFReader, scale: float, n_channels: int, n_neurons: int, n_values: int,
                 seed: int) -> dict[str, list[tuple[int, np.ndarray, float]]]:
    """Per tensor name, the scalings to apply: (numpy axis, indices, factor)."""
    arch = field_value(reader.fields["general.architecture"])[0].decode()
    get = lambda key, default=None: field_value(reader.fields[f"{arch}.{key}"])[0] \
        if f"{arch}.{key}" in reader.fields else default
    n_embd, n_head = int(get("embedding_length")), int(get("attention.head_count"))
    n_head_kv = int(get("attention.head_count_kv", n_head))
    rng = np.random.default_rng(seed)
    channels = np.sort(rng.choice(n_embd, n_channels, replace=False))
    plan: dict[str, list] = {}
    names = {t.name: t for t in reader.tensors}
    for name, t in names.items():
        m = re.match(r"(blk\.\d+\.)?(\w+)\.weight$", name)
        if not m:
            continue
        prefix, base = m.group(1) or "", m.group(2)
        if base in READERS:  # norm weight: the chosen channels divided by s, its readers' columns times s
            readers = [f"{prefix}{r}.weight" for r in READERS[base] if f"{prefix}{r}.weight" in names]
            if not readers:  # (an output head tied to the embeddings: that matrix is read by both ends)
                continue
            plan.setdefault(name, []).append((0, channels, 1 / scale))
            for reader_name in readers:  # columns = the last numpy axis
                plan.setdefault(reader_name, []).append((-1, channels, scale))
        elif base == "ffn_down_exps" and n_neurons:
            n_expert, _, n_ff = t.data.shape
            for e in range(n_expert):
                d = rng.choice(n_ff, n_neurons, replace=False)
                plan.setdefault(f"{prefix}ffn_up_exps.weight", []).append(((0, 1), (e, d), 1 / scale))
                plan.setdefault(name, []).append(((0, 2), (e, d), scale))
        elif base == "attn_v" and n_values:
            head_dim = t.data.shape[0] // n_head_kv
            dims = rng.choice(head_dim, n_values, replace=False)
            rows = np.concatenate([g * head_dim + dims for g in range(n_head_kv)])
            cols = np.concatenate([h * head_dim + dims for h in range(n_head)])  # every q head reads its kv head
            plan.setdefault(name, []).append((0, rows, 1 / scale))
            plan.setdefault(f"{prefix}attn_output.weight", []).append((-1, cols, scale))
    return plan


def scaled(data: np.ndarray, scalings: list) -> np.ndarray:
    out = np.array(data, dtype=np.float32)
    for axis, index, factor in scalings:
        if isinstance(axis, tuple):  # an expert's neurons: (expert, indices) on a 3-d tensor
            e, d = index
            if axis == (0, 1):
                out[e, d, :] *= factor
            else:
                out[e, :, d] *= factor
        elif axis == 0:
            out[index] *= factor
        else:
            out[..., index] *= factor
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("src", help="an F32 GGUF (scripts/train_reference_moe.py writes one)")
    ap.add_argument("out")
    ap.add_argument("--scale", type=float, default=8.0, help="the outliers' factor s (default %(default)s)")
    ap.add_argument("--channels", type=int, default=8, help="hidden channels made outliers (default %(default)s)")
    ap.add_argument("--neurons", type=int, default=8, help="neurons per expert made outliers in `down` (default %(default)s)")
    ap.add_argument("--values", type=int, default=4, help="value dimensions per KV head (default %(default)s)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--check", help="a text: compare the two files' full-precision logits on it")
    a = ap.parse_args()
    src, out = pathlib.Path(a.src), pathlib.Path(a.out)
    reader = gguf.GGUFReader(src)
    if any(t.tensor_type != gguf.GGMLQuantizationType.F32 for t in reader.tensors):
        print(f"{src}: not an all-F32 file (outliers are added before quantizing)", file=sys.stderr)
        return 2
    plan = outlier_plan(reader, a.scale, a.channels, a.neurons, a.values, a.seed)
    arch = field_value(reader.fields["general.architecture"])[0].decode()
    tensors = [(t, "scale" if t.name in plan else "copy", t.shape.tolist()) for t in reader.tensors]
    write_gguf(reader, arch, out, {}, {}, tensors, lambda t, kind: scaled(t.data, plan[t.name]),
               progress=False, desc="hardening")
    print(f"{out}: {len(plan)} tensors rescaled (s={a.scale:g}, {a.channels} channels, {a.neurons} neurons an expert, "
          f"{a.values} value dims a head)")
    if a.check:
        ids = tokenize_text(str(src), pathlib.Path(a.check).read_text(encoding="utf-8"), 512)
        ref = measure_reference(str(src), ids, n_ctx=256, n_threads=2)
        r = evaluate_against(str(out), ref, OffloadConfig(enabled=False), n_threads=2)
        print(f"full precision against the source on {len(ids)} tokens: mean KL {r.mean_kl:.2e}, "
              f"top-1 {100 * r.top1_agreement:.1f} %, perplexity {r.perplexity / ref.perplexity - 1:+.4%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
