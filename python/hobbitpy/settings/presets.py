"""Presets: every knob of one paper's method under one name (`--preset`, `Llama(preset=...)`),
so the seed systems run side by side on the same runtime. A preset lies under the flags and
keywords given with it (they win) and replaces the profile next to the model (a profile
named explicitly lies under it). What a paper has and the runtime does not yet is said in
the preset's description, not pretended."""

from __future__ import annotations

from dataclasses import dataclass

from .config import NEURON_LIMIT_CORM, PREFETCH_WIDTH_FATE


# Fate's popularity-aware hybrid quantization (§4.5): a Q2_K copy (its INT2) in a small pool for a
# prompt's least popular experts, a fifth of the prompt's selections (searched on ref-deepseek:
# 0.2 cost +0.25 % perplexity and took the 512-token TTFT to 0.55x one-precision Fate's; 0.4 was no
# faster); decode wants the model's own experts (T1 = T2 = 1) and is served exactly them, so the
# low pool is sized for the prompts (two layers' share, at most 15 % of the budget: hobbit.h's
# HOBBIT_PROMPT_LOW_MAX_SHARE) and the rest is decode's. Without these the preset is exact.
FATE_LOW_SHARE = {"low": "Q2_K", "prefill_low_share": 0.2, "t1": 1.0, "t2": 1.0, "hits": "exact", "warm": False}


@dataclass(frozen=True)
class Preset:
    settings: dict
    what: str


PRESETS: dict[str, Preset] = {
    "lru": Preset({"policy": "lru", "prefetch_layers": 0},
                  "what every paper compares against: misses loaded on demand, the least recently used evicted"),
    "hobbit": Preset({"low": "Q2_K", "policy": "hobbit", "prefetch_layers": 2},
                     "HOBBIT: a Q2_K copy of every expert for the less important misses (T1/T2, eq. 2), the "
                     "multidimensional policy (eq. 3), adaptive prefetch two layers ahead (§3.3)"),
    "fate": Preset({"policy": "arc", "prefetch_layers": 1, "prefetch_width": PREFETCH_WIDTH_FATE, "shallow_layers": 1,
                    "prefill_order": "popularity", **FATE_LOW_SHARE},
                   "Fate: the next layer's gate on this layer's input with a widened candidate set (§4.3); a pool "
                   "per layer, the first MoE layer (which nothing predicts) whole, ARC per layer (§4.4; one shared pool "
                   "where the budget holds less than every layer's top-k); a prompt "
                   "loads the next layer's experts most popular first, by the same gate, and reads the least popular, "
                   "a fifth of its selections, from a Q2_K copy (§4.5's INT2 share; lossy for prompts: +0.25 to "
                   "+0.28 % perplexity under caps on ref-deepseek, docs/BENCHMARKS.md at 5f63b2a; "
                   "needs `hobbitpy prepare MODEL "
                   "--low Q2_K`); "
                   "decode reads the model's own experts only, as Fate transfers INT4 only"),
    "importance": Preset({"substitute_alpha": 0.3, "prefetch_layers": 1, "policy": "score"},
                         "importance-driven scheduling: a low-score selection that misses is served by a cached "
                         "expert of similar score (Algorithm 1, alpha 0.3 as its Table 3's middle setting; lossy); "
                         "the next layer's predicted top-score experts prefetched, the low-score ones not (§5.2); "
                         "the expert with the lowest recent router scores, selected or not, evicted, the current "
                         "layer's pinned (§5.3); in a decode batch (beams) an expert another token selects counts as "
                         "cached (Algorithm 2's batch rule). Misses are loaded: Algorithm 2's CPU/load split is "
                         "--mode balanced, measured at 0.48-0.68x --mode auto's decode where both sides read one disk "
                         "(docs/BENCHMARKS.md at 5f63b2a)"),
    "fiddler": Preset({"policy": "popularity", "prefetch_layers": 0},
                      "Fiddler: the experts a profile of calibration text selects most (--popularity TRACE, which "
                      "this preset needs) are loaded at start and kept for the session, the least popular evicted "
                      "(§3). Its CPU computes the misses from CPU memory; where the slow tier is a disk, computing "
                      "in place means faulting the expert in (measured slower than loading it, "
                      "docs/BENCHMARKS.md at 5f63b2a), "
                      "so misses are loaded: --mode cooperative computes them in place, --mode auto decides by the "
                      "latency model (its Algorithm 1). Its beam case: Llama(n_seq_max=W).beam_search, `bench "
                      "--beams W`"),
    "corm": Preset({"neurons": 0.25, "neuron_limit": NEURON_LIMIT_CORM, "prefetch_layers": 1},
                   "CORM: a selected expert's neurons whose |SiLU(W1 x')| is below 0.25 (its θ for Mixtral, Fig. 10) "
                   "add nothing, x' the previous MoE layer's input (its prediction one layer ahead through the "
                   "layer's own W1, §4.2), the whole expert above 75 % kept (Fig. 9); the next layer's experts "
                   "predicted by its gate on this layer's input and prefetched (§4.2). Lossy. Experts are read and "
                   "multiplied whole unless --neuron-layout FILE (`prepare --neuron-layout`) is given too: then "
                   "neuron by neuron, W1 first (the gate whole, then the kept neurons' rows, exact activations "
                   "instead of the prediction), into a neuron cache whose budget counts rows (§3.5); its "
                   "expert-granularity mixed quantization is --placed TRACE --low Q2_K (by gate weight, not by "
                   "frequency)"),
}


def preset_settings(name: str) -> dict:
    """The settings of a preset; ValueError naming the presets for another name."""
    if name not in PRESETS:
        raise ValueError(f"no preset is named {name!r}; the presets are: {', '.join(PRESETS)}")
    return dict(PRESETS[name].settings)


def presets_table() -> str:
    """Every preset as a Markdown table (the end of docs/OPTIONS.md; a test keeps them equal)."""
    rows = ["| preset (`--preset`, `Llama(preset=...)`) | settings | what it is |", "|---|---|---|"]
    for name, p in PRESETS.items():
        settings = ", ".join(f"`{k}={v}`" for k, v in p.settings.items())
        rows.append(f"| `{name}` | {settings} | {p.what} |")
    return "\n".join(rows) + "\n"
