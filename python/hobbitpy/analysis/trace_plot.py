"""`hobbitpy plot TRACE.npz`: where the experts go, as one picture.

Three panels from a routing trace:

1. Selections per layer and expert (a heat map, each layer's row as shares of its
   selections): how unevenly the routers use their experts, the skew a cache lives on.
2. Reuse distance: for every selection, how many tokens ago the same layer last chose the
   same expert (log bins; "new" = never before in its sequence). Short distances are what
   any cache catches; the tail is what only a large one does.
3. Cumulative hit ratio over the trace's tokens for cache policies at one budget, replayed
   by the runtime's own policies (simulate.py). A policy's curve at token t is exactly its
   hit ratio on the first t tokens; Belady's is the optimum of each prefix.
"""

from __future__ import annotations

import io
import os

import numpy as np

from .simulate import slots_for_budget, simulate
from ..files.trace_file import Trace

DEFAULT_PLOT_POLICIES = ("lru", "lfu", "hobbit", "belady")
N_POINTS = 24  # prefixes the hit-ratio curves are sampled at


def selection_shares(trace: Trace) -> np.ndarray:
    """[moe_layers, n_expert]: each expert's share of its layer's selections."""
    n_layer, n_expert = trace.experts.shape[1], trace.meta["n_expert"]
    counts = np.zeros((n_layer, n_expert), np.int64)
    layer = np.broadcast_to(np.arange(n_layer)[None, :, None], trace.experts.shape)
    chosen = trace.experts >= 0
    np.add.at(counts, (layer[chosen], trace.experts[chosen]), 1)
    return counts / np.maximum(1, counts.sum(axis=1, keepdims=True))


def reuse_distances(trace: Trace) -> tuple[np.ndarray, int]:
    """Tokens since the same layer last chose the same expert, for every selection that
    has an earlier one in its sequence, and how many had none."""
    n_tokens, n_layer, _ = trace.experts.shape
    last = np.full((n_layer, trace.meta["n_expert"]), -1, np.int64)
    distances, first_uses = [], 0
    for t in range(n_tokens):
        if trace.seq_start[t]:
            last.fill(-1)
        for il in range(n_layer):
            for e in trace.experts[t, il]:
                if e < 0:
                    continue
                if last[il, e] < 0:
                    first_uses += 1
                else:
                    distances.append(t - last[il, e])
                last[il, e] = t
    return np.array(distances, np.int64), first_uses


def prefix(trace: Trace, n_tokens: int) -> Trace:
    """The first n_tokens of a trace."""
    return Trace(experts=trace.experts[:n_tokens], weights=trace.weights[:n_tokens], probs=trace.probs[:n_tokens],
                 predicted=trace.predicted[:n_tokens], seq_start=trace.seq_start[:n_tokens],
                 tokens=trace.tokens[:n_tokens], meta=trace.meta)


def hit_ratio_curves(trace: Trace, budget_mb: float, policies=DEFAULT_PLOT_POLICIES) -> tuple[np.ndarray, dict]:
    """Token counts and, per policy, the cumulative hit ratio at each."""
    ends = np.unique(np.linspace(1, trace.n_tokens, min(N_POINTS, trace.n_tokens)).astype(int))
    curves = {p: np.array([simulate(prefix(trace, n), budget_mb, p).hit_ratio for n in ends]) for p in policies}
    return ends, curves


def default_budget_mb(trace: Trace) -> float:
    """A quarter of every expert, at least one token's top-k: a cache that has to choose."""
    m = trace.meta
    n_slot = max(m["n_expert_used"], m["n_moe_layer"] * m["n_expert"] // 4)
    return n_slot * m["expert_bytes"] / (1024 * 1024)


def plot_trace(trace: Trace, *, budget_mb: float | None = None, policies=DEFAULT_PLOT_POLICIES,
               title: str | None = None) -> bytes:
    """The PNG of the three panels."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    budget_mb = default_budget_mb(trace) if budget_mb is None else budget_mb
    n_slot = slots_for_budget(trace, budget_mb)  # refuses a budget below one token's top-k
    shares = selection_shares(trace)
    distances, first_uses = reuse_distances(trace)
    ends, curves = hit_ratio_curves(trace, budget_mb, policies)
    m = trace.meta

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8), gridspec_kw={"width_ratios": [1.2, 1, 1]})
    ax = axes[0]
    im = ax.imshow(shares, aspect="auto", cmap="viridis", interpolation="nearest")
    ax.set_xlabel("expert")
    ax.set_ylabel("MoE layer")
    ax.set_title("share of each layer's selections")
    fig.colorbar(im, ax=ax, fraction=0.046)

    ax = axes[1]
    top = max(2, int(distances.max()) + 1) if distances.size else 2
    bins = np.unique(np.geomspace(1, top, 30).astype(int))
    if distances.size:
        ax.hist(distances, bins=bins, color="tab:blue")
    ax.set_xscale("log")
    ax.set_xlabel("tokens since the same layer chose the same expert")
    ax.set_ylabel("selections")
    ax.set_title(f"reuse distance ({first_uses} first uses in their sequence)")

    ax = axes[2]
    for p, curve in curves.items():
        ax.plot(ends, curve, label=p, linestyle="--" if p == "belady" else "-")
    ax.set_ylim(0, 1)
    ax.set_xlabel("tokens")
    ax.set_ylabel("cumulative hit ratio")
    ax.set_title(f"cache of {budget_mb:.1f} MB ({n_slot} of {m['n_moe_layer'] * m['n_expert']} experts)")
    ax.legend(loc="lower right")

    return png_of(fig, title or trace_title(trace))


def trace_title(trace: Trace) -> str:
    m = trace.meta
    return (f"{os.path.basename(m['model'])}: {trace.n_tokens} tokens, {m['n_moe_layer']} MoE layers x "
            f"{m['n_expert']} experts (top-{m['n_expert_used']})")


def png_of(fig, title: str) -> bytes:
    """The figure, titled, as PNG bytes; the figure is closed."""
    import matplotlib.pyplot as plt

    fig.suptitle(title)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    return buf.getvalue()
