"""The configuration `run`, `serve` and `hobbitpy.Llama(MODEL)` choose by themselves when a
model's experts do not all fit in memory and nothing else was asked for.

Served at one precision, the experts that do not fit are read from the disk, token after
token: exact, and as slow as the disk. The frontier measured on the reference models
(docs/BENCHMARKS.md at 5f63b2a) is elsewhere: the experts that lose most at a low-precision copy
at the model's own precision and the rest from the copy (placement.py, HOBBIT's premise placed
once; what an expert loses: the routers' weight on it times the squared error the copy's
rounding adds to its outputs for its inputs, rounding_error.py), every expert in memory where the copy fits, else the copy read through the expert
cache in fewer bytes than the model's own experts. Whether that ladder costs too much is
measured, not guessed, on a text that ships with hobbitpy (data/calibration.txt: prose,
dialogue, code, arithmetic, three languages, scripture):

- one batched run of the model's own experts over the text gives how much the routers weigh
  each expert (kept next to the model, MODEL.hobbit-importance.json) and its next-token
  distributions (kept for the run, in a temporary file); once a copy is at hand and a ladder
  over it with some experts at the model's precision is to be measured, a stock pass over the
  same windows gives the experts' mean squared inputs (an importance matrix), with which the
  copy's rounding error is priced expert by expert (kept beside the verdicts, per low type; where
  every expert of the ladders is at the copy, the order they would be raised in changes nothing,
  and neither pass is made);
- the low copy is `prepare`'s Q2_K companion next to the model, made on first use (a
  progress bar; the disk it needs checked and said first; never with `--no-prepare`);
- the ladder the memory allows, less a slack (VERDICT_SLACK_SHARE), is run over the same text
  (beyond the limit, so is every ladder with fewer experts at the model's precision, and it is
  taken for the budget's own, a slack above it, and for up to a slack above that: a later run
  finding less memory, as much, or up to a slack more measures nothing, unless it finds more than
  a slack less and the verdict would send it to the next type: the verdict only bounds its ladder's
  divergence from below, and whether that is too far for the next type is measured
  (_only_bounds); within, so is every
  ladder with more: runs under the same memory find a MB or two more or less than one another,
  and a later one finding up to a slack less measures nothing; one finding less than that
  measures its own, unless every expert at the copy is within); where it measured beyond by less
  than SLACK_GAIN times the limit, the ladder half a slack below is measured, and where that is
  beyond too the budget's own (the experts the slack moved to the copy may be the difference:
  _priced_steps), once for the budget;
  a ladder is served when its next-token distributions are within MAX_MEAN_KL of the model's (then the
  ladder with every expert at the low copy is measured too: within, no expert is kept at the
  model's precision; every expert at the copy is not measured first, as it would settle every
  ladder only where it is within, and a real model's uniform Q2_K is 0.06-0.11 nats from it);
- else the same over a Q3_K copy (a third more bytes a low expert, a third of Q2_K's
  divergence: on ref-mixtral at Q4_K_M, at 0.75 of the experts' bytes, the Q2_K ladder measured
  0.012 nats and the Q3_K ladder 0.0079, reading a quarter of what the model's own experts
  read; docs/BENCHMARKS.md) unless the Q2_K ladder measured so far beyond the limit that a
  Q3_K copy cannot bring it within (NEXT_TYPE_GAIN: at real size the copy and its measurement
  take tens of minutes);
- where the ladder over the last type tried is beyond too (or the next type's copy can be
  neither found nor made: no room on the disk, `--no-prepare`) and the expert cache leaves enough
  of the routers' weight to the disk (DYNAMIC_MIN_MISSED: else the model's own experts decode
  faster), HOBBIT's dynamic precision over its copy (DYNAMIC): the model's own experts for
  every hit, the copy only for a miss a token weighs less, a miss it weighs least skipped, the
  next layer's predicted experts read ahead
  (DYNAMIC_PREFETCH_LAYERS). Its thresholds are searched (DYNAMIC_THRESHOLDS, the
  fewest bytes a token first: the first within the limit is served). Each divergence is measured
  once for every memory, with every selection the rule sends low served low and every one it
  skips skipped whatever the cache holds (a prompt served level by level, as decode serves it):
  what dynamic precision serves, or worse. Ladders first: where their copy fits in memory they
  read nothing, while dynamic precision reads every miss (a token's less weighed ones in the
  copy's fewer bytes);
- else the model's own experts (a copy made for nothing is removed).
  Dynamic precision and the model's own experts are served through an expert cache that keeps
  the experts selected most (CACHE_POLICY: LFU, aged, the calibration's importance its prior and
  the order it is warmed in), where the calibration is at hand.
  The divergence, not the perplexity, decides: it is the perplexity increase to
  expect on text the model predicts well, and it does not hide behind a text the model
  predicts badly (on the KJV-trained ref-mixtral, Q2_K for every expert measured -1.1 %
  perplexity on the calibration text and +4.6 % on held-out scripture; its divergence was
  0.038 nats). What was measured is kept with the importance, per low type: a later run
  whose memory allows at least as many experts at the model's precision as a ladder found
  within reuses the verdict, as does one whose memory less the slack allows at most as many as
  a ladder found beyond, or at most a slack more than the budget that ladder was priced for.
  The line served says which ladder was measured where it is not the one served.
  A measurement stops once the KL summed over the tokens run exceeds, spread over the whole
  text, the mean that decides: KL is never negative, so the rest of the text could not change
  the decision. It is checked after each window and after the first quarter of the first (at
  real size each window, and that quarter, is a pass through every expert, and a window's
  tokens are most of its compute: a ladder far beyond the limit costs a quarter of a window).

Otherwise, or with `--exact`, a preset, a profile, an expert cache size (`--cache-mb`) or a
precision level asked for, the experts are served at the model's own precision: stock's
logits bit for bit. One line always says which and why.
"""

from __future__ import annotations

from collections.abc import Callable
import dataclasses
from dataclasses import dataclass
import functools
import hashlib
import importlib.resources
import json
import logging
import math
import os
import pathlib

import numpy as np

from ..settings.config import DEFAULT_T1, DEFAULT_T2, MAX_MEAN_KL, MB, OffloadConfig
from ..system.disk import drop_from_page_cache
from ..errors import BudgetError, HobbitError, ModelFileError
from ..analysis.likelihood import Comparison, Reference, scoring_bytes
from ..plan.memory import (ContextShape, available_memory_bytes, context_sizes, fit_ubatch, plan_offload,
                           return_freed_memory)
from ..files.model_file import ModelInfo, layer_expert_bytes, model_parts
from ..system.outputs import NotEnoughSpaceError, check_free_space, partial_output, replace
from ..plan.placement import expected_error, place_by_importance
from ..copies.companions import copy_layer_bytes, default_companion_path, estimated_copy
from ..copies.prepare import prepare_companion
from ..copies.imatrix import expert_input_power
from ..copies.rounding_error import rounding_error

log = logging.getLogger("hobbitpy")


def quiet() -> bool:
    """Notes' progress bars off: the notes' logger set to errors only (-q)."""
    return log.level >= logging.ERROR


