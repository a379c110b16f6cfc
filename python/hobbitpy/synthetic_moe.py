"""Random-weight MoE GGUF models of any shape, for tests and throughput benchmarks.

`make_synthetic_moe()` writes a Mixture-of-Experts GGUF that stock llama.cpp loads
and runs, so tests can compare hobbitpy's expert offloading against the reference
without downloading real weights, and benchmarks can use models of real size.

Supported `arch` values (all checked against llama.cpp's src/models/*.cpp):

* "llama"    -- Mixtral layout: routed experts only, softmax router, SiLU.
                Expert width comes from `llama.feed_forward_length`.
                n_expert=0 makes a dense model (for the "dense model" paths).
* "qwen2moe" -- routed experts + one shared expert gated by a sigmoid of
                `ffn_gate_inp_shexp` (a 1-D [n_embd] weight).
* "gpt-oss"  -- (llama.cpp arch name for OpenAI's gpt-oss, LLM_ARCH_OPENAI_MOE)
                per-expert biases (ffn_*_exps.bias), a router bias, attention
                sinks, attn_output.bias, post-attention norm, and sliding-window
                attention on every other layer.

Weights are random but deterministic given `seed`, and scaled so activations
stay O(1): linear weights ~ N(0, 1/fan_in), norms = 1.  The router has std 1.0
so different tokens pick different experts; random weights route at random (no
reuse between tokens): the hardest case for any cache.

The tokenizer is copied verbatim (every `tokenizer.*` key) from a vocab-only
GGUF; by default llama.cpp's llama-spm vocab shipped in hobbitpy/data.

CLI:  python scripts/make_synthetic_moe.py OUT.gguf --arch llama --n-layer 16 --n-embd 1024 --n-ff 4096
"""

from __future__ import annotations

import argparse
import pathlib

import numpy as np
import gguf
from gguf import GGMLQuantizationType as QT

from . import _ggml
from .gguf_fields import field_value

ARCHES = ("llama", "qwen2moe", "gpt-oss")
# the expert types the tests run at one precision against stock: those of the published
# quants (k-quants, the IQ family of the "dynamic" quants, gpt-oss's MXFP4, the BF16
# originals), those the CPU repacks (Q4_0, Q4_K, IQ4_NL), and Q8_0
EXPERT_TYPES = ("Q8_0", "Q4_0", "Q4_K", "Q5_K", "Q6_K", "IQ2_XXS", "IQ3_S", "IQ4_XS", "IQ4_NL", "MXFP4", "BF16", "F16")



# --------------------------------------------------------------------------
# tokenizer copy
# --------------------------------------------------------------------------

def _copy_tokenizer(writer: gguf.GGUFWriter, vocab_gguf) -> int:
    """Copy every tokenizer.* key from `vocab_gguf`; return n_vocab."""
    reader = gguf.GGUFReader(str(vocab_gguf))
    n_vocab = None
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        val, vtype, sub = field_value(field)
        writer.add_key_value(key, val, vtype, sub_type=sub)
        if key == "tokenizer.ggml.tokens":
            n_vocab = len(val)
    if n_vocab is None:
        raise ValueError(f"{vocab_gguf}: no tokenizer.ggml.tokens array")
    return n_vocab


# --------------------------------------------------------------------------
# quantization
# --------------------------------------------------------------------------

def _encode(x: np.ndarray, type_name: str) -> tuple[np.ndarray, QT | None]:
    """Convert a float32 tensor to (array, raw_dtype) for GGUFWriter.add_tensor: any ggml
    type, quantized by ggml's own quantizer (the types that need an importance matrix get
    a uniform one)."""
    if type_name == "F32":
        return x.astype(np.float32), None
    if type_name == "F16":
        return x.astype(np.float16), None
    qtype = QT[type_name]
    block, _ = gguf.GGML_QUANT_SIZES[qtype]
    if x.shape[-1] % block:
        raise ValueError(f"{type_name} needs the row length to be a multiple of {block}, "
                         f"got {x.shape[-1]} (tensor shape {x.shape})")
    n_per_row = x.shape[-1]
    importance = np.ones(n_per_row, np.float32) if _ggml.lib.ggml_quantize_requires_imatrix(int(qtype)) else None
    rows = _ggml.quantize_rows(x.reshape(-1, n_per_row), int(qtype), importance)
    return rows.reshape(*x.shape[:-1], rows.shape[-1]), qtype


_FILE_TYPE = {
    "F32": gguf.LlamaFileType.ALL_F32,
    "F16": gguf.LlamaFileType.MOSTLY_F16,
    "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
    "Q4_0": gguf.LlamaFileType.MOSTLY_Q4_0,
    "Q4_K": gguf.LlamaFileType.MOSTLY_Q4_K_S,   # descriptive only
    "Q5_K": gguf.LlamaFileType.MOSTLY_Q5_K_S,
    "Q6_K": gguf.LlamaFileType.MOSTLY_Q6_K,
    "BF16": gguf.LlamaFileType.MOSTLY_BF16,
    "IQ2_XXS": gguf.LlamaFileType.MOSTLY_IQ2_XXS,
    "IQ3_S": gguf.LlamaFileType.MOSTLY_IQ3_S,
    "IQ4_XS": gguf.LlamaFileType.MOSTLY_IQ4_XS,
    "MXFP4": gguf.LlamaFileType.MOSTLY_MXFP4_MOE,
}


