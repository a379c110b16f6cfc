"""The configuration `run`, `serve` and `hobbitpy.Llama(MODEL)` choose by themselves when a
model's experts do not all fit in memory and nothing else was asked for.

Served at one precision, the experts that do not fit are read from the disk, token after
token: exact, and as slow as the disk. The frontier measured on the reference models
(docs/BENCHMARKS.md) is elsewhere: a copy of every expert in memory, the ones the routers
weigh most at the model's own precision and the rest from a low-precision copy (placement.py,
HOBBIT's premise placed once). So, where memory holds a low copy of every expert and the
experts kept at the model's precision carry enough of the routers' weight, that ladder is
the default:

- the low copy is `prepare`'s Q2_K companion next to the model, made on first use (a
  progress bar; the disk it needs checked and said first; never with `--no-prepare`);
- how much the routers weigh each expert is measured once, in batched passes over a text
  that ships with hobbitpy (data/calibration.txt: prose, dialogue, code, arithmetic, three
  languages, scripture), and kept next to the model (MODEL.hobbit-importance.json).

Otherwise, or with `--exact`, a preset, a profile, an expert cache size (`--cache-mb`) or a
precision level asked for, the experts are served at the model's own precision: stock's
logits bit for bit. One line always says which and why.
"""

from __future__ import annotations

from collections.abc import Callable
import dataclasses
from dataclasses import dataclass
import hashlib
import importlib.resources
import json
import logging
import os
import pathlib

import numpy as np

from .config import MB, OffloadConfig
from .errors import BudgetError, HobbitError
from .memory import ContextShape, context_sizes, fit_ubatch, plan_offload
from .model_file import ModelInfo
from .outputs import partial_output, replace
from .placement import layer_expert_bytes, place_by_importance
from .prepare import copy_layer_bytes, default_companion_path, estimated_copy, prepare_companion

log = logging.getLogger("hobbitpy")

# the low copy the default ladder makes (the one type `prepare` writes at disk speed)
LOW_TYPE = "Q2_K"
# The ladder is chosen only when the experts left at LOW_TYPE carry at most this share of
# the routers' weight (squared gate weights, on the calibration text). On the inflated
# ref-mixtral every expert at Q2_K cost +4.6 % perplexity, a fifth of the weight left there
# +0.83 %, a third +1.29 %: a quarter keeps the ladder near the 1 % a user can accept without
# being asked (docs/BENCHMARKS.md, "The default's ladder").
MAX_LOW_WEIGHT_SHARE = 0.25
# ... and only measured where at least this share of the experts can keep the model's
# precision: on ref-mixtral a quarter of them carried two thirds of the weight (34 % left at Q2_K),
# two fifths of them four fifths (21 %)
MIN_HIGH_EXPERT_SHARE = 0.2
# the calibration passes: prompts of at most this many tokens, at most CALIBRATION_TOKENS in
# all (at real size each pass reads every expert once: two passes of 512 tokens)
CALIBRATION_CTX = 512
CALIBRATION_TOKENS = 1024
IMPORTANCE_VERSION = 1


@dataclass(frozen=True)
class Choice:
    """What the default serves: settings to add to the config ({}: the model's own experts
    at one precision) and the line that says why."""

    settings: dict
    reason: str


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


def load_importance(model_path: str | os.PathLike, info: ModelInfo, text: str) -> np.ndarray | None:
    """The importance kept next to the model, or None when there is none for this model file
    and this text (another file of the same name, another text: measured again)."""
    path = importance_path(model_path)
    try:
        data = json.loads(path.read_text())
        if (data.get("version") != IMPORTANCE_VERSION or data.get("model_bytes") != info.file_bytes
                or data.get("text") != _text_digest(text)):
            return None
        importance = np.array(data["importance"], np.float64)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return importance if importance.shape == (info.n_layer_moe, info.n_expert) else None


def save_importance(model_path: str | os.PathLike, info: ModelInfo, text: str, importance: np.ndarray,
                    n_tokens: int) -> pathlib.Path:
    """Write the importance next to the model (replacing a stale one: it is hobbitpy's own cache)."""

    path = importance_path(model_path)
    data = {"version": IMPORTANCE_VERSION, "model": os.path.basename(model_path), "model_bytes": info.file_bytes,
            "text": _text_digest(text), "n_tokens": n_tokens,
            "importance": [[float(f"{x:.6g}") for x in row] for row in importance.tolist()]}
    with partial_output(path) as partial:
        partial.write_text(json.dumps(data) + "\n")
        return replace(partial, path)


def low_copy_layer_bytes(info: ModelInfo) -> np.ndarray:
    """[moe_layers]: one expert's bytes in the LOW_TYPE copy `prepare` will write (0: rows not whole blocks)."""
    return copy_layer_bytes(info, LOW_TYPE)


def low_weight_share(importance: np.ndarray, placement: tuple[tuple[int, ...], ...]) -> float:
    """The share of the routers' weight that a placement serves from the lowest level."""
    levels = np.array(placement)
    total = importance.sum()
    return float(importance[levels == levels.max()].sum() / total) if total > 0 and levels.max() > 0 else 0.0


