#!/usr/bin/env python3
"""Train a small Mixture-of-Experts language model on public-domain English text and
write it as a GGUF that stock llama.cpp runs.

Data: the King James Bible (public domain) from Debian's bible-kjv-text package,
decoded with the `bible` program of bible-kjv (apt-get download, nothing installed).
Tokenizer: byte-level BPE trained here (tokenizers), stored as a llama.cpp "gpt2" vocab.
Models: "mixtral" (llama arch: 8 experts, top-2, renormalized softmax gate, NORM rope)
and "deepseek" (qwen2moe arch: a sigmoid-gated shared expert plus fine-grained routed
experts, top-4, softmax gate without renormalization, NEOX rope) are the shipped references.
"qwen3-30b-a3b" (qwen3moe arch: 48 layers, 128 experts top-8, renormalized softmax gate,
per-head q/k RMSNorm, NEOX rope) and "mixtral-8x7b" (llama arch: 32 layers, 8 experts top-2)
have the real models' depth, expert count and top-k at a small width; widen_to_real_size.py
makes them real size (their hidden size and expert width are chosen so it can, exactly).

    pip install -e ".[train]"     # torch and tokenizers, for this script only
    python scripts/train_reference_moe.py mixtral models/ref-mixtral --minutes 35
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import pathlib
import re
import subprocess
import tempfile
import time

import gguf
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

EOT = "<|endoftext|>"


# ---------------------------------------------------------------- data

def fetch_kjv(cache: pathlib.Path) -> str:
    """The KJV text, one verse per line, without verse references."""
    out = cache / "kjv.txt"
    if out.exists():
        return out.read_text()
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(["apt-get", "download", "bible-kjv-text", "bible-kjv"], cwd=tmp, check=True, capture_output=True)
        for deb in pathlib.Path(tmp).glob("*.deb"):
            subprocess.run(["dpkg-deb", "-x", str(deb), "x"], cwd=tmp, check=True)
        data_dir = pathlib.Path(tmp) / "x/usr/lib"
        raw = subprocess.run([str(pathlib.Path(tmp) / "x/usr/bin/bible"), "-f", "Gen1:1-Rev22:21"],
                             cwd=data_dir, check=True, capture_output=True, text=True).stdout
    verses = [re.sub(r"^\S+\d+:\d+\s+", "", line).strip() for line in raw.splitlines()]
    text = "\n".join(v for v in verses if v) + "\n"
    out.write_text(text)
    return text


def split_kjv(text: str) -> tuple[str, str]:
    """Training and held-out text: the last 5 % of the verses (towards Revelation) are held out."""
    lines = text.splitlines()
    split = int(len(lines) * 0.95)
    return "\n".join(lines[:split]) + "\n", "\n".join(lines[split:]) + "\n"


DEFAULT_CACHE = pathlib.Path.home() / ".cache" / "hobbitpy-train"


# ---------------------------------------------------------------- tokenizer

def train_tokenizer(text: str, vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(text.splitlines(), trainer)
    return tok


# ---------------------------------------------------------------- model

@dataclasses.dataclass
class ModelConfig:
    kind: str            # a key of PRESETS
    n_vocab: int
    n_layer: int = 6
    n_embd: int = 256
    n_head: int = 8
    n_head_kv: int = 4
    n_expert: int = 8
    n_expert_used: int = 2
    n_ff: int = 512          # routed expert width
    n_ff_shared: int = 0     # shared expert width (deepseek)
    head_dim: int = 0        # 0: n_embd // n_head
    capacity: float = 0.0    # training only: selections an expert computes per step, as a multiple of
                             # the mean (Switch-style; the rest dropped); 0: every selection
    n_ctx: int = 256
    rope_base: float = 10000.0
    norm_eps: float = 1e-5

    @property
    def arch(self) -> str:
        return {"deepseek": "qwen2moe", "qwen3-30b-a3b": "qwen3moe"}.get(self.kind, "llama")

    @property
    def neox_rope(self) -> bool:  # llama.cpp: llama = NORM (adjacent pairs), qwen2moe/qwen3moe = NEOX (halves)
        return self.arch != "llama"

    @property
    def norm_topk(self) -> bool:  # Mixtral and Qwen3-MoE renormalize the top-k weights, Qwen2-MoE does not
        return self.arch != "qwen2moe"

    @property
    def qk_norm(self) -> bool:  # Qwen3 normalizes each head's q and k (RMSNorm over the head)
        return self.arch == "qwen3moe"

    @property
    def n_embd_head(self) -> int:
        return self.head_dim or self.n_embd // self.n_head


PRESETS = {
    "mixtral": dict(n_layer=6, n_embd=256, n_head=8, n_head_kv=4, n_expert=8, n_expert_used=2, n_ff=512),
    "deepseek": dict(n_layer=6, n_embd=256, n_head=8, n_head_kv=4, n_expert=24, n_expert_used=4, n_ff=128,
                     n_ff_shared=512),
    # the real models' depth, experts and top-k, heads in the real ratios (Qwen3-30B-A3B: 32 q / 4 kv
    # heads, q twice the hidden size; Mixtral-8x7B: 32 / 8); the width is 1/16 of the real one
    # (a power of 4, so padding the hidden size keeps RMSNorm exact), the experts' a divisor of theirs
    "qwen3-30b-a3b": dict(n_layer=48, n_embd=128, n_head=8, n_head_kv=1, head_dim=32, n_expert=128,
                          n_expert_used=8, n_ff=48, rope_base=1e6, norm_eps=1e-6, capacity=2.0),
    "mixtral-8x7b": dict(n_layer=32, n_embd=256, n_head=8, n_head_kv=2, n_expert=8, n_expert_used=2, n_ff=256,
                         rope_base=1e6, capacity=2.0),
}


class RMSNorm(nn.Module):
    def __init__(self, n, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def apply_rope(x, pos, base, neox):
    # x: [B, H, T, D]; the same rotation llama.cpp's ggml_rope applies for each mode
    d = x.shape[-1]
    inv = base ** (-torch.arange(0, d, 2, dtype=torch.float32) / d)
    ang = pos[:, None].float() * inv[None, :]           # [T, D/2]
    cos, sin = ang.cos(), ang.sin()
    if neox:
        x1, x2 = x[..., : d // 2], x[..., d // 2:]
        return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2)


class Attention(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.c = c
        hd = c.n_embd_head
        self.q = nn.Linear(c.n_embd, c.n_head * hd, bias=False)
        self.k = nn.Linear(c.n_embd, c.n_head_kv * hd, bias=False)
        self.v = nn.Linear(c.n_embd, c.n_head_kv * hd, bias=False)
        self.o = nn.Linear(c.n_head * hd, c.n_embd, bias=False)
        if c.qk_norm:
            self.q_norm, self.k_norm = RMSNorm(hd, c.norm_eps), RMSNorm(hd, c.norm_eps)

    def forward(self, x):
        c, (B, T, _) = self.c, x.shape
        hd = c.n_embd_head
        q = self.q(x).view(B, T, c.n_head, hd)
        k = self.k(x).view(B, T, c.n_head_kv, hd)
        if c.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = self.v(x).view(B, T, c.n_head_kv, hd).transpose(1, 2)
        pos = torch.arange(T)
        q, k = apply_rope(q, pos, c.rope_base, c.neox_rope), apply_rope(k, pos, c.rope_base, c.neox_rope)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o(y.transpose(1, 2).reshape(B, T, -1))


class MoE(nn.Module):
    """Top-k routed SwiGLU experts (+ an optional sigmoid-gated shared expert)."""

    def __init__(self, c: ModelConfig):
        super().__init__()
        self.c = c
        E, d, f = c.n_expert, c.n_embd, c.n_ff
        self.router = nn.Linear(d, E, bias=False)
        self.gate = nn.Parameter(torch.randn(E, f, d) / math.sqrt(d))
        self.up = nn.Parameter(torch.randn(E, f, d) / math.sqrt(d))
        self.down = nn.Parameter(torch.randn(E, d, f) / math.sqrt(f))
        if c.n_ff_shared:
            self.sh_gate = nn.Linear(d, c.n_ff_shared, bias=False)
            self.sh_up = nn.Linear(d, c.n_ff_shared, bias=False)
            self.sh_down = nn.Linear(c.n_ff_shared, d, bias=False)
            self.sh_inp = nn.Linear(d, 1, bias=False)

    def forward(self, x):
        c = self.c
        B, T, d = x.shape
        xf = x.reshape(-1, d)
        probs = F.softmax(self.router(xf), dim=-1)                  # [N, E]
        w, ids = probs.topk(c.n_expert_used, dim=-1)                # [N, k]
        if c.norm_topk:
            w = w / w.sum(-1, keepdim=True)
        out = self._experts(xf, ids, w)
        if c.n_ff_shared:
            sh = self.sh_down(F.silu(self.sh_gate(xf)) * self.sh_up(xf))
            out = out + torch.sigmoid(self.sh_inp(xf)) * sh
        # Switch-style load balancing: fraction routed times mean probability, per expert
        frac = torch.zeros(c.n_expert).index_add_(0, ids.flatten(), torch.ones(ids.numel())) / ids.numel()
        aux = c.n_expert * (frac * probs.mean(0)).sum()
        return out.view(B, T, d), aux

    def _experts(self, xf, ids, w):
        """Every token's selected experts, computed per expert in one batched matmul: the
        selections sorted by expert into [n_expert, capacity, d] (a loop over 128 experts x 48
        layers would spend the step in Python). In training, an expert past its capacity drops
        the rest of its selections (their output is 0); in evaluation none is dropped."""
        E = self.c.n_expert
        k = ids.shape[1]
        expert = ids.reshape(-1)
        order = torch.argsort(expert, stable=True)
        expert_sorted = expert[order]
        counts = torch.bincount(expert_sorted, minlength=E)
        starts = torch.cumsum(counts, 0) - counts
        slot = torch.arange(expert.numel()) - starts[expert_sorted]
        capacity = int(counts.max())
        if self.training and self.c.capacity:
            capacity = min(capacity, int(self.c.capacity * expert.numel() / E) + 1)
            kept = slot < capacity
            order, expert_sorted, slot = order[kept], expert_sorted[kept], slot[kept]
        token = order // k
        h = xf.new_zeros(E, capacity, xf.shape[1])
        h[expert_sorted, slot] = xf[token]
        y = torch.bmm(F.silu(torch.bmm(h, self.gate.transpose(1, 2))) * torch.bmm(h, self.up.transpose(1, 2)),
                      self.down.transpose(1, 2))
        out = torch.zeros_like(xf)
        out.index_add_(0, token, y[expert_sorted, slot] * w.reshape(-1)[order, None])
        return out


class Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.attn_norm, self.attn = RMSNorm(c.n_embd, c.norm_eps), Attention(c)
        self.ffn_norm, self.moe = RMSNorm(c.n_embd, c.norm_eps), MoE(c)

    def forward(self, x):
        x = x + self.attn(self.attn_norm(x))
        y, aux = self.moe(self.ffn_norm(x))
        return x + y, aux


class MoELM(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.c = c
        self.embd = nn.Embedding(c.n_vocab, c.n_embd)
        nn.init.normal_(self.embd.weight, std=0.02)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.n_layer))
        self.norm = RMSNorm(c.n_embd, c.norm_eps)
        self.out = nn.Linear(c.n_embd, c.n_vocab, bias=False)

    def forward(self, idx):
        x = self.embd(idx)
        aux = 0.0
        for b in self.blocks:
            x, a = b(x)
            aux = aux + a
        return self.out(self.norm(x)), aux / len(self.blocks)


# ---------------------------------------------------------------- GGUF

# the models saw one verse per line and nothing else: a chat is shown to them the same way,
# each message's text on its own line, and the reply is the line that follows
CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] | trim }}\n{% endfor %}"

def write_gguf(model: MoELM, tok: Tokenizer, path: pathlib.Path, weight_type: str) -> None:
    """weight_type: "F32", "F16" or "Q8_0" for the matrices; norms, routers and gates stay F32."""
    c = model.c
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    w = gguf.GGUFWriter(str(path), c.arch)
    w.add_name(f"hobbitpy-ref-{c.kind}")
    w.add_context_length(c.n_ctx)
    w.add_embedding_length(c.n_embd)
    w.add_block_count(c.n_layer)
    w.add_feed_forward_length(c.n_ff)
    w.add_head_count(c.n_head)
    w.add_head_count_kv(c.n_head_kv)
    w.add_rope_dimension_count(c.n_embd_head)
    w.add_key_length(c.n_embd_head)
    w.add_value_length(c.n_embd_head)
    w.add_rope_freq_base(c.rope_base)
    w.add_layer_norm_rms_eps(c.norm_eps)
    w.add_expert_count(c.n_expert)
    w.add_expert_used_count(c.n_expert_used)
    if c.arch != "llama":
        w.add_expert_feed_forward_length(c.n_ff)
    if c.arch == "qwen2moe":
        w.add_expert_shared_feed_forward_length(c.n_ff_shared)
    w.add_file_type({"Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0, "F16": gguf.LlamaFileType.MOSTLY_F16,
                     "F32": gguf.LlamaFileType.ALL_F32}[weight_type])

    # tokenizer: byte-level BPE, llama.cpp's "gpt2" model with the GPT-2 pre-tokenizer
    vocab = tok.get_vocab()
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    merges = json.loads(tok.to_str())["model"]["merges"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in merges]
    eot = vocab[EOT]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL if i == eot else gguf.TokenType.NORMAL for i in range(len(tokens))])
    w.add_token_merges(merges)
    w.add_bos_token_id(eot)
    w.add_eos_token_id(eot)
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)

    def add(name, arr, kind="matrix"):
        if kind == "f32" or weight_type == "F32":
            w.add_tensor(name, arr.astype(np.float32))
        elif weight_type == "Q8_0" and arr.shape[-1] % 32 == 0:
            w.add_tensor(name, gguf.quants.quantize(arr.astype(np.float32), gguf.GGMLQuantizationType.Q8_0),
                         raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(name, arr.astype(np.float16))

    add("token_embd.weight", sd["embd.weight"])
    for i in range(c.n_layer):
        p, b = f"blk.{i}.", f"blocks.{i}."
        add(p + "attn_norm.weight", sd[b + "attn_norm.weight"], "f32")
        add(p + "attn_q.weight", sd[b + "attn.q.weight"])
        add(p + "attn_k.weight", sd[b + "attn.k.weight"])
        add(p + "attn_v.weight", sd[b + "attn.v.weight"])
        add(p + "attn_output.weight", sd[b + "attn.o.weight"])
        if c.qk_norm:
            add(p + "attn_q_norm.weight", sd[b + "attn.q_norm.weight"], "f32")
            add(p + "attn_k_norm.weight", sd[b + "attn.k_norm.weight"], "f32")
        add(p + "ffn_norm.weight", sd[b + "ffn_norm.weight"], "f32")
        add(p + "ffn_gate_inp.weight", sd[b + "moe.router.weight"], "f32")
        add(p + "ffn_gate_exps.weight", sd[b + "moe.gate"])
        add(p + "ffn_up_exps.weight", sd[b + "moe.up"])
        add(p + "ffn_down_exps.weight", sd[b + "moe.down"])
        if c.n_ff_shared:
            add(p + "ffn_gate_inp_shexp.weight", sd[b + "moe.sh_inp.weight"].reshape(-1), "f32")
            add(p + "ffn_gate_shexp.weight", sd[b + "moe.sh_gate.weight"])
            add(p + "ffn_up_shexp.weight", sd[b + "moe.sh_up.weight"])
            add(p + "ffn_down_shexp.weight", sd[b + "moe.sh_down.weight"])
    add("output_norm.weight", sd["norm.weight"], "f32")
    add("output.weight", sd["out.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


# ---------------------------------------------------------------- checks on the GGUF

@torch.no_grad()
def check_gguf(path: pathlib.Path, model: MoELM, tok: Tokenizer, val_ids: np.ndarray) -> dict:
    """llama.cpp against torch on held-out text: the same tokens, close logits, and the
    held-out perplexity measured by llama.cpp itself."""
    import hobbitpy  # the patched llama.cpp, stock path

    c = model.c
    llm = hobbitpy.Llama(path, offload=hobbitpy.OffloadConfig(enabled=False), n_ctx=c.n_ctx, n_batch=c.n_ctx,
                         logits_all=True, verbose=False)
    try:
        sample = tok.decode(val_ids[:200].tolist())
        same_tokens = llm.tokenize(sample.encode(), add_bos=False) == tok.encode(sample).ids
        window = val_ids[: c.n_ctx]
        llm.eval(window.tolist())
        ll = np.array(llm.scores[: c.n_ctx])
        model.eval()
        th = model(torch.from_numpy(window[None]).long())[0][0].numpy()
        model.train()
        nll, n = 0.0, 0
        for s in range(0, len(val_ids) - c.n_ctx, c.n_ctx):
            w = val_ids[s: s + c.n_ctx + 1]
            llm.reset()
            llm.eval(w[:-1].tolist())
            logits = np.array(llm.scores[: c.n_ctx], dtype=np.float64)
            logz = logits.max(-1) + np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1))
            nll += float((logz - logits[np.arange(c.n_ctx), w[1:]]).sum())
            n += c.n_ctx
        return dict(same_tokens=bool(same_tokens), max_abs_logit_diff=float(np.abs(ll - th).max()),
                    top1_agreement=float((ll.argmax(-1) == th.argmax(-1)).mean()),
                    val_ppl_llama_cpp=round(math.exp(nll / n), 3), val_tokens_scored=n)
    finally:
        llm.close()


# ---------------------------------------------------------------- training

def batches(ids: np.ndarray, n_ctx: int, batch: int, rng: np.random.Generator):
    while True:
        starts = rng.integers(0, len(ids) - n_ctx - 1, batch)
        x = np.stack([ids[s: s + n_ctx] for s in starts])
        y = np.stack([ids[s + 1: s + n_ctx + 1] for s in starts])
        yield torch.from_numpy(x).long(), torch.from_numpy(y).long()


@torch.no_grad()
def evaluate(model, ids, n_ctx, n_windows=16) -> float:
    model.eval()
    losses = []
    for s in np.linspace(0, len(ids) - n_ctx - 1, n_windows).astype(int):
        x = torch.from_numpy(ids[s: s + n_ctx][None]).long()
        y = torch.from_numpy(ids[s + 1: s + n_ctx + 1][None]).long()
        logits, _ = model(x)
        losses.append(F.cross_entropy(logits.view(-1, logits.shape[-1]), y.view(-1)).item())
    model.train()
    return math.exp(float(np.mean(losses)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("kind", choices=list(PRESETS))
    ap.add_argument("out_prefix", help="writes OUT_PREFIX-Q8_0.gguf (and -F16.gguf if under ~40 MB) and OUT_PREFIX.json")
    ap.add_argument("--minutes", type=float, default=35.0, help="training time budget (in all, over resumed runs)")
    ap.add_argument("--checkpoint", help="keep the training state here every 10 minutes and at the end, and resume "
                                         "from it: a budget longer than one session is trained over several runs")
    ap.add_argument("--run-minutes", type=float, help="with --checkpoint: stop this run after so many minutes "
                                                      "(the GGUFs are written from the state reached)")
    ap.add_argument("--steps", type=int, help="stop at this many steps in all (over resumed runs), or at the time "
                                              "budget if that comes first: as many steps on a faster or busier "
                                              "machine (the learning rate follows the time budget)")
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--aux-weight", type=float, default=0.01, help="load-balancing loss weight")
    ap.add_argument("--cache", default=str(DEFAULT_CACHE))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--types", help="comma-separated weight types to write (F32, F16, Q8_0); default: Q8_0, "
                                    "and F16 when that stays under ~40 MB")
    a = ap.parse_args()

    torch.manual_seed(a.seed)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    cache = pathlib.Path(a.cache)
    train_text, val_text = split_kjv(fetch_kjv(cache))
    tok = train_tokenizer(train_text, a.vocab)
    train_ids = np.array(tok.encode(train_text).ids, dtype=np.int64)
    val_ids = np.array(tok.encode(val_text).ids, dtype=np.int64)

    c = ModelConfig(kind=a.kind, n_vocab=tok.get_vocab_size(), **PRESETS[a.kind])
    model = MoELM(c)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"{a.kind}: {n_params / 1e6:.1f}M parameters, {len(train_ids)} training tokens, "
          f"{len(val_ids)} held-out tokens, vocab {c.n_vocab}", flush=True)

    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.95), weight_decay=0.1)
    rng = np.random.default_rng(a.seed)
    step, before = 0, 0.0  # steps and seconds of the runs this one resumes
    checkpoint = pathlib.Path(a.checkpoint) if a.checkpoint else None
    if checkpoint and checkpoint.exists():
        state = torch.load(checkpoint, weights_only=False)
        if state["config"] != dataclasses.asdict(c):
            raise SystemExit(f"{checkpoint}: a checkpoint of another model ({state['config']['kind']})")
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        rng.bit_generator.state = state["rng"]
        torch.set_rng_state(state["torch_rng"])
        step, before = state["step"], state["seconds"]
        print(f"resumed from {checkpoint}: step {step}, {before / 60:.1f} of {a.minutes:.0f} min", flush=True)

    def keep() -> None:
        if checkpoint:
            part = checkpoint.with_name(checkpoint.name + ".part")
            torch.save(dict(config=dataclasses.asdict(c), model=model.state_dict(), opt=opt.state_dict(),
                            rng=rng.bit_generator.state, torch_rng=torch.get_rng_state(), step=step,
                            seconds=before + time.time() - t0), part)
            part.replace(checkpoint)

    t0, budget = time.time(), a.minutes * 60
    run_end = t0 + (a.run_minutes * 60 if a.run_minutes else math.inf)
    kept_at = t0
    data = batches(train_ids, c.n_ctx, a.batch, rng)
    while ((elapsed := before + time.time() - t0) < budget and time.time() < run_end
           and (a.steps is None or step < a.steps)):
        if time.time() - kept_at > 600:
            keep()
            kept_at = time.time()
        frac = elapsed / budget
        for g in opt.param_groups:  # warm-up then cosine, on the time budget
            g["lr"] = a.lr * min(1.0, step / 100) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        x, y = next(data)
        logits, aux = model(x)
        loss = F.cross_entropy(logits.view(-1, c.n_vocab), y.view(-1))
        opt.zero_grad(set_to_none=True)
        (loss + a.aux_weight * aux).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        if step % 50 == 0:
            print(f"step {step:5d}  {elapsed / 60:5.1f}/{a.minutes:.0f} min  loss {loss.item():.3f}  aux {aux.item():.3f}",
                  flush=True)
    keep()
    minutes = (before + time.time() - t0) / 60
    val_ppl = evaluate(model, val_ids, c.n_ctx)
    print(f"done: {step} steps in {minutes:.1f} min, held-out perplexity (torch) {val_ppl:.2f}", flush=True)

    out = pathlib.Path(a.out_prefix)
    out.parent.mkdir(parents=True, exist_ok=True)
    checks = {}
    # F16 too when the file stays small enough to ship (~40 MB)
    types = a.types.split(",") if a.types else ("Q8_0", "F16") if n_params * 2 < 40e6 else ("Q8_0",)
    for wt in types:
        path = out.with_name(out.name + f"-{wt}.gguf")
        write_gguf(model, tok, path, wt)
        checks[wt] = check_gguf(path, model, tok, val_ids)
        print(f"{path.name}: {checks[wt]}", flush=True)
    card = dict(checks=checks, kind=a.kind, arch=c.arch, config=dataclasses.asdict(c), parameters=n_params, steps=step,
                train_minutes=round(minutes, 1), train_tokens=int(len(train_ids)), val_tokens=int(len(val_ids)),
                val_ppl_torch=round(val_ppl, 3), data="King James Bible (public domain), Debian bible-kjv-text 4.38",
                val_text_sha256=__import__("hashlib").sha256(val_text.encode()).hexdigest())
    out.with_name(out.name + ".json").write_text(json.dumps(card, indent=2) + "\n")
    (cache / "val.txt").write_text(val_text)


if __name__ == "__main__":
    main()
