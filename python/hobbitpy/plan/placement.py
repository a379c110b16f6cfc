"""Static placement: which experts are held at which precision, from how much the routers
weigh them, so that the bytes a budget holds go where they matter.

A uniform quant spends the same bits on every expert. The routers do not use them evenly:
some experts carry most of the gate weight, others are picked rarely and weighed little.
An expert served at a lower precision adds an error to the layer's output scaled by its
gate weight, and the divergence that error causes grows with its square, so an expert's
importance here is the sum over the traced tokens of its squared gate weight. Starting from
every expert at the lowest level, the most important ones are raised to the highest level
the budget still has room for, one by one. With a budget that holds a copy of every
expert, the result is a mixed-precision model that stays resident: no reads while
decoding, and more bits than the uniform quant of the same size where the routers put
their weight (HOBBIT's premise, applied once instead of per token; Fate's "least popular
experts at INT2").
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import numpy as np

from ..settings.config import MB, OffloadConfig
from ..errors import HobbitError
from ..files.model_file import layer_expert_bytes

if TYPE_CHECKING:
    from ..files.model_file import ModelInfo
    from ..files.trace_file import Trace



def _per_expert_sum(experts: np.ndarray, values: np.ndarray, n_expert: int) -> np.ndarray:
    """[moe_layers, n_expert]: values ([tokens, layers, k], one per selection of experts) summed per expert."""
    n_tokens, n_layer, k = experts.shape
    total = np.zeros((n_layer, n_expert), np.float64)
    layer = np.broadcast_to(np.arange(n_layer)[None, :, None], experts.shape)
    chosen = experts >= 0
    np.add.at(total, (layer[chosen], experts[chosen]), values[chosen])
    return total


def importance_of(experts: np.ndarray, weights: np.ndarray, n_expert: int) -> np.ndarray:
    """[moe_layers, n_expert]: the sum over the tokens of each expert's squared gate weight
    (experts, weights: [tokens, moe_layers, k], as a trace or Llama.record_routing holds them)."""
    return _per_expert_sum(experts, np.square(weights.astype(np.float64)), n_expert)


def expert_importance(trace: Trace) -> np.ndarray:
    """[moe_layers, n_expert]: the sum over the trace's tokens of each expert's squared gate weight."""
    return importance_of(trace.experts, trace.weights, trace.meta["n_expert"])


def expert_popularity(trace: Trace) -> np.ndarray:
    """[moe_layers, n_expert]: how often the trace's tokens selected each expert (Fiddler's
    profile: the experts selected most are the ones worth keeping resident)."""
    return _per_expert_sum(trace.experts, np.ones(trace.experts.shape, np.float64), trace.meta["n_expert"])


def expected_error(importance: np.ndarray, rounding_error: np.ndarray) -> np.ndarray:
    """[moe_layers, n_expert]: what serving each expert from a low copy costs, as an order to
    place by: its importance (the sum over the tokens of its squared gate weight) times the mean
    squared error the copy's rounding adds to its outputs (rounding_error.py). The routers' weight
    says which experts the tokens use, not how much each loses: on the hardened Mixtral-depth
    evidence model three first-layer experts the routers rank 130th to 177th lose most, and a
    ladder placed by this order measured 0.0096 nats where one placed by importance alone measured
    0.025, at half the experts at the model's precision (docs/BENCHMARKS.md)."""
    return importance * rounding_error


def place_by_importance(importance: np.ndarray, level_bytes: list[np.ndarray], budget_bytes: int) -> tuple[tuple[int, ...], ...]:
    """The level of every expert ([moe_layers][n_expert], 0 = high): all at the lowest level,
    then the most important raised to the highest level whose extra bytes still fit the
    budget. level_bytes[l][il]: one expert of layer il at level l. Deterministic: ties go to
    the lower layer and expert index."""
    n_layer, n_expert = importance.shape
    lowest = len(level_bytes) - 1
    levels = np.full((n_layer, n_expert), lowest, np.int64)
    spent = int(level_bytes[lowest].sum()) * n_expert
    order = np.lexsort((np.arange(n_layer * n_expert), -importance.ravel()))  # most important first
    for flat in order:
        il, e = divmod(int(flat), n_expert)
        for level in range(lowest):
            extra = int(level_bytes[level][il] - level_bytes[lowest][il])
            if spent + extra <= budget_bytes:
                levels[il, e] = level
                spent += extra
                break
    return tuple(tuple(int(x) for x in row) for row in levels)


def placement_bytes(placement: tuple[tuple[int, ...], ...], level_bytes: list[np.ndarray]) -> int:
    """The expert bytes a placement holds when every expert is resident."""
    return sum(int(level_bytes[level][il]) for il, row in enumerate(placement) for level in row)


def check_profiles(info: ModelInfo, config: OffloadConfig) -> None:
    """A per-expert profile (importance, popularity) made of another model's routing is refused,
    whether or not this run ends up offloading."""
    for what, figures in (("importance", config.importance), ("popularity", config.popularity)):
        shape = np.shape(figures) if figures is not None else None
        if shape is not None and shape != (info.n_layer_moe, info.n_expert):
            raise HobbitError(f"{info.path}: the expert {what} given is for {shape[0]} MoE layers of {shape[1]} "
                              f"experts; this model has {info.n_layer_moe} of {info.n_expert} (a profile of another model?)")


def placement_for(info: ModelInfo, config: OffloadConfig, level_paths: tuple[str | None, ...],
                  budget_bytes: int) -> tuple[tuple[int, ...], ...] | None:
    """The placement a run with this config and budget serves (None without importance):
    level_paths as companions.resolve_levels gives them (None: the model's own experts)."""
    check_profiles(info, config)
    if config.importance is None:
        return None
    importance = np.array(config.importance, np.float64)
    level_bytes = [layer_expert_bytes(path or info.path) for path in level_paths]
    placed_bytes = budget_bytes if config.placed_mb is None else int(config.placed_mb * MB)
    return place_by_importance(importance, level_bytes, placed_bytes)