# the low copies the default's ladders are placed over, tried in this order (the fewest bytes a
# low expert first: the faster ladder where both are within the limit); Q2_K is the type
# `prepare` writes at disk speed, Q3_K goes through ggml's quantizer
LOW_TYPES = ("Q2_K", "Q3_K")
LOW_TYPE = LOW_TYPES[0]
# the most a copy of the next low type divides the divergence of the one before: Q2_K over Q3_K
# mean KL measured 2.7, 3.5 and 3.7 for the uniform quants of the evidence models and 2.4 for the
# all-low ladders of the real-size one on the calibration text (0.139 and 0.0585 nats;
# docs/BENCHMARKS.md); a ladder beyond this many times the limit leaves the next type no chance
NEXT_TYPE_GAIN = 4.0
# the calibration passes: prompts of at most this many tokens, at most CALIBRATION_TOKENS in
# all (at real size each pass reads every expert once: two passes of 512 tokens)
CALIBRATION_CTX = 512
CALIBRATION_TOKENS = 1024
IMPORTANCE_VERSION = 3
# HOBBIT's dynamic precision (§3.2), tried over a low copy where the ladder memory allows over it
# measures beyond the limit: the model's own experts for every hit, the copy for a miss whose eq. 2
# score is above T1 (a token's less weighed experts), a miss whose score is above T2 skipped (the
# least weighed: nothing read); the low pool small, since what it holds serves only the selections
# that want it low (on the hardened Mixtral-depth model, docs/BENCHMARKS.md: a fifth fewer bytes
# read than the exact default at 45 % of its experts cached, 0.003 nats)
DYNAMIC = {"hits": "at-least", "level_shares": (0.95, 0.05), "warm": False}
# ... served with the next layer's predicted experts read during this layer's compute (HOBBIT's
# prefetch, one layer deep), unless the user chose a depth: on the real-size hardened Mixtral under
# 12 GiB the reads then overlap the compute (time over bound 0.90 -> 0.74) and it decodes 1.15x
# faster for 5 % more bytes read, two layers deep 1.06x (docs/BENCHMARKS.md). Not priced apart: it
# changes only what the cache holds, and DYNAMIC_PRICED's price holds whatever the cache holds
DYNAMIC_PREFETCH_LAYERS = 1
# ... tried only where the expert cache, holding the experts the calibration weighs most at the
# model's precision, leaves at least this share of the routers' weight to the disk: with fewer
# misses the model's own experts (CACHE_POLICY, warmed) decode faster, dynamic precision's second
# pass a layer and its low pool costing more than its reads save. On the real-size hardened Mixtral,
# one invocation under 12/16/20 GiB and another with no cap (docs/BENCHMARKS.md): 22 % and 12 % of
# the weight left, dynamic precision over Q2_K decoded 1.48x and 1.25x the model's own experts;
# 4 % and 1 % left, 0.97x and 0.88x. Even near 5 %: there the lossless choice is kept. Measured on
# this VM's disk (1.1-1.6 GB/s) and 2 cores: a faster disk makes misses cheaper and moves the line up
DYNAMIC_MIN_MISSED = 0.07
# its thresholds (T1, T2), the fewest bytes a token first: each sends low or skips every selection
# the next one does, and more. Every selection but a token's first from the copy; HOBBIT's own values
# for Mixtral-8x7B (§3.2: a missed expert under a tenth of the weight skipped); those without skips.
# Replayed through the runtime's cache on the hardened Mixtral's held-out routing (120 of its 256
# experts cached), they read 1.88, 2.03 and 2.29 GB a token; on its calibration text the first measured
# 0.0123 nats (beyond), HOBBIT's 0.0071
DYNAMIC_THRESHOLDS = ((0.5, DEFAULT_T2), (DEFAULT_T1, DEFAULT_T2), (DEFAULT_T1, 1.0))
# ... priced with hits "exact": every selection the rule sends low served low and every one it skips
# skipped, whatever the cache holds (a prompt served level by level, as decode serves it): what
# "at-least" serves or worse (a cached copy at the model's precision serves a selection that wants
# it low or skipped), whatever the memory
DYNAMIC_PRICED = {**DYNAMIC, "hits": "exact", "level_shares": None, "skip_cached": True}


def dynamic_settings(t1: float, t2: float, priced: bool = False) -> dict:
    """The OffloadConfig fields of dynamic precision at these thresholds beside its low copy: as
    it is served (DYNAMIC), or as it is measured (DYNAMIC_PRICED), which it serves no worse."""
    return {**(DYNAMIC_PRICED if priced else DYNAMIC), "t1": t1, "t2": t2}


# the memory by which runs under the same limit differ (the heap a pass leaves, the page cache's
# accounting: a MB or two on the small models, one expert at the model's precision more or less),
# with room to spare: a fiftieth of the ladder's bytes, at least two experts at the model's
# precision. A ladder is priced this much below the budget's (_choose).
VERDICT_SLACK_SHARE = 1 / 50
VERDICT_SLACK_EXPERTS = 2
# the most the experts a slack moves to the copy are taken to multiply a ladder's divergence by: a
# ladder priced below a budget's that measures more than this many times the limit leaves the
# budget's own beyond too, unmeasured (on the real-size hardened Mixtral with no cap half a slack's
# five experts at the model's precision more halved it: 0.0123 nats, 0.0067)
SLACK_GAIN = 4.0
# the policy of the expert cache where the calibration is at hand and no policy was chosen, its
# importance the prior and the order the pools are warmed in: the routers of a trained model favour
# some experts, and these stay (on the hardened Mixtral-depth model's held-out text 120 slots for
# its 256 experts hit 0.60 of its selections, LRU's 0.50; at real size the model's own experts
# decoded 1.28x as fast as through an LRU cache under 12 GiB, 1.05x under 8 GiB and 1.30x with
# no cap; docs/BENCHMARKS.md). Which experts are cached never changes what a selection is served
# at (dynamic precision is priced with every selection the rule sends low served low): the price
# holds, and the model's own experts give stock's logits whatever the policy. `--exact` and
# `--cache-mb` runs take it too (with_kept_prior)
CACHE_POLICY = "frequency"


@dataclass(frozen=True)
class Priced:
    """A ladder measured on the calibration text."""

    n_high: int           # experts at the model's precision (dynamic: -1, every expert can be either)
    mean_kl: float        # from the model's next-token distributions, nats a token
    ppl_increase: float   # on the calibration text (shown, not decided on)
    low: str = LOW_TYPE   # the low copy's type
    dynamic: bool = False  # HOBBIT's dynamic precision (DYNAMIC), not a ladder
    # the measurement stopped once the calibration text could no longer end within what decides
    # (likelihood.compare_to_reference's stop_beyond): mean_kl is the least the whole text measures
    at_least: bool = False
    # dynamic precision's thresholds (DYNAMIC_THRESHOLDS); a ladder has none
    t1: float | None = None
    t2: float | None = None
    # a ladder priced for a budget (a slack below its own, half a slack, or its own: _priced_steps):
    # that budget's experts at the model's precision; None where it was measured for itself (every
    # expert at the copy, dynamic precision)
    stands_for: int | None = None

    @property
    def within(self) -> bool:
        return self.mean_kl <= MAX_MEAN_KL