def choose(info: ModelInfo, model_layer_bytes: np.ndarray, budget_bytes: int | None,
           importance: np.ndarray | None) -> Choice:
    """Decide, from the budget two levels would get (None: no room even for the low copy's
    minimum) and the importance (None: not measured yet, decide on the bytes alone)."""
    exact = "serving the model's own experts (exact)"
    low = low_copy_layer_bytes(info)
    if not low.any():
        return Choice({}, f"{exact}: its experts' rows are not whole {LOW_TYPE} blocks")
    low_total = int(low.sum()) * info.n_expert
    if low_total >= info.expert_bytes_total:
        return Choice({}, f"{exact}: a {LOW_TYPE} copy would be no smaller than its experts")
    if budget_bytes is None or budget_bytes < low_total:
        have = "no room" if budget_bytes is None else f"{budget_bytes / MB:.0f} MB"
        return Choice({}, f"{exact}: a {LOW_TYPE} copy of every expert ({low_total / MB:.0f} MB) does not fit the "
                          f"expert cache ({have})")
    n_experts = info.n_layer_moe * info.n_expert
    extra = int((model_layer_bytes - low).mean())  # what raising one expert costs
    n_high_max = min(n_experts, (budget_bytes - low_total) // max(1, extra))
    if importance is None:
        if n_high_max < MIN_HIGH_EXPERT_SHARE * n_experts:  # not worth measuring: no router is that skewed
            return Choice({}, f"{exact}: in {budget_bytes / MB:.0f} MB of expert cache at most {n_high_max} of "
                              f"{n_experts} experts could keep their precision beside a {LOW_TYPE} copy")
        return Choice({"low": LOW_TYPE, "hits": "found"}, "")
    placement = place_by_importance(importance, [model_layer_bytes, low], budget_bytes)
    share = low_weight_share(importance, placement)
    n_high = sum(level == 0 for row in placement for level in row)
    if share > MAX_LOW_WEIGHT_SHARE:
        return Choice({}, f"{exact}: in {budget_bytes / MB:.0f} MB of expert cache only {n_high} of "
                          f"{n_experts} experts keep their precision beside a {LOW_TYPE} copy, "
                          f"which would serve {100 * share:.0f} % of the routers' weight (at most "
                          f"{100 * MAX_LOW_WEIGHT_SHARE:.0f} %)")
    return Choice({"low": LOW_TYPE, "hits": "found", "importance": tuple(map(tuple, importance.tolist()))},
                  f"every expert in memory: the {n_high} of {n_experts} the routers weigh most "
                  f"at the model's precision, the rest ({100 * share:.0f} % of the routers' weight) from a {LOW_TYPE} "
                  "copy (lossy; --exact serves the model's own experts only)")


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


def default_config(info: ModelInfo, config: OffloadConfig, shape: ContextShape, available: int,
                   measure: Callable[[str], tuple[np.ndarray, int]], threads: int) -> tuple[OffloadConfig, str]:
    """The config a run left to the default serves (applies(config) holds, the experts do not
    all fit), and the line saying what and why. Makes what the ladder needs on first use: the
    importance (measure(text): importance and tokens, from a run of the model) and the low copy."""
    exact = dataclasses.replace(config, auto=False)
    model_path = info.path
    low_path = default_companion_path(model_path, LOW_TYPE)
    low = low_copy_layer_bytes(info)
    ladder = dataclasses.replace(config, low=LOW_TYPE, hits="found")
    budget = (_two_level_budget(info, ladder, shape, available, estimated_copy(info, low, low_path))
              if low.any() else None)
    model_layer_bytes = layer_expert_bytes(model_path, info.n_expert)
    first = choose(info, model_layer_bytes, budget, None)
    if not first.settings:
        return exact, first.reason

    text = calibration_text()
    importance = load_importance(model_path, info, text)
    if importance is None:
        log.info(f"measuring how much the routers weigh each expert on hobbitpy's calibration text (once; kept in "
                 f"{importance_path(model_path)})")
        importance, n_tokens = measure(text)
        try:
            save_importance(model_path, info, text, importance, n_tokens)
        except OSError as e:
            log.info(f"could not keep the importance next to the model ({e}); it is measured again next time")
    choice = choose(info, model_layer_bytes, budget, importance)
    if not choice.settings:
        return exact, choice.reason

    if not low_path.is_file():
        if not config.prepare:
            return exact, (f"serving the model's own experts (exact): the default ladder needs a {LOW_TYPE} copy of "
                           f"the experts, {low_path} does not exist and --no-prepare was given")
        need = int(low.sum()) * info.n_expert
        log.info(f"making a {LOW_TYPE} copy of the experts for the default ladder ({need / 1e9:.2f} GB, once): "
                 f"{low_path}")
        try:
            prepare_companion(model_path, LOW_TYPE, low_path, threads=threads)
        except (OSError, ValueError, HobbitError) as e:  # the disk full, the folder read-only, ...
            return exact, f"serving the model's own experts (exact): the {LOW_TYPE} copy could not be made ({e})"
    return dataclasses.replace(ladder, low=str(low_path), importance=choice.settings["importance"]), choice.reason
