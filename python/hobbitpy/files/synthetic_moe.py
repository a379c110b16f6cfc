"""Random-weight MoE GGUF models of any shape, for tests and throughput benchmarks.

`make_synthetic_moe()` writes a Mixture-of-Experts GGUF that stock llama.cpp loads
and runs, so tests can compare hobbitpy's expert offloading against the reference
without downloading real weights, and benchmarks can use models of real size.

Supported `arch` values: ARCH_LAYOUTS, each as llama.cpp's loader reads it (its keys and
tensors, src/models/<arch>.cpp) with the routing a model of it uses; docs/MODELS.md lists
them. "llama" with n_expert=0 makes a dense model (for the "dense model" paths).

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
import functools
import os
from dataclasses import dataclass
import pathlib

import numpy as np
import gguf
from gguf import GGMLQuantizationType as QT

from ..binding import ggml
from .gguf_fields import field_value

@dataclass(frozen=True)
class ArchLayout:
    """How an architecture's file differs from the llama (Mixtral) layout, as llama.cpp's
    src/models/<arch>.cpp loads it, and the routing its metadata asks for."""
    qk_norm: str | None = None       # "head": a [head_dim] norm of q and k; "full": over the whole projection
    mha: bool = False                # keys and values have as many heads as queries (the norm or the shapes need it)
    norm_biases: bool = False        # every norm, attn_output and the output have a bias (phimoe)
    ffn_norm: str = "ffn_norm"       # the FFN's pre-norm: post_attention_norm in glm4moe and gpt-oss
    fused_qkv: bool = False          # one attn_qkv tensor (bailingmoe2 needs it)
    mla: bool = False                # DeepSeek's multi-head latent attention
    dense_lead: int = 0              # leading layers with a dense FFN ({arch}.leading_dense_block_count)
    moe_every: int = 0               # only every n-th layer has experts ({arch}.interleave_moe_layer_step), the rest dense
    shared: str | None = None        # a shared expert: "plain" (added) or "sigmoid" (gated by ffn_gate_inp_shexp)
    shared_count: bool = False       # the shared width is {arch}.expert_shared_count experts of the routed width
    probs_bias: bool = False         # exp_probs_b: a bias on the router's scores for the selection only
    gating: int | None = None        # {arch}.expert_gating_func: 1 softmax, 2 sigmoid
    weights_norm: bool | None = None # {arch}.expert_weights_norm
    weights_scale: float | None = None  # {arch}.expert_weights_scale
    groups: tuple[int, int] | None = None  # {arch}.expert_group_count and _used_count: group-limited selection
    extra: tuple = ()                # other keys the loader requires: (name, value) pairs (floats and ints)
    delta_net: bool = False          # Gated DeltaNet linear-attention layers (a recurrent state), every 4th layer
                                     # full attention with a gated query (qwen3next)


# Supported architectures: the loader's keys and tensors of each, and the routing of a
# model that uses it (DeepSeek-V3's sigmoid scores with a bias and expert groups, GLM-4.5's,
# dots.llm1's and Ling-2's sigmoid with a bias, Llama 4's interleaved layers whose router
# weights scale each expert's input). Checked against the pinned llama.cpp's src/models/*.cpp.
ARCH_LAYOUTS = {
    "llama": ArchLayout(),
    "qwen2moe": ArchLayout(shared="sigmoid"),
    "gpt-oss": ArchLayout(ffn_norm="post_attention_norm"),
    "qwen3moe": ArchLayout(qk_norm="head"),
    "olmoe": ArchLayout(qk_norm="full", mha=True),
    "granitemoe": ArchLayout(shared="plain", extra=(("logit_scale", 1.0),)),
    "phimoe": ArchLayout(norm_biases=True),
    "deepseek2": ArchLayout(mla=True, dense_lead=1, shared="plain", shared_count=True, probs_bias=True, gating=2,
                            weights_norm=True, weights_scale=2.5, groups=(4, 2)),
    "glm4moe": ArchLayout(ffn_norm="post_attention_norm", dense_lead=1, shared="plain", shared_count=True,
                          probs_bias=True, gating=2, weights_norm=True, weights_scale=2.5),
    "llama4": ArchLayout(moe_every=2, shared="plain"),
    "ernie4_5-moe": ArchLayout(dense_lead=1, moe_every=1, shared="plain", probs_bias=True),
    "hunyuan-moe": ArchLayout(qk_norm="head", shared="plain"),
    "dots1": ArchLayout(qk_norm="head", mha=True, dense_lead=1, shared="plain", shared_count=True, probs_bias=True,
                        gating=2, weights_norm=True, weights_scale=2.5),
    "bailingmoe": ArchLayout(shared="plain", shared_count=True, weights_norm=True, weights_scale=1.0),
    "bailingmoe2": ArchLayout(qk_norm="head", fused_qkv=True, dense_lead=1, shared="plain", shared_count=True,
                              probs_bias=True, gating=2, weights_norm=True, weights_scale=2.5, groups=(4, 2)),
    "minimax-m2": ArchLayout(qk_norm="full", probs_bias=True, gating=2),
    "qwen3next": ArchLayout(qk_norm="head", ffn_norm="post_attention_norm", shared="sigmoid", delta_net=True),
}
ARCHES = tuple(ARCH_LAYOUTS)
# the architectures every feature's tests run on (routed experts only; a gated shared expert;
# biases and sinks); the others have their exactness test
FEATURE_ARCHES = ("llama", "qwen2moe", "gpt-oss")
# MLA's dimensions (DeepSeek-V2/V3's shape, small): no-rope and rope parts of a query and key
# head, a value head, the compressed key-value width
MLA_QK_NOPE, MLA_QK_ROPE, MLA_V, MLA_KV_LORA = 32, 16, 32, 64
# Gated DeltaNet's (Qwen3-Next's shape, small): the state of a head, key heads, value heads,
# the convolution's width; every DELTA_FULL_EVERY-th layer is full attention
DELTA_STATE, DELTA_K_HEADS, DELTA_V_HEADS, DELTA_CONV, DELTA_FULL_EVERY = 16, 2, 4, 4, 4

# the expert types the tests run at one precision against stock: those of the published
# quants (k-quants, the whole IQ family of the "dynamic" quants, gpt-oss's MXFP4, the BF16
# originals), those the CPU repacks (Q4_0, Q4_K, IQ4_NL), the legacy ones
EXPERT_TYPES = ("Q8_0", "Q5_0", "Q4_0", "Q4_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ1_S", "IQ1_M", "IQ2_XXS",
                "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ4_XS", "IQ4_NL", "MXFP4", "BF16", "F16")



# --------------------------------------------------------------------------
# tokenizer copy
# --------------------------------------------------------------------------

def _copy_tokenizer(writer: gguf.GGUFWriter, vocab_gguf) -> int:
    """Copy every tokenizer.* key from `vocab_gguf`; return n_vocab."""
    stat = os.stat(vocab_gguf)
    fields = _tokenizer_fields(os.path.abspath(vocab_gguf), stat.st_mtime_ns, stat.st_size)
    for key, val, vtype, sub in fields:
        writer.add_key_value(key, val, vtype, sub_type=sub)
    n_vocab = next((len(val) for key, val, _, _ in fields if key == "tokenizer.ggml.tokens"), None)
    if n_vocab is None:
        raise ValueError(f"{vocab_gguf}: no tokenizer.ggml.tokens array")
    return n_vocab


@functools.lru_cache(maxsize=4)
def _tokenizer_fields(vocab_path: str, mtime_ns: int, size: int) -> tuple:
    """The tokenizer.* keys of a vocabulary file as (key, value, type, sub type), read once
    per process and file version: gguf-py parses a 32k-token vocabulary's 96,000 parts in
    seconds, and a test session builds dozens of models from the same one."""
    reader = gguf.GGUFReader(vocab_path)
    return tuple((key, *field_value(field)) for key, field in reader.fields.items() if key.startswith("tokenizer."))


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
    importance = np.ones(n_per_row, np.float32) if ggml.requires_imatrix(int(qtype)) else None
    rows = ggml.quantize_rows(x.reshape(-1, n_per_row), int(qtype), importance)
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
    lay = ARCH_LAYOUTS[arch]
    if lay.mha:
        n_head_kv = n_head
    if lay.mla:
        n_head_kv = 1
    if n_embd % n_head or n_head % n_head_kv:
        raise ValueError("n_embd must divide by n_head and n_head by n_head_kv")
    if n_expert == 0 and arch != "llama":
        raise ValueError("a dense model (n_expert=0) is only made for arch 'llama'")
    if n_expert and not 0 < n_expert_used <= n_expert:
        raise ValueError("need 0 < n_expert_used <= n_expert")
    if lay.groups and (n_expert % lay.groups[0] or lay.groups[1] * n_expert // lay.groups[0] < n_expert_used):
        raise ValueError(f"{arch}'s expert groups {lay.groups} need n_expert divisible by {lay.groups[0]} and enough experts")

    if vocab_gguf is None:
        from ..binding.native import DATA_DIR
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

    def has_experts(i: int) -> bool:
        if not n_expert or i < lay.dense_lead:
            return False
        return lay.moe_every <= 1 or (i + 1) % lay.moe_every == 0

    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny-{arch}-moe")

    # ---- hparams ----------------------------------------------------------
    # generic keys read by llama_model_base::load_hparams for every arch
    w.add_context_length(n_ctx_train)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff)      # llama and some others: this IS the expert width (dense layers' too)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    if lay.mla:
        # MLA as converted models store it: keys of the compressed width plus the rope part, one KV head
        w.add_key_length(MLA_KV_LORA + MLA_QK_ROPE)
        w.add_value_length(MLA_KV_LORA)
        w.add_uint32(f"{arch}.attention.key_length_mla", MLA_QK_NOPE + MLA_QK_ROPE)
        w.add_uint32(f"{arch}.attention.value_length_mla", MLA_V)
        w.add_uint32(f"{arch}.attention.q_lora_rank", 0)  # a plain attn_q, as in V2-Lite
        w.add_uint32(f"{arch}.attention.kv_lora_rank", MLA_KV_LORA)
        w.add_rope_dimension_count(MLA_QK_ROPE)
    else:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
        w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    if n_expert:
        w.add_expert_count(n_expert)
        w.add_expert_used_count(n_expert_used)
    if arch != "llama":
        # required by most (some size their experts by feed_forward_length, which is the same)
        w.add_expert_feed_forward_length(n_ff)
    if lay.shared and lay.shared_count:
        w.add_uint32(f"{arch}.expert_shared_count", 1)
    elif lay.shared:
        w.add_expert_shared_feed_forward_length(n_ff_shared)
    if lay.dense_lead:
        w.add_uint32(f"{arch}.leading_dense_block_count", lay.dense_lead)
    if lay.moe_every:
        w.add_uint32(f"{arch}.interleave_moe_layer_step", lay.moe_every)
    if lay.gating is not None:
        w.add_uint32(f"{arch}.expert_gating_func", lay.gating)
    if lay.weights_norm is not None:
        w.add_bool(f"{arch}.expert_weights_norm", lay.weights_norm)
    if lay.weights_scale is not None:
        w.add_float32(f"{arch}.expert_weights_scale", lay.weights_scale)
    if lay.groups:
        w.add_uint32(f"{arch}.expert_group_count", lay.groups[0])
        w.add_uint32(f"{arch}.expert_group_used_count", lay.groups[1])
    if lay.delta_net:
        w.add_uint32(f"{arch}.ssm.conv_kernel", DELTA_CONV)
        w.add_uint32(f"{arch}.ssm.inner_size", DELTA_STATE * DELTA_V_HEADS)
        w.add_uint32(f"{arch}.ssm.state_size", DELTA_STATE)
        w.add_uint32(f"{arch}.ssm.time_step_rank", DELTA_V_HEADS)
        w.add_uint32(f"{arch}.ssm.group_count", DELTA_K_HEADS)
    for key, value in lay.extra:
        (w.add_float32 if isinstance(value, float) else w.add_uint32)(f"{arch}.{key}", value)
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

    def add_norm(name, width):
        add(name + ".weight", np.ones(width, np.float32))
        if lay.norm_biases:
            add(name + ".bias", np.zeros(width, np.float32))

    # routed experts go last in the file, so a test can cut into expert data alone
    # (the rest stays mapped and intact) to provoke a read error mid-run
    deferred = []

    def add_expert(name, arr, type_name):
        deferred.append((name, arr, type_name))

    add("token_embd.weight", normal(n_vocab, n_embd, std=1.0), "F16")

    for i in range(n_layer):
        p = f"blk.{i}."
        add_norm(p + "attn_norm", n_embd)
        if lay.mla:
            k_mla = MLA_QK_NOPE + MLA_QK_ROPE
            add(p + "attn_q.weight", linear(n_head * k_mla, n_embd), "F16")
            add(p + "attn_kv_a_mqa.weight", linear(MLA_KV_LORA + MLA_QK_ROPE, n_embd), "F16")
            add(p + "attn_kv_a_norm.weight", np.ones(MLA_KV_LORA, np.float32))
            add(p + "attn_k_b.weight", normal(n_head, MLA_KV_LORA, MLA_QK_NOPE, std=1.0 / np.sqrt(MLA_QK_NOPE)), "F16")
            add(p + "attn_v_b.weight", normal(n_head, MLA_V, MLA_KV_LORA, std=1.0 / np.sqrt(MLA_KV_LORA)), "F16")
            add(p + "attn_output.weight", linear(n_embd, n_head * MLA_V), "F16")
        elif lay.delta_net and (i + 1) % DELTA_FULL_EVERY:
            key_dim, value_dim = DELTA_STATE * DELTA_K_HEADS, DELTA_STATE * DELTA_V_HEADS
            add(p + "attn_qkv.weight", linear(2 * key_dim + value_dim, n_embd), "F16")
            add(p + "attn_gate.weight", linear(value_dim, n_embd), "F16")
            add(p + "ssm_conv1d.weight", normal(2 * key_dim + value_dim, DELTA_CONV, std=0.5))
            add(p + "ssm_dt.bias", normal(DELTA_V_HEADS, std=0.1))
            add(p + "ssm_a", -np.exp(normal(DELTA_V_HEADS, std=0.3)))
            add(p + "ssm_ba.weight", linear(2 * DELTA_V_HEADS, n_embd), "F16")
            add(p + "ssm_norm.weight", np.ones(DELTA_STATE, np.float32))
            add(p + "ssm_out.weight", linear(n_embd, value_dim), "F16")
        else:
            if lay.fused_qkv:
                add(p + "attn_qkv.weight", linear(n_head * head_dim + 2 * n_embd_kv, n_embd), "F16")
            else:
                # Qwen3-Next's full-attention query carries a gate of the same width
                add(p + "attn_q.weight", linear((2 if lay.delta_net else 1) * n_head * head_dim, n_embd), "F16")
                add(p + "attn_k.weight", linear(n_embd_kv, n_embd), "F16")
                add(p + "attn_v.weight", linear(n_embd_kv, n_embd), "F16")
            add(p + "attn_output.weight", linear(n_embd, n_head * head_dim), "F16")
            if lay.qk_norm == "head":
                add(p + "attn_q_norm.weight", np.ones(head_dim, np.float32))
                add(p + "attn_k_norm.weight", np.ones(head_dim, np.float32))
            elif lay.qk_norm == "full":
                add(p + "attn_q_norm.weight", np.ones(n_head * head_dim, np.float32))
                add(p + "attn_k_norm.weight", np.ones(n_embd_kv, np.float32))
        if arch == "gpt-oss" or lay.norm_biases:
            add(p + "attn_output.bias", normal(n_embd, std=0.02))
        if arch == "gpt-oss":
            add(p + "attn_sinks.weight", normal(n_head, std=0.5))
        add_norm(p + lay.ffn_norm, n_embd)

        if not has_experts(i):
            add(p + "ffn_gate.weight", linear(n_ff, n_embd), "F16")
            add(p + "ffn_up.weight", linear(n_ff, n_embd), "F16")
            add(p + "ffn_down.weight", linear(n_embd, n_ff), "F16")
            continue

        # router: std 1.0 -> sharp, token-dependent top-k
        add(p + "ffn_gate_inp.weight", normal(n_expert, n_embd, std=1.0))
        if arch == "gpt-oss":
            add(p + "ffn_gate_inp.bias", normal(n_expert, std=0.1))
        if lay.probs_bias:
            add(p + "exp_probs_b.bias", normal(n_expert, std=0.1))

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

        if lay.shared:
            width = n_ff if lay.shared_count or arch == "llama4" else n_ff_shared
            if lay.shared == "sigmoid":
                # ffn_gate_inp_shexp is 1-D {n_embd}: one sigmoid gate per token
                add(p + "ffn_gate_inp_shexp.weight", normal(n_embd, std=1.0 / np.sqrt(n_embd)))
            add(p + "ffn_gate_shexp.weight", linear(width, n_embd), "F16")
            add(p + "ffn_up_shexp.weight", linear(width, n_embd), "F16")
            add(p + "ffn_down_shexp.weight", linear(n_embd, width), "F16")

    add_norm("output_norm", n_embd)
    # untied, independent output matrix: with output == token_embd the greedy
    # argmax tends to repeat the input token forever
    out = linear(n_vocab, n_embd)
    add("output.weight", np.zeros_like(out) if zero_output else out, "F16")
    if lay.norm_biases:
        add("output.bias", np.zeros(n_vocab, np.float32))
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