@dataclass(frozen=True)
class Calibration:
    """What the model's own experts measured on the calibration text, and the ladders priced on it."""

    importance: np.ndarray  # [moe_layers][n_expert]: the routers' squared gate weights (placement.importance_of)
    n_tokens: int           # tokens evaluated
    ladders: tuple[Priced, ...] = ()  # by low type, fewest experts at the model's precision first
    # by low type, [moe_layers][n_expert]: the squared error that type's copy adds to each expert's
    # outputs (rounding_error.py), priced once its copy is at hand (1 for every expert where the
    # experts' inputs could not be measured: they are taken to lose alike)
    rounding_error: dict[str, np.ndarray] = dataclasses.field(default_factory=dict, compare=False)
    # the model's next-token distributions, which a ladder is compared with (this process only)
    reference: Reference | None = dataclasses.field(default=None, compare=False)

    def order(self, low: str = LOW_TYPE) -> np.ndarray:
        """[moe_layers][n_expert]: the order a ladder over that low type raises experts to the
        model's precision in (placement.expected_error): the routers' weight times what the
        copy loses, where that is priced (the copy at hand), else the routers' weight."""
        error = self.rounding_error.get(low)
        return self.importance if error is None else expected_error(self.importance, error)

    def verdict(self, n_high: int, low: str = LOW_TYPE, n_beyond: int | None = None) -> Priced | None:
        """The measurement that settles a ladder of n_high experts at the model's precision over
        the low copy of that type (more of them never diverge more: a placement raises the most
        weighed first), or None. A measurement beyond the limit settles a ladder with as many as
        it or fewer; given n_beyond (the ladder a slack less memory allows: the one _choose
        prices), one whose n_beyond has as many or fewer; and one priced a slack below a budget's
        own settles every budget up to a slack above that one (runs under the same memory differ
        by an expert or so: erring there serves dynamic precision or the model's own experts,
        never a ladder beyond the limit)."""
        ladders = [p for p in self.ladders if p.low == low and not p.dynamic]
        within = [p for p in ladders if p.n_high <= n_high and p.within]
        beyond = [p for p in ladders if not p.within and (
            p.n_high >= (n_high if n_beyond is None else n_beyond)
            or (p.stands_for is not None and n_high <= 2 * p.stands_for - p.n_high))]
        return within[-1] if within else beyond[0] if beyond else None

    def measured(self, n_high: int, low: str = LOW_TYPE) -> Priced | None:
        """The measurement of the ladder of exactly n_high experts at the model's precision over
        that low type, or None."""
        return next((p for p in self.ladders if p.low == low and not p.dynamic and p.n_high == n_high), None)

    def dynamic_verdict(self, low: str, thresholds: tuple[float, float]) -> Priced | None:
        """The measurement of dynamic precision over the low copy of that type with these
        thresholds (T1, T2; one for every memory), or None."""
        return next((p for p in self.ladders if p.low == low and p.dynamic and (p.t1, p.t2) == thresholds), None)

    def with_rounding_error(self, low: str, error: np.ndarray) -> "Calibration":
        return dataclasses.replace(self, rounding_error=self.rounding_error | {low: error})

    def priced(self, measured: Priced) -> "Calibration":
        def key(p: Priced) -> tuple:
            return p.low, p.dynamic, p.n_high, p.t1 or 0.0, p.t2 or 0.0
        kept = {key(p): p for p in self.ladders} | {key(measured): measured}
        return dataclasses.replace(self, ladders=tuple(kept[k] for k in sorted(kept)))


def applies(config: OffloadConfig) -> bool:
    """Whether the config leaves the choice to the default: offload on, no `--exact`, no
    cache size and nothing that chooses precisions or placement (a preset or a profile
    turns `auto` off)."""
    return (config.enabled and config.auto and config.cache_mb is None and config.high is None
            and config.low is None and config.mid is None and config.importance is None
            and config.popularity is None and config.neurons is None and config.neuron_layout is None
            and config.shallow_layers is None and config.substitute_alpha == 0.0)


def calibration_text() -> str:
    return importlib.resources.files("hobbitpy").joinpath("data/calibration.txt").read_text(encoding="utf-8")


def importance_path(model_path: str | os.PathLike) -> pathlib.Path:
    model = pathlib.Path(model_path)
    return model.with_name(f"{model.stem}.hobbit-importance.json")


def _text_digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def load_calibration(model_path: str | os.PathLike, info: ModelInfo, text: str) -> Calibration | None:
    """The calibration kept next to the model (without the reference), or None when there is
    none for this model file and this text (another file of the same name, another text:
    measured again)."""
    path = importance_path(model_path)
    try:
        data = json.loads(path.read_text())
        if (data.get("version") != IMPORTANCE_VERSION or data.get("model_bytes") != info.file_bytes
                or data.get("text") != _text_digest(text)):
            return None
        ladders = tuple(_kept_priced(p) for p in data["ladders"])
        errors = {str(low): np.array(error, np.float64) for low, error in data.get("rounding_error", {}).items()}
        calibration = Calibration(np.array(data["importance"], np.float64), int(data["n_tokens"]), ladders, errors)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    shape = (info.n_layer_moe, info.n_expert)
    ok = (calibration.importance.shape == shape and all(math.isfinite(p.mean_kl) for p in ladders)
          and all(e.shape == shape and np.all(np.isfinite(e)) for e in errors.values()))
    return calibration if ok else None


def _kept_priced(p: dict) -> Priced:
    """A measurement as kept (one of dynamic precision kept without thresholds was HOBBIT's T1, nothing skipped)."""
    dynamic = bool(p.get("dynamic", False))
    t1, t2 = (float(p.get("t1", DEFAULT_T1)), float(p.get("t2", 1.0))) if dynamic else (None, None)
    stands_for = p.get("stands_for")
    return Priced(int(p["n_high"]), float(p["mean_kl"]), float(p["ppl_increase"]), str(p.get("low", LOW_TYPE)),
                  dynamic, bool(p.get("at_least", False)), t1, t2, None if stands_for is None else int(stands_for))


def kept_importance(importance: np.ndarray) -> list[list[float]]:
    """The importance as it is kept (six significant digits): a run that measured it and one that
    read it back serve the same profile."""
    return [[float(f"{x:.6g}") for x in row] for row in importance.tolist()]


def save_calibration(model_path: str | os.PathLike, info: ModelInfo, text: str,
                     calibration: Calibration) -> pathlib.Path:
    """Write the calibration next to the model (replacing a stale one: it is hobbitpy's own cache)."""
    path = importance_path(model_path)
    data = {"version": IMPORTANCE_VERSION, "model": os.path.basename(model_path), "model_bytes": info.file_bytes,
            "text": _text_digest(text), "n_tokens": calibration.n_tokens,
            "ladders": [dataclasses.asdict(p) for p in calibration.ladders],
            "importance": kept_importance(calibration.importance),
            "rounding_error": {low: kept_importance(error) for low, error in calibration.rounding_error.items()}}
    with partial_output(path) as partial:
        partial.write_text(json.dumps(data) + "\n")
        return replace(partial, path)


