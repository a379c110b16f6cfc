"""CORM's neuron sparsity, measured on a routing trace (CORM §3.1 Fig. 2, §3.4 Fig. 5b).

CORM loads only the *active* neurons of a selected expert: those whose activation
|act(W1 x)| exceeds a threshold θ (a neuron is a row of W1 and W3 and the matching column
of W2). It predicts them one layer ahead: the current MoE layer's input x through the next
layer's W1 of the expert it will select. Both are measured here, offline, from the router
inputs a trace recorded (`hobbitpy trace --neurons`) and the model's own gate weights:

- active share: of a selected expert's neurons, the share with |act(W1 x)| > θ (what a
  perfect predictor would read, before CORM's upper limit);
- predicted share: the share with |act(W1 x_prev)| > θ, x_prev the same token's input to
  the previous MoE layer (what CORM reads);
- recall: of the active neurons, the share the prediction covers (the rest are computed
  as zero: CORM's loss of accuracy; its Fig. 5b's neuron prediction accuracy).

The weights are dequantized in float32 (the model computes on its quantized weights with
ggml's kernels, so a neuron within rounding of θ may fall either side: a share, not a bit).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
import os
import numpy as np

from ..binding import hobbit
from ..settings.config import NEURON_LIMIT_CORM
from ..errors import HobbitError
from ..files.model_file import model_parts
from ..files.trace_file import NeuronStats, Trace

# architectures whose experts are SwiGLU (act = SiLU on W1's output, as CORM's models); gpt-oss
# clamps its own variant and merges W1 with W3, which CORM does not cover
# the mask prices CORM's arithmetic on stock's, every expert mapped
NEURONS_ON_STOCK = ("neuron sparsity is priced on the stock path, every expert mapped: run it without offload "
                    "(--no-offload)")
SILU_ARCHS = ("llama", "qwen2moe", "qwen3moe", "deepseek", "deepseek2", "olmoe", "granitemoe")




@dataclass(frozen=True)
class NeuronMaskSpec:
    """CORM's sparse neurons as `eval --neurons` prices them (hobbit-neuron-mask.cpp): neurons
    with |SiLU(W1 x)| <= theta add nothing, x the layer's own input (predicted False: a
    perfect predictor) or the previous MoE layer's (CORM); a selection keeping more than
    limit of its neurons is computed whole."""
    theta: float
    predicted: bool = True
    limit: float = NEURON_LIMIT_CORM

    def __post_init__(self):
        if not 0.0 <= self.theta < float("inf") or not 0.0 <= self.limit <= 1.0:
            raise ValueError(f"a neuron threshold must be finite and non-negative and the limit in [0, 1], got "
                             f"theta {self.theta}, limit {self.limit}")


def attach_neuron_mask(llm, spec: NeuronMaskSpec) -> None:
    """Run a stock Llama's context with the neuron mask as its graph evaluation callback; its
    counters go to neuron_mask_stats(llm)."""
    import llama_cpp

    if llm.offloaded:
        raise ValueError(NEURONS_ON_STOCK)
    check_arch(llm.model_path, llm.model_info.arch)  # elsewhere the mask would find no gate and price nothing
    llm._neuron_mask = hobbit.neuron_mask(spec.theta, spec.predicted, spec.limit)  # as long as the context
    llm._neuron_mask_cb = llama_cpp.ggml_backend_sched_eval_callback(hobbit.NEURON_MASK_CALLBACK)
    llm._reopen_context(1, llm._neuron_mask_cb, ctypes.c_void_p(hobbit.address(llm._neuron_mask)))


def neuron_mask_stats(llm) -> dict:
    """Selections the mask saw, how many it computed whole, and the mean share of neurons kept."""
    counted = hobbit.neuron_mask_stats(llm._neuron_mask)
    if counted is None:
        raise HobbitError(f"{llm.model_path}: the neuron mask could not read a gate projection's output (or ran out "
                          "of memory): these logits are not CORM's")
    n, whole, kept = counted
    return {"neuron_selections": n, "neuron_whole": whole, "neuron_kept_share": kept}


def parse_thetas(text: str) -> tuple[float, ...]:
    """'0.1,0.25' -> (0.1, 0.25); ValueError for anything but non-negative finite numbers."""
    try:
        thetas = tuple(float(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"--neurons takes thresholds separated by commas (e.g. 0.1,0.25), got {text!r}") from None
    if not all(0.0 <= x < float("inf") for x in thetas):
        raise ValueError(f"neuron thresholds must be finite and non-negative, got {text!r}")
    return thetas


def check_arch(model_path: str | os.PathLike, arch: str) -> None:
    """HobbitError unless the model's experts are SwiGLU (CORM's act(W1 x) is SiLU's)."""
    if arch not in SILU_ARCHS:
        raise HobbitError(f"{model_path}: neuron statistics are for SwiGLU experts (SiLU on W1); "
                          f"{arch} is not one of {', '.join(SILU_ARCHS)}")


