#!/usr/bin/env python3
"""Routing statistics of a MoE GGUF, the ones the papers build on, as one table.

For each MoE layer, over held-out text:
- reuse:  P(an expert selected at token t is selected again at t+1), against the
          uniform baseline k/E (HOBBIT Fig. 10a);
- next1 / nextk: the next layer's router applied to this layer's router input predicts
          the next layer's top-1 expert / the share of its top-k (HOBBIT Fig. 7b, Fate
          Table 1); uniform: 1/E and k/E;
- corr:   Pearson correlation between a selected expert's gate weight and the norm of
          its weighted output (HOBBIT Fig. 5a);
- skew:   popularity skew, the most used expert's share over the mean share (1 = even);
- used90: how many experts take 90 % of the layer's selections (uniform: 0.9 E);
- lru2k:  hit ratio of an LRU cache of 2k of the layer's experts, token after token (uniform:
          about 2k/E).

The GGUF is read back into the same PyTorch modules the training script uses (weights
dequantized with gguf), so this works for models written by
scripts/train_reference_moe.py (llama, qwen2moe and qwen3moe archs).

    python scripts/routing_stats.py models/ref-mixtral-Q8_0.gguf models/ref-deepseek-Q8_0.gguf

(without --text: the held-out split of the training data, fetched and split exactly as
the training script does)
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import gguf
import numpy as np
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import train_reference_moe as T  # noqa: E402


def load_model(path: str) -> T.MoELM:
    r = gguf.GGUFReader(path)
    f = {k: v for k, v in r.fields.items()}

    def kv(key):
        field = f[key]
        return field.parts[field.data[0]][0].item()

    arch = bytes(f["general.architecture"].parts[f["general.architecture"].data[0]]).decode()
    kind = {"llama": "mixtral", "qwen2moe": "deepseek", "qwen3moe": "qwen3-30b-a3b"}[arch]
    tensors = {t.name: gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32) for t in r.tensors}
    n_ff_key = f"{arch}.expert_feed_forward_length" if f"{arch}.expert_feed_forward_length" in f else f"{arch}.feed_forward_length"
    c = T.ModelConfig(kind=kind, n_vocab=tensors["token_embd.weight"].shape[0], n_layer=kv(f"{arch}.block_count"),
                      n_embd=kv(f"{arch}.embedding_length"), n_head=kv(f"{arch}.attention.head_count"),
                      n_head_kv=kv(f"{arch}.attention.head_count_kv"), n_expert=kv(f"{arch}.expert_count"),
                      n_expert_used=kv(f"{arch}.expert_used_count"), n_ff=kv(n_ff_key),
                      n_ff_shared=kv(f"{arch}.expert_shared_feed_forward_length") if kind == "deepseek" else 0,
                      n_ctx=kv(f"{arch}.context_length"),
                      head_dim=kv(f"{arch}.attention.key_length") if f"{arch}.attention.key_length" in f else 0)
    m = T.MoELM(c)
    names = {"embd.weight": "token_embd.weight", "norm.weight": "output_norm.weight", "out.weight": "output.weight"}
    for i in range(c.n_layer):
        p, b = f"blk.{i}.", f"blocks.{i}."
        names.update({b + "attn_norm.weight": p + "attn_norm.weight", b + "attn.q.weight": p + "attn_q.weight",
                      b + "attn.k.weight": p + "attn_k.weight", b + "attn.v.weight": p + "attn_v.weight",
                      b + "attn.o.weight": p + "attn_output.weight", b + "ffn_norm.weight": p + "ffn_norm.weight",
                      b + "moe.router.weight": p + "ffn_gate_inp.weight", b + "moe.gate": p + "ffn_gate_exps.weight",
                      b + "moe.up": p + "ffn_up_exps.weight", b + "moe.down": p + "ffn_down_exps.weight"})
        if c.qk_norm:
            names.update({b + "attn.q_norm.weight": p + "attn_q_norm.weight",
                          b + "attn.k_norm.weight": p + "attn_k_norm.weight"})
        if c.n_ff_shared:
            names.update({b + "moe.sh_inp.weight": p + "ffn_gate_inp_shexp.weight",
                          b + "moe.sh_gate.weight": p + "ffn_gate_shexp.weight",
                          b + "moe.sh_up.weight": p + "ffn_up_shexp.weight",
                          b + "moe.sh_down.weight": p + "ffn_down_shexp.weight"})
    state = {k: torch.from_numpy(tensors[v].reshape(m.state_dict()[k].shape)) for k, v in names.items()}
    m.load_state_dict(state)
    return m.eval()


@torch.no_grad()
def routing_stats(model: T.MoELM, ids: np.ndarray) -> list[dict]:
    c = model.c
    records = []  # per layer: router input, probs, selected ids, weights, weighted output norms

    def hook(moe, inputs, _output):
        xf = inputs[0].reshape(-1, c.n_embd)
        probs = torch.softmax(moe.router(xf), -1)
        w, sel = probs.topk(c.n_expert_used, -1)
        if c.norm_topk:
            w = w / w.sum(-1, keepdim=True)
        norms = torch.zeros_like(w)
        for k in range(c.n_expert_used):
            e = sel[:, k]
            g, u, d = moe.gate[e], moe.up[e], moe.down[e]
            y = torch.einsum("nfd,nd->nf", g, xf)
            y = torch.nn.functional.silu(y) * torch.einsum("nfd,nd->nf", u, xf)
            norms[:, k] = (w[:, k, None] * torch.einsum("ndf,nf->nd", d, y)).norm(dim=-1)
        records.append((xf, probs, sel, w, norms))

    handles = [b.moe.register_forward_hook(hook) for b in model.blocks]
    for s in range(0, len(ids) - c.n_ctx + 1, c.n_ctx):
        model(torch.from_numpy(ids[s: s + c.n_ctx][None]).long())
    for h in handles:
        h.remove()
    n_win = len(records) // c.n_layer
    per_layer = [[records[w * c.n_layer + l] for w in range(n_win)] for l in range(c.n_layer)]
    cat = [tuple(torch.cat([r[j] for r in recs]) for j in range(5)) for recs in per_layer]

    rows = []
    E, k = c.n_expert, c.n_expert_used
    for l, (x, probs, sel, w, norms) in enumerate(cat):
        onehot = torch.zeros(len(sel), E).scatter_(1, sel, 1.0)
        reuse = float((onehot[:-1] * onehot[1:]).sum() / onehot[:-1].sum())
        corr = float(np.corrcoef(w.flatten().numpy(), norms.flatten().numpy())[0, 1])
        share = onehot.mean(0) / k
        row = dict(layer=l, reuse=reuse, reuse_uniform=k / E, corr=corr, skew=float(share.max() / share.mean()),
                   used90=int(np.searchsorted(np.cumsum(np.sort(share.numpy())[::-1]), 0.9) + 1),
                   lru2k=lru_hit_ratio(sel.numpy(), 2 * k))
        if l + 1 < c.n_layer:
            nxt = model.blocks[l + 1].moe.router
            pred = torch.softmax(nxt(x), -1).topk(k, -1).indices
            actual = cat[l + 1][2]
            row["next1"] = float((pred[:, 0] == actual[:, 0]).float().mean())
            row["nextk"] = float(torch.zeros(len(pred), E).scatter_(1, pred, 1.0).mul(
                torch.zeros(len(pred), E).scatter_(1, actual, 1.0)).sum() / actual.numel())
        rows.append(row)
    return rows


def lru_hit_ratio(selected: np.ndarray, slots: int) -> float:
    """Hits of an LRU cache of `slots` experts over the selections, token after token."""
    cache: list[int] = []  # most recent last
    hits = 0
    for row in selected:
        for e in row:
            e = int(e)
            if e in cache:
                hits += 1
                cache.remove(e)
            cache.append(e)
        del cache[:-slots]
    return hits / selected.size


def print_table(path: str, model: T.MoELM, rows: list[dict], n_tokens: int) -> None:
    c = model.c
    print(f"{path}: {c.n_expert} experts, top-{c.n_expert_used}, {n_tokens} held-out tokens "
          f"(uniform next1 = 1/{c.n_expert} = {1 / c.n_expert:.3f})")
    print(f"{'layer':>5} {'reuse':>7} {'uniform':>8} {'next1':>7} {'nextk':>7} {'uniform':>8} {'corr':>6} {'skew':>6} "
          f"{'used90':>6} {'lru2k':>6}")
    for r in rows:
        n1 = f"{r['next1']:.3f}" if "next1" in r else "-"
        nk = f"{r['nextk']:.3f}" if "nextk" in r else "-"
        print(f"{r['layer']:>5} {r['reuse']:>7.3f} {r['reuse_uniform']:>8.3f} {n1:>7} {nk:>7} "
              f"{c.n_expert_used / c.n_expert:>8.3f} {r['corr']:>6.3f} {r['skew']:>6.2f} {r['used90']:>6} "
              f"{r['lru2k']:>6.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", nargs="+", help="GGUF files written by scripts/train_reference_moe.py")
    ap.add_argument("--text", help="held-out text (default: the training script's held-out split)")
    ap.add_argument("--max-tokens", type=int, default=8192)
    a = ap.parse_args()

    text = (pathlib.Path(a.text).read_text() if a.text else T.split_kjv(T.fetch_kjv(T.DEFAULT_CACHE))[1]).encode()
    import hobbitpy  # llama.cpp's own tokenizer of the GGUF
    for path in a.models:
        with hobbitpy.Llama(path, offload=hobbitpy.OffloadConfig(enabled=False), vocab_only=True, verbose=False) as llm:
            ids = np.array(llm.tokenize(text, add_bos=False), dtype=np.int64)[: a.max_tokens]
        model = load_model(path)
        print_table(path, model, routing_stats(model, ids), len(ids))
        print()


if __name__ == "__main__":
    main()