def _keep(model_path: str | os.PathLike, info: ModelInfo, text: str, calibration: Calibration) -> None:
    try:
        save_calibration(model_path, info, text, calibration)
    except OSError as e:
        log.info(f"could not keep the calibration next to the model ({e}); it is measured again next time")


@dataclass(frozen=True)
class Failure:
    """A measurement of the ladder that could not be made (no room for it beside the passes'
    arrays, a read that failed, ...), kept so that a later run with no more memory does not
    make the copy and measure again only to fail the same way."""

    budget_bytes: int  # the two-level budget the run had
    why: str
    low: str = LOW_TYPE  # the low copy's type


def _failures(data: dict) -> dict[str, dict]:
    """The failures kept, by low type (one kept before there were several types: Q2_K's)."""
    failed = data.get("failed") or {}
    return {LOW_TYPE: failed} if "budget_bytes" in failed else failed


def remembered_failure(model_path: str | os.PathLike, info: ModelInfo, text: str,
                       low: str = LOW_TYPE) -> Failure | None:
    """The failure of the ladder over that low type kept next to the model for this file and
    this text, if any."""
    try:
        data = json.loads(importance_path(model_path).read_text())
        if data.get("model_bytes") != info.file_bytes or data.get("text") != _text_digest(text):
            return None
        failed = _failures(data).get(low)
        return None if failed is None else Failure(int(failed["budget_bytes"]), str(failed["why"]), low)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def _remember_failure(model_path: str | os.PathLike, info: ModelInfo, text: str, failure: Failure) -> None:
    """Add the failure to what is kept next to the model (the calibration, where one was measured)."""
    path = importance_path(model_path)
    try:
        data = json.loads(path.read_text())
        if data.get("model_bytes") != info.file_bytes or data.get("text") != _text_digest(text):
            raise ValueError("another model's or text's")
    except (OSError, ValueError, AttributeError):
        data = {"version": IMPORTANCE_VERSION, "model": os.path.basename(model_path), "model_bytes": info.file_bytes,
                "text": _text_digest(text)}
    data["failed"] = _failures(data) | {failure.low: {"budget_bytes": failure.budget_bytes, "why": failure.why}}
    try:
        with partial_output(path) as partial:
            partial.write_text(json.dumps(data) + "\n")
            replace(partial, path)
    except OSError as e:
        log.info(f"could not keep the failed measurement next to the model ({e})")


def _release(*paths: str | os.PathLike) -> None:
    """Evict what a measuring pass read of these files: the page cache it leaves is counted as
    used (a cgroup's active file pages), and the run planned after it would get a smaller cache."""
    for path in paths:
        try:
            for part in model_parts(path):
                drop_from_page_cache(part)
        except (OSError, ModelFileError):
            pass


def low_copy_layer_bytes(info: ModelInfo, low: str = LOW_TYPE) -> np.ndarray:
    """[moe_layers]: one expert's bytes in the copy of that type `prepare` will write (0: rows not whole blocks)."""
    return copy_layer_bytes(info, low)


def low_copy_bytes(info: ModelInfo, low: str = LOW_TYPE) -> int:
    """Every expert's bytes in the copy of that type `prepare` will write."""
    return int(low_copy_layer_bytes(info, low).sum()) * info.n_expert


def missed_weight_share(model_layer_bytes: np.ndarray, budget_bytes: int, importance: np.ndarray) -> float:
    """The share of the routers' weight carried by the experts an expert cache of this budget
    cannot hold at the model's precision, the most weighed held first (CACHE_POLICY keeps them):
    what the model's own experts leave to the disk."""
    placement = place_by_importance(importance, [model_layer_bytes, np.zeros_like(model_layer_bytes)], budget_bytes)
    return low_weight_share(importance, placement)


def low_weight_share(importance: np.ndarray, placement: tuple[tuple[int, ...], ...]) -> float:
    """The share of the routers' weight that a placement serves from the lowest level."""
    levels = np.array(placement)
    total = importance.sum()
    return float(importance[levels == levels.max()].sum() / total) if total > 0 and levels.max() > 0 else 0.0


def _exact(why: str) -> str:
    return f"serving the model's own experts (exact): {why}"


def unfit_reason(info: ModelInfo, budget_bytes: int | None, low_type: str = LOW_TYPE) -> str | None:
    """Why no ladder over a copy of that type can be served here, from the bytes alone (None:
    one can; budget_bytes: what two levels would get, None where not even their minimum fits)."""
    low = low_copy_layer_bytes(info, low_type)
    if not low.any():
        return _exact(f"its experts' rows are not whole {low_type} blocks")
    if int(low.sum()) * info.n_expert >= info.expert_bytes_total:
        return _exact(f"a {low_type} copy would be no smaller than its experts")
    if budget_bytes is None:
        return _exact("no room for an expert cache of two precisions")
    return None


def ladder_placement(info: ModelInfo, model_layer_bytes: np.ndarray, budget_bytes: int,
                     importance: np.ndarray, low: str = LOW_TYPE) -> tuple[tuple[tuple[int, ...], ...], int]:
    """The ladder a budget gives over the copy of that type (the level of every expert, 0: the
    model's precision) and how many experts it keeps at the model's precision."""
    placement = place_by_importance(importance, [model_layer_bytes, low_copy_layer_bytes(info, low)], budget_bytes)
    return placement, sum(level == 0 for row in placement for level in row)


def verdict_slack_bytes(info: ModelInfo, placed: int) -> int:
    """How far below the budget's own a ladder is priced (VERDICT_SLACK_SHARE)."""
    return max(int(placed * VERDICT_SLACK_SHARE), VERDICT_SLACK_EXPERTS * info.expert_bytes)


def describe(info: ModelInfo, budget_bytes: int, importance: np.ndarray, placement, verdict: Priced) -> str:
    """The line a served ladder is announced with."""
    low = verdict.low
    low_total = low_copy_bytes(info, low)
    n_experts = info.n_layer_moe * info.n_expert
    n_high = sum(level == 0 for row in placement for level in row)
    where = ("every expert in memory" if budget_bytes >= low_total else
             f"the {low} copy ({low_total / MB:.0f} MB) read through the expert cache ({budget_bytes / MB:.0f} MB)")
    what = (f"every expert from a {low} copy (the fewest bytes a token within the limit)" if n_high == 0 else
            f"the {n_high} of {n_experts} experts that lose most at {low} at the model's precision, the rest "
            f"({100 * low_weight_share(importance, placement):.0f} % of the routers' weight) from a {low} copy")
    return f"{where}: {what}; {_measured(verdict, n_high)} (lossy; --exact serves the model's own experts only)"


def _measured(p: Priced, n_high: int | None = None) -> str:
    """What p measured, said for a ladder of n_high experts at the model's precision (the ladder
    measured named where it has another number of them)."""
    if n_high is not None and n_high != p.n_high:
        return f"with {p.n_high} at the model's precision, {_measured(p)}"
    if p.at_least:
        return (f"on hobbitpy's calibration text at least {p.mean_kl:.4f} nats from the model's next-token "
                f"distributions (at most {MAX_MEAN_KL:g}; stopped once the rest of the text could not bring it "
                f"within), perplexity {100 * p.ppl_increase:+.2f} % on the part measured")
    return (f"on hobbitpy's calibration text {p.mean_kl:.4f} nats from the model's next-token distributions "
            f"(at most {MAX_MEAN_KL:g}), perplexity {100 * p.ppl_increase:+.2f} %")


