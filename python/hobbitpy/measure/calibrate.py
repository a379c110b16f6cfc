"""`hobbitpy calibrate`: HOBBIT's settings for one model, measured rather than guessed.

1. Record a routing trace on prompts cut from the text (what the routers choose, with
   their gate weights).
2. Thresholds: the eq. 2 score of every selection in the trace gives, for a share q of
   selections, the threshold above which that share lies. Perplexity on the text is
   measured token by token (n_ubatch 1, hits served at exactly the wanted precision, so
   the rule alone decides) for shares served at low precision, and for shares skipped.
   T1 is the largest low share, T2 then the largest skipped share, whose perplexity
   stays within the budget of the all-high run (stock llama.cpp).
3. Policy: the eq. 3 weights (LRU, LFU, LHU, FLD) on a grid over the simplex, replayed
   through the cache simulator at several budgets with the chosen T1 (a low-precision
   miss costs its bytes relative to a high one); the lowest mean miss penalty relative
   to Belady's wins.
4. A profile next to the model that `hobbitpy run` applies by itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field
import itertools
import os

import numpy as np

from ..settings.config import MB, OffloadConfig
from .evaluate import evaluate
from ..files.model_file import inspect_model
from ..plan.profile import Profile, profile_path
from ..analysis.scores import selection_scores, threshold_for_share
from ..analysis.simulate import simulate
from .trace import record_trace
from ..files.trace_file import Trace

LOW_SHARES = (0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.35, 0.4, 0.45, 0.5)
SKIP_SHARES = (0.01, 0.02, 0.03, 0.05, 0.1)
FIGURE_SHARES = (0.1, 0.2, 0.3, 0.4)          # HOBBIT Fig. 3b: skip vs low-precision replacement
POLICY_BUDGETS = (0.25, 0.5, 0.75)            # shares of all experts the simulated cache holds
WEIGHT_STEP = 0.1


def prompts_from_text(text: str, n_prompts: int = 24, n_words: int = 48) -> list[str]:
    """Prompts for the trace: the first n_words of the text's longer lines, spread over the text."""
    lines = [line.strip() for line in text.splitlines() if len(line.split()) >= 8]
    if not lines:
        raise ValueError("the text has no line of 8 words or more to use as a prompt")
    step = max(1, len(lines) // n_prompts)
    return [" ".join(line.split()[:n_words]) for line in lines[::step][:n_prompts]]


@dataclass
class CalibrationResult:
    profile: Profile
    reference_perplexity: float
    sweep: list[dict] = field(default_factory=list)    # every threshold setting measured
    policies: list[dict] = field(default_factory=list)  # the named policies and the calibrated one, per budget


def _simplex(step: float):
    n = round(1 / step)
    for a, b, c in itertools.product(range(n + 1), repeat=3):
        if a + b + c <= n:
            yield (a * step, b * step, c * step, (n - a - b - c) * step)


def search_policy_weights(trace: Trace, high_precision: np.ndarray, low_miss_cost: float,
                          budget_shares=POLICY_BUDGETS, step: float = WEIGHT_STEP):
    """The eq. 3 weights with the lowest mean miss penalty relative to Belady's over the
    budgets; returns (weights, rows) with rows comparing the named policies and them."""
    total_mb = trace.meta["expert_bytes_total"] / MB
    budgets = [share * total_mb for share in budget_shares]

    def penalty(policy, weights=(0.25, 0.25, 0.25, 0.25)):
        return [simulate(trace, b, policy, weights=weights, high_precision=high_precision,
                         low_miss_cost=low_miss_cost).miss_penalty for b in budgets]

    belady = penalty("belady")

    def relative(pen):
        return float(np.mean([p / max(bp, 1e-9) for p, bp in zip(pen, belady)]))

    best = min(_simplex(step), key=lambda w: relative(penalty("weighted", w)))
    rows = []
    for name, policy, weights in (("lru", "lru", None), ("lfu", "lfu", None), ("lhu", "lhu", None),
                                  ("fld", "fld", None), ("random", "random", None),
                                  ("hobbit (calibrated)", "weighted", best)):
        pen = penalty(policy, weights or (0.25, 0.25, 0.25, 0.25))
        rows.append({"policy": name, "weights": list(weights) if weights else None,
                     "miss_penalty": pen, "ratio_to_belady": [p / max(bp, 1e-9) for p, bp in zip(pen, belady)]})
    rows.append({"policy": "belady", "weights": None, "miss_penalty": belady, "ratio_to_belady": [1.0] * len(belady)})
    return best, rows, budgets


def calibrate(model_path: str | os.PathLike, text: str, *, low: str = "Q2_K", low_path: str,
              max_ppl_increase: float = 0.01, max_tokens: int = 2048, n_ctx: int = 256, n_threads: int | None = None,
              trace: Trace | None = None, log=print) -> CalibrationResult:
    """Measure T1, T2 and the eq. 3 weights for a model; low_path: its low-precision
    companion file (low: how the profile names it, a type or that path)."""
    model_path = os.fspath(model_path)
    info = inspect_model(model_path)
    low_info = inspect_model(low_path)
    if trace is None:
        log(f"recording a routing trace on {len(prompts_from_text(text))} prompts from the text")
        trace = record_trace(model_path, prompts_from_text(text), n_predict=32, n_threads=n_threads)
    scores = selection_scores(trace.weights)

    # with exact hits the output does not depend on what is cached: the smallest cache will do
    cache_mb = 2 * (info.min_budget_bytes + low_info.min_budget_bytes) / MB

    def measure(t1: float, t2: float) -> float:
        config = OffloadConfig(cache_mb=cache_mb, low=low_path, t1=t1, t2=t2, hits="exact")
        return evaluate(model_path, text, config, n_ctx=n_ctx, n_ubatch=1, max_tokens=max_tokens,
                        compare_to_reference=False, n_threads=n_threads).perplexity

    reference = evaluate(model_path, text, OffloadConfig(enabled=False), n_ctx=n_ctx, n_ubatch=1,
                         max_tokens=max_tokens, compare_to_reference=False, n_threads=n_threads).perplexity
    limit = reference * (1 + max_ppl_increase)
    log(f"all-high perplexity {reference:.4f} on {max_tokens} tokens; budget {limit:.4f} (+{max_ppl_increase:.1%})")

    sweep = []

    def record(kind: str, share: float, t1: float, t2: float) -> float:
        ppl = measure(t1, t2)
        low_share = float(((scores > t1) & (scores <= t2)).mean())
        skip_share = float((scores > t2).mean())
        sweep.append({"kind": kind, "target_share": share, "t1": t1, "t2": t2, "low_share": low_share,
                      "skip_share": skip_share, "perplexity": ppl, "increase": ppl / reference - 1})
        log(f"  {kind:<5} {share:4.0%}  t1 {t1:.3f} t2 {t2:.3f}  low {low_share:5.1%} skip {skip_share:5.1%}  "
            f"perplexity {ppl:.4f} ({ppl / reference - 1:+.2%})")
        return ppl

    max_share = float((scores > 0).mean())  # the first expert of each token is always high
    t1 = 1.0
    for share in LOW_SHARES:
        if share > max_share:
            break
        t = threshold_for_share(scores, share)
        if record("low", share, t, 1.0) <= limit:
            t1 = t
        elif share not in FIGURE_SHARES:
            break
    for share in FIGURE_SHARES:
        if share <= max_share:
            t = threshold_for_share(scores, share)
            record("skip", share, t, t)
    t2 = 1.0
    for share in SKIP_SHARES:
        t = max(threshold_for_share(scores, share), t1)
        if record("both", share, t1, t) <= limit:
            t2 = t
        else:
            break

    log("searching the eq. 3 weights with the cache simulator")
    low_miss_cost = low_info.expert_bytes / info.expert_bytes
    weights, policies, budgets = search_policy_weights(trace, (scores <= t1).astype(np.uint8), low_miss_cost)
    chosen = next((s for s in sweep if s["t1"] == t1 and s["t2"] == t2), None)
    profile = Profile(
        model=os.path.basename(model_path), model_bytes=info.file_bytes,
        settings={"low": low, "t1": t1, "t2": t2, "policy": "hobbit", "policy_weights": list(weights)},
        calibration={"text_tokens": max_tokens, "max_ppl_increase": max_ppl_increase,
                     "reference_perplexity": reference, "perplexity": chosen["perplexity"] if chosen else reference,
                     "low_share": float(((scores > t1) & (scores <= t2)).mean()), "skip_share": float((scores > t2).mean()),
                     "sweep": sweep, "policy_budgets_mb": budgets, "low_miss_cost": low_miss_cost,
                     "policies": policies, "trace_tokens": trace.n_tokens})
    return CalibrationResult(profile=profile, reference_perplexity=reference, sweep=sweep, policies=policies)


__all__ = ["calibrate", "selection_scores", "threshold_for_share", "prompts_from_text", "profile_path"]