# --------------------------------------------------------------------------
# model
# --------------------------------------------------------------------------

def make_synthetic_moe(path, arch="llama", *, vocab_gguf=None, n_layer=4, n_expert=8, n_expert_used=2,
                  n_embd=128, n_ff=256, n_ff_shared=256, n_head=4, n_head_kv=2,
                  expert_type="Q8_0", down_type_odd_layers=None, layer_types=None, seed=0, n_ctx_train=512,
                  zero_output=False) -> pathlib.Path:
    """Write a random MoE GGUF to `path` and return it as a Path (defaults: tiny).

    n_ff is the width of each routed expert; n_ff_shared the width of the
    qwen2moe shared expert (ignored by other arches).  down_type_odd_layers, if
    given, is the type of ffn_down_exps on odd layers, so expert shapes and types
    differ between layers as in llama.cpp's mixed quants (Q4_K_M keeps some down
    projections in Q6_K).  expert_type is the
    ggml type of ffn_{gate,up,down}_exps.weight: any type ggml quantizes (EXPERT_TYPES
    lists those the tests run; the k-quants and IQ types need n_embd and n_ff to be
    multiples of 256), quantized by ggml's own quantizer.  layer_types, if given, is the
    expert type of each layer in turn (cycled), as the "dynamic" quants mix them.
    zero_output writes an all-zero output matrix: every logit is exactly 0, so the
    next-token distribution is uniform and the perplexity of any text is n_vocab (a
    known answer for testing evaluation code).
    """
    if arch not in ARCHES:
        raise ValueError(f"arch must be one of {ARCHES}, got {arch!r}")
    if n_embd % n_head or n_head % n_head_kv:
        raise ValueError("n_embd must divide by n_head and n_head by n_head_kv")
    if n_expert == 0 and arch != "llama":
        raise ValueError("a dense model (n_expert=0) is only made for arch 'llama'")
    if n_expert and not 0 < n_expert_used <= n_expert:
        raise ValueError("need 0 < n_expert_used <= n_expert")

    if vocab_gguf is None:
        from ._native import DATA_DIR
        vocab_gguf = DATA_DIR / "ggml-vocab-llama-spm.gguf"
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    head_dim = n_embd // n_head
    n_embd_kv = head_dim * n_head_kv

    def normal(*shape, std):
        return (rng.standard_normal(shape, dtype=np.float32) * std).astype(np.float32)

    def linear(n_out, n_in):
        # numpy shape is ggml's ne reversed: ggml {n_in, n_out} == numpy (n_out, n_in)
        return normal(n_out, n_in, std=1.0 / np.sqrt(n_in))

    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny-{arch}-moe")

    # ---- hparams ----------------------------------------------------------
    # generic keys read by llama_model_base::load_hparams for every arch
    w.add_context_length(n_ctx_train)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff)      # llama: this IS the expert width
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)       # required by all three arches
    if n_expert:
        w.add_expert_count(n_expert)
        w.add_expert_used_count(n_expert_used)
    if arch in ("qwen2moe", "gpt-oss"):
        # gpt-oss: required; qwen2moe: optional but otherwise n_ff/n_expert_used
        w.add_expert_feed_forward_length(n_ff)
    if arch == "qwen2moe":
        w.add_expert_shared_feed_forward_length(n_ff_shared)
    if arch == "gpt-oss":
        # required (get_key without default); every 2nd layer uses SWA
        w.add_sliding_window(128)
    w.add_file_type(_FILE_TYPE.get(expert_type, gguf.LlamaFileType.GUESSED))

    n_vocab = _copy_tokenizer(w, vocab_gguf)

    # ---- tensors ----------------------------------------------------------
    # dense weights F16 (like real models), norms/biases/router/sinks F32
    # (ggml wants F32 for those: norms multiply elementwise, sinks go into
    # soft_max_ext, the router logits drive top-k selection).
    def add(name, arr, type_name="F32"):
        data, raw = _encode(arr, type_name)
        w.add_tensor(name, data, raw_dtype=raw)

    # routed experts go last in the file, so a test can cut into expert data alone
    # (the rest stays mapped and intact) to provoke a read error mid-run
    deferred = []

    def add_expert(name, arr, type_name):
        deferred.append((name, arr, type_name))

    add("token_embd.weight", normal(n_vocab, n_embd, std=1.0), "F16")

    for i in range(n_layer):
        p = f"blk.{i}."
        add(p + "attn_norm.weight", np.ones(n_embd, np.float32))
        add(p + "attn_q.weight", linear(n_head * head_dim, n_embd), "F16")
        add(p + "attn_k.weight", linear(n_embd_kv, n_embd), "F16")
        add(p + "attn_v.weight", linear(n_embd_kv, n_embd), "F16")
        add(p + "attn_output.weight", linear(n_embd, n_head * head_dim), "F16")
        if arch == "gpt-oss":
            add(p + "attn_output.bias", normal(n_embd, std=0.02))
            add(p + "attn_sinks.weight", normal(n_head, std=0.5))
            add(p + "post_attention_norm.weight", np.ones(n_embd, np.float32))
        else:
            add(p + "ffn_norm.weight", np.ones(n_embd, np.float32))

        if n_expert == 0:
            add(p + "ffn_gate.weight", linear(n_ff, n_embd), "F16")
            add(p + "ffn_up.weight", linear(n_ff, n_embd), "F16")
            add(p + "ffn_down.weight", linear(n_embd, n_ff), "F16")
            continue

        # router: std 1.0 -> sharp, token-dependent top-k
        add(p + "ffn_gate_inp.weight", normal(n_expert, n_embd, std=1.0))
        if arch == "gpt-oss":
            add(p + "ffn_gate_inp.bias", normal(n_expert, std=0.1))

        # routed experts, stacked numpy (n_expert, n_out, n_in) == ggml {n_in, n_out, n_expert}
        layer_type = layer_types[i % len(layer_types)] if layer_types else expert_type
        add_expert(p + "ffn_gate_exps.weight", normal(n_expert, n_ff, n_embd, std=1.0 / np.sqrt(n_embd)), layer_type)
        add_expert(p + "ffn_up_exps.weight", normal(n_expert, n_ff, n_embd, std=1.0 / np.sqrt(n_embd)), layer_type)
        down_type = down_type_odd_layers if (down_type_odd_layers and i % 2 == 1) else layer_type
        add_expert(p + "ffn_down_exps.weight", normal(n_expert, n_embd, n_ff, std=1.0 / np.sqrt(n_ff)), down_type)
        if arch == "gpt-oss":
            # per-expert biases: ggml {n_out, n_expert} == numpy (n_expert, n_out)
            add(p + "ffn_gate_exps.bias", normal(n_expert, n_ff, std=0.1))
            add(p + "ffn_up_exps.bias", normal(n_expert, n_ff, std=0.1))
            add(p + "ffn_down_exps.bias", normal(n_expert, n_embd, std=0.1))

        if arch == "qwen2moe":
            # shared expert; ffn_gate_inp_shexp is 1-D {n_embd}: one sigmoid gate per token
            add(p + "ffn_gate_inp_shexp.weight", normal(n_embd, std=1.0 / np.sqrt(n_embd)))
            add(p + "ffn_gate_shexp.weight", linear(n_ff_shared, n_embd), "F16")
            add(p + "ffn_up_shexp.weight", linear(n_ff_shared, n_embd), "F16")
            add(p + "ffn_down_shexp.weight", linear(n_embd, n_ff_shared), "F16")

    add("output_norm.weight", np.ones(n_embd, np.float32))
    # untied, independent output matrix: with output == token_embd the greedy
    # argmax tends to repeat the input token forever
    out = linear(n_vocab, n_embd)
    add("output.weight", np.zeros_like(out) if zero_output else out, "F16")
    for name, arr, type_name in deferred:
        add(name, arr, type_name)

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def main(argv=None):
    ap = argparse.ArgumentParser(description="write a random-weight MoE GGUF")
    ap.add_argument("out")
    ap.add_argument("--arch", default="llama", choices=ARCHES)
    ap.add_argument("--vocab", default=None, help="vocab-only GGUF (default: llama.cpp's llama-spm vocab)")
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--n-expert", type=int, default=8)
    ap.add_argument("--n-expert-used", type=int, default=2)
    ap.add_argument("--n-embd", type=int, default=128)
    ap.add_argument("--n-ff", type=int, default=256)
    ap.add_argument("--n-ff-shared", type=int, default=256)
    ap.add_argument("--n-head", type=int, default=4)
    ap.add_argument("--n-head-kv", type=int, default=2)
    ap.add_argument("--expert-type", default="Q8_0")
    ap.add_argument("--down-type-odd-layers", default=None, help="type of ffn_down_exps on odd layers (mixed quants)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--n-ctx-train", type=int, default=512)
    a = ap.parse_args(argv)
    out = make_synthetic_moe(a.out, a.arch, vocab_gguf=a.vocab, n_layer=a.n_layer, n_expert=a.n_expert,
                        n_expert_used=a.n_expert_used, n_embd=a.n_embd, n_ff=a.n_ff,
                        n_ff_shared=a.n_ff_shared, n_head=a.n_head, n_head_kv=a.n_head_kv,
                        expert_type=a.expert_type, down_type_odd_layers=a.down_type_odd_layers, seed=a.seed,
                        n_ctx_train=a.n_ctx_train)
    print(f"{out}  {out.stat().st_size} bytes")


if __name__ == "__main__":
    main()