def _two_level_budget(info: ModelInfo, config: OffloadConfig, shape: ContextShape, available: int,
                      low_info: ModelInfo) -> int | None:
    """The expert cache a run with the low copy would get (None: not even its minimum)."""
    levels = (info, low_info)
    if shape.n_ubatch is None:
        shape = dataclasses.replace(shape, n_ubatch=fit_ubatch(info, shape, config, levels, available))
    try:
        return plan_offload(info, config, context_sizes(info, shape).total, levels, available_bytes=available).budget_bytes
    except BudgetError:
        return None


# measure(text): the model's own experts over the calibration text; score(reference, config,
# stop_beyond): a ladder against them, its last tokens left unscored once its mean KL is sure to
# end beyond stop_beyond (llama.py runs both)
Measure = Callable[[str], Calibration]
Score = Callable[[Reference, OffloadConfig, float], Comparison]


def default_config(info: ModelInfo, config: OffloadConfig, shape: ContextShape, available: int,
                   measure: Measure, score: Score, threads: int) -> tuple[OffloadConfig, str]:
    """The config a run left to the default serves (applies(config) holds, the experts do not
    all fit), and the line saying what and why. Measures and makes what a ladder needs on
    first use: the calibration, the low copy, the ladder's divergence; over each low type in
    turn while the ladder the memory allows measures beyond the limit."""
    beyond: list[str] = []  # the lines of the ladders measured beyond the limit
    measure = _once(measure, importance_path(info.path))  # the model's own experts: once, whatever the types tried
    for low_type, next_type in zip(LOW_TYPES, (*LOW_TYPES[1:], None)):
        served, line, beyond_verdict = _default_over(low_type, next_type, info, config, shape, available, measure, score,
                                                     threads)
        if beyond_verdict is None:
            if line.startswith(_exact("")) and beyond:  # exact for another reason: both said
                line = f"{line}; {'; '.join(beyond)}; {_tune_hint(info)}"
            return served, line
        beyond.append(line.removeprefix(_exact("")))
        if next_type is not None and not _next_type_may_be_within(beyond_verdict):
            # its copy, its measurement (at real size: a quantizer pass over the experts and a pass of the
            # calibration text through them, tens of minutes) would end beyond the limit too
            beyond.append(f"the ladder over {next_type} not tried (a {next_type} copy diverges at least "
                          f"1/{NEXT_TYPE_GAIN:g} as much as a {low_type} one)")
            break
    return dataclasses.replace(config, auto=False), _exact(f"{'; '.join(beyond)}; {_tune_hint(info)}")


def _tune_hint(info: ModelInfo) -> str:
    return f"faster at a perplexity cost you choose: hobbitpy tune {info.path} --text YOUR-TEXT"


def _next_type_may_be_within(beyond: Priced) -> bool:
    """Whether a ladder over the next low type may be within the limit where the one over this type measured beyond."""
    return beyond.mean_kl <= NEXT_TYPE_GAIN * MAX_MEAN_KL


def _decisive_kl(next_type: str | None) -> float:
    """The mean KL beyond which a ladder's measurement decides no differently: where a next type
    may be tried, whether it is (NEXT_TYPE_GAIN times the limit); else the limit. A measurement
    stops once it is sure to end beyond it (at real size each window of the calibration text is a
    pass through every expert: a ladder far beyond is known after the first quarter of the first)."""
    return NEXT_TYPE_GAIN * MAX_MEAN_KL if next_type is not None else MAX_MEAN_KL


def _default_over(low_type: str, next_type: str | None, info: ModelInfo, config: OffloadConfig, shape: ContextShape,
                  available: int, measure: Measure, score: Score, threads: int) -> tuple[OffloadConfig, str, Priced | None]:
    """default_config over the copy of one low type: the config, its line, and the measurement
    of the ladder the memory allows where it is beyond the limit (then the next type may be
    worth trying), else None. Where no next type will be tried, dynamic precision over this
    type's copy is (the ladders first: where their copy fits in memory they read nothing)."""
    exact = dataclasses.replace(config, auto=False)
    model_path = info.path
    low_path = default_companion_path(model_path, low_type)
    low = low_copy_layer_bytes(info, low_type)
    ladder = dataclasses.replace(config, low=low_type, hits="found", auto=False)
    budget = (_two_level_budget(info, ladder, shape, available, estimated_copy(info, low, low_path))
              if low.any() else None)
    why_not = unfit_reason(info, budget, low_type)
    if why_not is not None:
        return exact, why_not, None

    text = calibration_text()
    failure = remembered_failure(model_path, info, text, low_type)
    if failure is not None and budget <= failure.budget_bytes:
        return exact, _exact(f"the ladder over {low_type} could not be measured with as much memory or more "
                             f"({failure.why}; kept in "
                             f"{importance_path(model_path)}: delete it to measure again)"), None
    made: list[pathlib.Path] = []  # the copy _choose makes, named there until it is served
    try:
        return _choose(info, config, exact, ladder, budget, text, measure, score, threads, made, next_type)
    except (HobbitError, OSError) as e:  # a read that failed, the disk, no room for the passes' arrays
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
        _remember_failure(model_path, info, text, Failure(budget, why, low_type))
        return exact, _exact(f"the ladder over {low_type} could not be measured ({why})"), None
    finally:
        for path in made:  # made, and not served (beyond the limit, a failure, an interrupt): made for nothing
            path.unlink(missing_ok=True)