class GateWeights:
    """Every MoE layer's W1 (ffn_gate_exps) in float32, [n_expert, n_ff, n_embd], by MoE layer
    index; dequantized when asked for, one layer at a time (an inflated model's take 134-400 MB
    a layer in float32)."""

    def __init__(self, model_path: str | os.PathLike, moe_layers: int):
        from gguf import GGUFReader

        by_layer = {}
        for t in (t for part in model_parts(model_path) for t in GGUFReader(part).tensors):
            parts = t.name.split(".")
            if len(parts) == 4 and parts[0] == "blk" and parts[2] == "ffn_gate_exps":
                by_layer[int(parts[1])] = t
        if len(by_layer) != moe_layers:
            raise HobbitError(f"{model_path}: neuron statistics need a separate gate projection (ffn_gate_exps) in "
                              f"every MoE layer; found {len(by_layer)} of {moe_layers}")
        self._tensors = [by_layer[il] for il in sorted(by_layer)]
        self.n_ff = int(self._tensors[0].shape[1])

    def __len__(self) -> int:
        return len(self._tensors)

    def __getitem__(self, layer: int) -> np.ndarray:
        from gguf.quants import dequantize

        t = self._tensors[layer]
        n_embd, n_ff, n_expert = (int(x) for x in t.shape)  # ggml order
        return dequantize(t.data, t.tensor_type).astype(np.float32, copy=False).reshape(n_expert, n_ff, n_embd)


def _silu(z: np.ndarray) -> np.ndarray:
    return z / (1.0 + np.exp(-z))


def neuron_stats(trace: Trace, inputs: np.ndarray, gates, thetas: tuple[float, ...]) -> NeuronStats:
    """The statistics of every selection in the trace. inputs: float32 [tokens, moe_layers,
    n_embd], each MoE layer's router input (the experts' input); gates: GateWeights(...) or a
    list of its arrays."""
    check_arch(trace.meta["model"], trace.meta["arch"])
    n, L, k = trace.experts.shape
    th = np.asarray(thetas, np.float32)
    shape = (n, L, k, len(th))
    active = np.full(shape, np.nan, np.float32)
    predicted = np.full(shape, np.nan, np.float32)
    recall = np.full(shape, np.nan, np.float32)
    n_ff = gates.n_ff if isinstance(gates, GateWeights) else gates[0].shape[1]
    pack = lambda m: np.packbits(m.transpose(0, 2, 1), axis=-1, bitorder="little")  # noqa: E731 - [sel, n_ff, θ] -> bits
    active_bits = np.zeros((*shape, (n_ff + 7) // 8), np.uint8)
    predicted_bits = np.zeros_like(active_bits)
    for l in range(L):
        w = gates[l]
        for e in range(w.shape[0]):
            rows, slots = np.nonzero(trace.experts[:, l, :] == e)
            if rows.size == 0:
                continue
            act = np.abs(_silu(inputs[rows, l] @ w[e].T))  # [selections, n_ff]
            is_active = act[:, :, None] > th                # [selections, n_ff, n_theta]
            n_active = is_active.sum(axis=1)
            active[rows, l, slots] = n_active / w.shape[1]
            active_bits[rows, l, slots] = pack(is_active)
            if l == 0:  # nothing comes before the first MoE layer to predict it from: whole
                predicted_bits[rows, l, slots] = pack(np.ones_like(is_active))
                continue
            guess = np.abs(_silu(inputs[rows, l - 1] @ w[e].T))[:, :, None] > th
            predicted[rows, l, slots] = guess.sum(axis=1) / w.shape[1]
            predicted_bits[rows, l, slots] = pack(guess)
            hit = (guess & is_active).sum(axis=1)
            with np.errstate(invalid="ignore", divide="ignore"):
                recall[rows, l, slots] = np.where(n_active > 0, hit / np.maximum(n_active, 1), np.nan)
    f16 = lambda a: a.astype(np.float16)  # noqa: E731 - shares to three digits are plenty
    return NeuronStats(th, f16(active), f16(predicted), f16(recall), active_bits, predicted_bits)


def read_share(predicted: np.ndarray, limit: float = NEURON_LIMIT_CORM) -> np.ndarray:
    """The share of an expert's bytes CORM reads for a predicted share: the predicted
    neurons, or the whole expert above the limit (nothing for the cache: a cold read)."""
    return np.where(predicted > limit, 1.0, predicted)


def summary_rows(stats: NeuronStats) -> list[dict]:
    """Per threshold and MoE layer (and 'all'): mean active share, predicted share, recall,
    and the share of an expert's bytes a cold read takes (read_share)."""
    rows = []
    L = stats.active.shape[1]
    for j, theta in enumerate(stats.thetas.tolist()):
        for l in [*range(L), None]:
            sl = (slice(None), slice(None) if l is None else l, slice(None), j)
            a = stats.active[sl].astype(np.float32)
            p = stats.predicted[sl].astype(np.float32)
            r = stats.recall[sl].astype(np.float32)
            rows.append({"theta": theta, "layer": "all" if l is None else l,
                         "active": float(np.nanmean(a)) if np.isfinite(a).any() else float("nan"),
                         "predicted": float(np.nanmean(p)) if np.isfinite(p).any() else float("nan"),
                         "recall": float(np.nanmean(r)) if np.isfinite(r).any() else float("nan"),
                         "read": float(np.nanmean(read_share(p))) if np.isfinite(p).any() else float("nan")})
    return rows


def format_summary(stats: NeuronStats) -> str:
    """The summary as a text table: one line per threshold, the layers side by side."""
    rows = summary_rows(stats)
    L = stats.active.shape[1]
    head = "  theta  measure    " + " ".join(f"{'L' + str(l):>6}" for l in range(L)) + f" {'all':>6}"
    lines = [head]
    for theta in stats.thetas.tolist():
        mine = [r for r in rows if r["theta"] == theta]
        for key, label in (("active", "active"), ("predicted", "predicted"), ("recall", "recall"), ("read", "read")):
            vals = " ".join(f"{r[key]:6.3f}" if np.isfinite(r[key]) else f"{'-':>6}" for r in mine)
            lines.append(f"  {theta:<6g} {label:<10} {vals}")
    return "\n".join(lines)