def _choose(info: ModelInfo, config: OffloadConfig, exact: OffloadConfig, ladder: OffloadConfig, budget: int,
            text: str, measure: Measure, score: Score, threads: int, made: list,
            next_type: str | None) -> tuple[OffloadConfig, str, Priced | None]:
    """_default_over's choice once a ladder over ladder.low (a type) fits: measures what is not
    known yet. The copy of the experts it makes is named in `made` until it is served (the
    caller removes it otherwise, whatever ends the choice). The verdict: where beyond the limit."""
    model_path = info.path
    low_type = ladder.low
    low_path = default_companion_path(model_path, low_type)
    calibration = load_calibration(model_path, info, text)
    if calibration is None:
        calibration = _measure(model_path, info, text, measure, calibration)
    model_layer_bytes = layer_expert_bytes(model_path)
    placed = placed_bytes(info, budget, calibration, low_type)
    placement, n_high = ladder_placement(info, model_layer_bytes, placed, calibration.order(low_type), low_type)
    # the ladders priced, in turn while each measures beyond the limit by less than SLACK_GAIN times
    # it (each stopped once sure to be beyond): a slack below the budget's, so that a run finding a
    # little less memory is settled by it within the limit, and beyond by it the budget's own
    # (verdict's n_beyond); then half a slack below, then the budget's own (the experts the slack
    # moved to the copy may be the difference: on the real-size hardened Mixtral with no cap 174
    # experts at the model's precision measured 0.0123 nats, half a slack below the budget's 184,
    # 179, 0.0067)
    steps = _priced_steps(info, model_layer_bytes, placed, calibration.order(low_type), low_type)
    n_priced = steps[0][1]
    verdict = calibration.verdict(n_high, low_type, n_priced)
    if verdict is not None and _only_bounds(info, config, verdict, n_priced, next_type):
        verdict = None  # measured as if none were kept: what it measures decides whether the next type is tried
    todo = steps if verdict is None else _steps_left(calibration, verdict, steps, n_high, low_type)
    if todo:
        # a copy that can be neither found nor made: known before the model's own pass is made again
        # for nothing (at real size a minute and more at every start)
        why_not = _why_no_copy(info, config, low_type)
        if why_not is not None:
            if verdict is None:
                return exact, _exact(why_not), None
            todo = []  # the ladder priced a slack below settles it
        else:
            if calibration.reference is None:  # kept from an earlier run: its distributions are not
                calibration = _measure(model_path, info, text, measure, calibration)
            # no room to measure: known before the copy is made for nothing (where a ladder priced
            # below settles the budget, it serves as it is)
            try:
                _measuring_room(info, calibration.reference, dataclasses.replace(ladder, low=str(low_path)), low_type)
            except BudgetError:
                if verdict is None:
                    raise
                todo = []
    if todo or verdict.within:
        why_not = _make_copy(info, config, low_type, threads, made)
        if why_not is not None:
            return exact, _exact(why_not), None
        if (low_type not in calibration.rounding_error and calibration.reference is not None
                and any(n > 0 for _, n in todo)):
            # priced before the first ladder over this copy with experts at the model's precision is
            # measured, kept with what it measures: every such ladder over it is placed in this order
            # (at real size under 12 GiB every expert is at the copy: the two passes, 5 minutes, spared)
            error = copy_rounding_error(info, low_path, calibration.reference, threads)
            # where it cannot be priced, every expert is taken to lose alike (the routers' weight
            # orders), and kept so: a later run does not try the stock pass again
            calibration = calibration.with_rounding_error(
                low_type, np.ones_like(calibration.importance) if error is None else error)
            _keep(model_path, info, text, calibration)
            placement, n_high = ladder_placement(info, model_layer_bytes, placed, calibration.order(low_type), low_type)
            steps = _priced_steps(info, model_layer_bytes, placed, calibration.order(low_type), low_type)
            todo = steps if verdict is None else _steps_left(calibration, verdict, steps, n_high, low_type)
    # placed as measured: the run's own cache may come out a little different from this plan's
    served = dataclasses.replace(ladder, low=str(low_path), importance=tuple(map(tuple, calibration.order(low_type).tolist())),
                                 placed_mb=placed / MB)
    if todo:
        try:
            for priced_bytes, n_priced in todo:
                # the first decides, beyond, whether the next type is tried (_decisive_kl); the
                # later ones only whether they serve
                priced = _price(info, calibration, dataclasses.replace(served, placed_mb=priced_bytes / MB), n_priced,
                                budget, score, low_type, _decisive_kl(next_type) if verdict is None else MAX_MEAN_KL,
                                stands_for=n_high)
                calibration = calibration.priced(priced)
                _keep(model_path, info, text, calibration)
                if verdict is None or priced.within:
                    verdict = priced
                if priced.within or priced.mean_kl > SLACK_GAIN * MAX_MEAN_KL:
                    break
            if verdict.within and calibration.verdict(0, low_type) is None:
                # whether every expert at the copy is within too: then none is kept at the model's
                # precision (placed_bytes)
                low_total = low_copy_bytes(info, low_type)
                every_low = _price(info, calibration, dataclasses.replace(served, placed_mb=low_total / MB), 0,
                                   budget, score, low_type, MAX_MEAN_KL)
                calibration = calibration.priced(every_low)
                _keep(model_path, info, text, calibration)
        finally:  # (after the last, not between: the pages one measurement read serve the next; at real
            # size the second ladder took 41 s with them and 58 s without)
            _release(model_path, low_path)
        if verdict.within:  # what was measured may allow fewer at the model's precision
            placed = placed_bytes(info, budget, calibration, low_type)
            placement, n_high = ladder_placement(info, model_layer_bytes, placed, calibration.order(low_type), low_type)
            served = dataclasses.replace(served, placed_mb=placed / MB)
            verdict = calibration.verdict(n_high, low_type)
    if not verdict.within:  # (a copy made for nothing is removed by the caller: the verdicts are kept)
        ladder_beyond = (f"the ladder memory allows ({n_high} experts at the model's precision, the rest at "
                         f"{low_type}) measured {_measured(verdict, n_high)}")
        if next_type is not None and _next_type_may_be_within(verdict):
            unmakeable = _why_no_copy(info, config, next_type)
            if unmakeable is None:
                return exact, _exact(ladder_beyond), verdict
            # no ladder over the next type can be served here: dynamic precision over this one is next
            ladder_beyond += f"; the ladder over {next_type} not tried ({unmakeable})"
        missed = missed_weight_share(model_layer_bytes, budget, calibration.importance)
        if missed < DYNAMIC_MIN_MISSED:
            return exact, _exact(f"{ladder_beyond}; dynamic precision not tried: the expert cache holds the experts "
                                 f"that carry {100 * (1 - missed):.0f} % of the routers' weight, and with so few misses "
                                 "the model's own experts decode faster"), None
        dynamic, line = _choose_dynamic(info, config, budget, text, calibration,
                                        measure, score, threads, made, low_type)
        if dynamic is None:
            return exact, _exact(f"{ladder_beyond}; {line}"), verdict
        made.clear()  # served: not made for nothing
        return dynamic, f"{line}; {ladder_beyond}", None
    made.clear()  # served: not made for nothing
    return served, describe(info, budget, calibration.importance, placement, verdict), None


def copy_rounding_error(info: ModelInfo, low_path: str | os.PathLike, reference: Reference,
                        threads: int) -> np.ndarray | None:
    """What the copy at low_path loses, expert by expert, as it is kept: the squared error its
    rounding adds to each expert's outputs (rounding_error.py) for the inputs the experts see on
    the reference's windows, from a stock pass over them (the expert cache's matmuls run on its
    pools, which the importance matrix's callback does not know). None, said in one line, where
    that pass sees no expert matmul."""
    log.info(f"pricing what {pathlib.Path(low_path).name} loses, expert by expert (a stock pass over the calibration "
             "text for the experts' inputs, then a pass over the model's experts and the copy's)")
    try:
        power = expert_input_power(info.path, reference.ids, reference.n_ctx, threads)
    except HobbitError as e:
        log.info(f"the experts' inputs could not be measured ({e}); a ladder keeps the experts the routers weigh most")
        return None
    finally:
        return_freed_memory()
        _release(info.path)
    try:
        error = rounding_error(info.path, low_path, power, threads)
    finally:
        _release(info.path, low_path)
    return np.array(kept_importance(error), np.float64)


def _priced_steps(info: ModelInfo, model_layer_bytes: np.ndarray, placed: int, importance: np.ndarray,
                  low_type: str) -> list[tuple[int, int]]:
    """The ladders a budget's is priced by, in the order measured, as (the bytes placed, the experts
    at the model's precision): a slack below the budget's own (verdict_slack_bytes), half a slack
    below, the budget's own; each with more experts at the model's precision than the one before."""
    slack = verdict_slack_bytes(info, placed)
    steps: list[tuple[int, int]] = []
    for below in (slack, slack // 2, 0):
        priced = max(placed - below, 0)
        n = ladder_placement(info, model_layer_bytes, priced, importance, low_type)[1]
        if not steps or n > steps[-1][1]:
            steps.append((priced, n))
    return steps


def _steps_left(calibration: Calibration, verdict: Priced, steps: list[tuple[int, int]], n_high: int,
                low_type: str) -> list[tuple[int, int]]:
    """The steps still to measure where a kept verdict settles a budget's ladder: none, unless it
    is a ladder priced below this very budget that measured beyond the limit by less than
    SLACK_GAIN times it; then those with more experts at the model's precision not measured yet
    (a run interrupted between them, or kept from before the steps). A run finding less memory
    than the budget it was priced for takes the verdict, and measures nothing."""
    if verdict.within or verdict.stands_for != n_high or verdict.mean_kl > SLACK_GAIN * MAX_MEAN_KL:
        return []
    return [(b, n) for b, n in steps if n > verdict.n_high and calibration.measured(n, low_type) is None]


def _only_bounds(info: ModelInfo, config: OffloadConfig, verdict: Priced, n_priced: int, next_type: str | None) -> bool:
    """Whether a kept verdict beyond the limit, which settles a budget's ladder (n_priced experts
    at the model's precision a slack below it) as beyond too, is no measure of how far beyond
    where that decides whether the next type is tried: measured with more experts at the model's
    precision than n_priced by more than its own slack (a run with much more memory; on the
    real-size hardened Mixtral, with no cap 174 at the model's precision measured 0.0123 nats,
    while under 12 GiB the budget's ladder keeps none and every expert at Q2_K measured 0.139:
    taken as it was, it sent the run to a 19.4 GB Q3_K copy NEXT_TYPE_GAIN rules out), near enough
    to the limit to send the next type, whose copy can be found or made, as can the copy it was
    measured over. Runs under the same memory, a slack more or less, take it as it is."""
    if verdict.within or next_type is None or not _next_type_may_be_within(verdict):
        return False
    slack = 0 if verdict.stands_for is None else verdict.stands_for - verdict.n_high
    return (verdict.n_high - slack > n_priced and _why_no_copy(info, config, verdict.low) is None
            and _why_no_copy(info, config, next_type) is None)


def _why_no_copy(info: ModelInfo, config: OffloadConfig, low_type: str) -> str | None:
    """Why the low copy of that type can be neither found next to the model nor made there (None:
    it can): what making it would fail on, said without trying."""
    low_path = default_companion_path(info.path, low_type)
    if low_path.is_file():
        return None
    if not config.prepare:
        return f"the default needs a {low_type} copy of the experts, {low_path} does not exist and --no-prepare was given"
    try:
        check_free_space(low_path.parent, low_copy_bytes(info, low_type), str(low_path))
    except NotEnoughSpaceError as e:
        return f"the {low_type} copy could not be made ({e})"
    except OSError as e:  # the folder gone or unreadable: making it would fail on the same
        return f"the {low_type} copy could not be made ({low_path.parent}: {e.strerror or e})"
    return None


def _make_copy(info: ModelInfo, config: OffloadConfig, low_type: str, threads: int, made: list) -> str | None:
    """The low copy of that type next to the model, made where it is missing (named in `made`);
    None where it is there, else why not."""
    low_path = default_companion_path(info.path, low_type)
    if low_path.is_file():
        return None
    why_not = _why_no_copy(info, config, low_type)
    if why_not is not None:
        return why_not
    need = low_copy_bytes(info, low_type)
    log.info(f"making a {low_type} copy of the experts for the default ({need / 1e9:.2f} GB, once): {low_path}")
    try:
        prepare_companion(info.path, low_type, low_path, threads=threads, progress=not quiet())
    except (OSError, ValueError, HobbitError) as e:  # the disk full, the folder read-only, ...
        return f"the {low_type} copy could not be made ({e})"
    finally:
        return_freed_memory()  # its buffers: the run planned next in this process is given them
    made.append(low_path)
    return None


def _choose_dynamic(info: ModelInfo, config: OffloadConfig, budget: int, text: str, calibration: Calibration,
                    measure: Measure, score: Score, threads: int, made: list, low_type: str
                    ) -> tuple[OffloadConfig | None, str]:
    """Dynamic precision over the copy of that type (DYNAMIC) where the ladder over it is beyond
    the limit: with the first thresholds of DYNAMIC_THRESHOLDS (the fewest bytes a token first)
    that measure within, the config and its line; else None and why not. Each is measured once for
    every memory (DYNAMIC_PRICED) and kept with the ladders; one whose successor, sending low and
    skipping fewer selections, measured beyond is not measured; the copy made where missing."""
    for i, thresholds in enumerate(DYNAMIC_THRESHOLDS):
        verdict = calibration.dynamic_verdict(low_type, thresholds)
        if verdict is None and any(p is not None and not p.within for p in
                                   (calibration.dynamic_verdict(low_type, t) for t in DYNAMIC_THRESHOLDS[i + 1:])):
            continue  # sends low or skips every selection one measured beyond does, and more
        if verdict is None:
            calibration, verdict, why_not = _price_dynamic(info, config, budget, text, calibration, measure, score,
                                                           threads, made, low_type, thresholds)
            if why_not is not None:
                return None, why_not
        if verdict.within:
            why_not = _make_copy(info, config, low_type, threads, made)
            if why_not is not None:
                return None, why_not
            low_path = default_companion_path(info.path, low_type)
            dynamic = dataclasses.replace(config, low=str(low_path), auto=False, **dynamic_settings(*thresholds),
                                          prefetch_layers=config.prefetch_layers or DYNAMIC_PREFETCH_LAYERS)
            return with_profile(dynamic, calibration), describe_dynamic(info, budget, verdict)
    # the thresholds that read the most were measured (none follows them) and are beyond
    return None, f"dynamic precision over {low_type} measured {_measured(verdict)} ({_thresholds_of(verdict.t1, verdict.t2)})"


def _price_dynamic(info: ModelInfo, config: OffloadConfig, budget: int, text: str, calibration: Calibration,
                   measure: Measure, score: Score, threads: int, made: list, low_type: str,
                   thresholds: tuple[float, float]) -> tuple[Calibration, Priced | None, str | None]:
    """Dynamic precision over the copy of that type with these thresholds, measured on the
    calibration text as DYNAMIC_PRICED serves it and kept: the calibration with the measurement,
    the measurement; or why it could not be made (the copy, made where missing)."""
    if calibration.reference is None:  # kept from an earlier run: its distributions are not
        calibration = _measure(info.path, info, text, measure, calibration)
    low_path = default_companion_path(info.path, low_type)
    t1, t2 = thresholds
    priced = dataclasses.replace(config, low=str(low_path), auto=False, **dynamic_settings(t1, t2, priced=True))
    room = _measuring_room(info, calibration.reference, priced, low_type)  # before a copy is made for nothing
    why_not = _make_copy(info, config, low_type, threads, made)
    if why_not is not None:
        return calibration, None, why_not
    log.info(f"measuring dynamic precision over {low_type} ({_thresholds_of(t1, t2)}) on hobbitpy's calibration text "
             f"(every selection the rule sends low served low, every one it skips skipped)")
    try:
        c = score(calibration.reference, dataclasses.replace(priced, cache_mb=min(budget, room) / MB), MAX_MEAN_KL)
    finally:
        _release(info.path, low_path)
    verdict = Priced(-1, c.mean_kl, c.ppl_increase, low_type, dynamic=True, at_least=not c.complete, t1=t1, t2=t2)
    calibration = calibration.priced(verdict)
    _keep(info.path, info, text, calibration)
    return calibration, verdict, None


def _thresholds_of(t1: float, t2: float) -> str:
    return f"T1 = {t1:g}, " + ("nothing skipped" if t2 >= 1.0 else f"skipped above T2 = {t2:g}")


def with_profile(config: OffloadConfig, calibration: Calibration) -> OffloadConfig:
    """The config with CACHE_POLICY, the calibration's importance its prior, unless a policy was chosen."""
    if config.policy is not None:
        return config
    return dataclasses.replace(config, **_prior_of(calibration))


def _prior_of(calibration: Calibration) -> dict:
    return {"policy": CACHE_POLICY, "popularity": tuple(map(tuple, kept_importance(calibration.importance)))}


def kept_prior(info: ModelInfo) -> dict:
    """The cache's settings a calibration kept next to the model gives (CACHE_POLICY, its
    importance the prior), or {} where none is kept."""
    calibration = load_calibration(info.path, info, calibration_text())
    return {} if calibration is None else _prior_of(calibration)


def kept_rounding_error(info: ModelInfo) -> dict[str, np.ndarray]:
    """By low type, what each expert loses at that copy (copy_rounding_error), as a calibration
    kept next to the model priced it; {} where none is kept."""
    calibration = load_calibration(info.path, info, calibration_text())
    return {} if calibration is None else calibration.rounding_error


def with_kept_prior(info: ModelInfo, config: OffloadConfig) -> tuple[OffloadConfig, str | None]:
    """A config serving the model's own experts at one precision, whole, with no policy or profile
    chosen (the default's exact path, `--exact`, `--cache-mb`): with CACHE_POLICY where a
    calibration is kept next to the model (the default writes it on its first run), and the line
    saying so; otherwise unchanged, and None."""
    if not (config.enabled and config.policy is None and config.popularity is None and config.n_level == 1
            and config.high is None and config.neurons is None):
        return config, None
    prior = kept_prior(info)
    if not prior:
        return config, None
    return dataclasses.replace(config, **prior), (
        f"the expert cache filled first with, and keeping, the experts the routers select most (LFU, its prior the "
        f"calibration kept in {importance_path(info.path)}; --policy lru for none)")


def describe_dynamic(info: ModelInfo, budget_bytes: int, verdict: Priced) -> str:
    """The line dynamic precision is announced with."""
    low_total = low_copy_bytes(info, verdict.low)
    skips = "" if verdict.t2 >= 1.0 else f", a miss it weighs least skipped (score above T2 = {verdict.t2:g})"
    return (f"the model's own experts for every hit of the expert cache ({budget_bytes / MB:.0f} MB), a {verdict.low} "
            f"copy ({low_total / MB:.0f} MB) for a miss a token weighs less (HOBBIT's dynamic precision: eq. 2 score "
            f"above T1 = {verdict.t1:g}){skips}; with every such selection served so {_measured(verdict)} (lossy; "
            "--exact serves the model's own experts only)")


def placed_bytes(info: ModelInfo, budget: int, calibration: Calibration, low: str = LOW_TYPE) -> int:
    """The bytes a budget's ladder is placed for: the budget's, or only the low copy's where every
    expert at the low copy measured within the limit. An expert at the model's precision streams
    more bytes a token through the matmuls than its copy, so a ladder keeps no more of them than
    the limit needs: more memory then never decodes slower (docs/BENCHMARKS.md at 5f63b2a, the default's
    ladder)."""
    low_total = low_copy_bytes(info, low)
    every_low = calibration.verdict(0, low)
    return min(budget, low_total) if every_low is not None and every_low.within else budget


def _measure(model_path: str | os.PathLike, info: ModelInfo, text: str, measure: Measure,
             kept: Calibration | None) -> Calibration:
    """The model's own experts on the calibration text (the ladders kept priced stay priced)."""
    calibration = measure(text)
    if kept is not None:
        calibration = dataclasses.replace(calibration, ladders=kept.ladders, rounding_error=kept.rounding_error)
    _keep(model_path, info, text, calibration)
    _release(model_path)
    return calibration


def _once(measure: Measure, kept_in: pathlib.Path) -> Measure:
    """measure, run at most once a text (and said when it runs)."""
    @functools.cache
    def measured(text: str) -> Calibration:
        log.info(f"measuring the model on hobbitpy's calibration text (kept in {kept_in})")
        return measure(text)
    return measured


def _measuring_room(info: ModelInfo, reference: Reference, ladder: OffloadConfig, low_type: str) -> int:
    """The expert cache a ladder gets while it is measured: what the memory leaves now beside the
    measurement's arrays (every token's logits); BudgetError where not even its minimum fits."""
    n = reference.n_ctx
    passes = ContextShape(n_ctx=n, n_batch=n, n_ubatch=n, logits_all=True)
    low_info = estimated_copy(info, low_copy_layer_bytes(info, low_type), ladder.low)
    room = _two_level_budget(info, ladder, passes, available_memory_bytes() - scoring_bytes(n, reference.n_vocab),
                             low_info)
    if room is None:
        raise BudgetError("no room for the two precisions' minimum beside the measurement's arrays")
    return room


def _price(info: ModelInfo, calibration: Calibration, ladder: OffloadConfig, n_high: int, budget: int,
           score: Score, low_type: str, decisive_kl: float, stands_for: int | None = None) -> Priced:
    """A ladder (placed as ladder.placed_mb holds it, n_high experts at the model's precision)
    measured against the model on the calibration windows, through the cache the memory leaves
    now beside the measurement's arrays (every token's logits: a smaller cache than the run's
    budget, and its misses read as they come), stopped once sure to end beyond decisive_kl."""
    room = _measuring_room(info, calibration.reference, ladder, low_type)
    log.info(f"measuring the default ladder on hobbitpy's calibration text ({n_high} experts at the model's precision, "
             f"the rest at {low_type})")
    c = score(calibration.reference, dataclasses.replace(ladder, cache_mb=min(budget, room) / MB), decisive_kl)
    return Priced(n_high, c.mean_kl, c.ppl_increase, low_type, at_least=not c.complete, stands_for=stands_for)
