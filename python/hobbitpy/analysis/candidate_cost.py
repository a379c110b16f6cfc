"""What a configuration costs per decoded token, in expert megabytes, for `tune` to rank its
candidates by: what the matmuls stream, plus what is read in the background, plus
MEMORY_OVER_DISK times what decoding waits for from the disk.

A static candidate (its outputs the same whatever its cache holds: one level, or a placed
ladder) is priced before it runs, from the routing of the text it will be scored on: the
runtime's own expert cache, made from the candidate's settings, budget and files, replays that
routing token by token as decoding meets it (simulate.replay) and counts what it serves and
reads, every miss read (gpu-centric). While a level's file is still to be made, the price is
modelled: each selection streams one expert at the level it is held at, and the policy's
simulator on the trace, every expert priced as the largest, gives the misses. A dynamic candidate
is priced by the runtime's counters as it decodes the text; before that only its floor is
known: every selection at its lowest level, nothing missed.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ..settings.config import MB, OffloadConfig
from ..files.model_file import ModelInfo
from .simulate import replay, simulate
from ..files.trace_file import Trace

# memory streams expert weights to the matmuls about this many times faster than the disk
# delivers a missed expert (O_DIRECT reads plus the copy into the slot; this machine: 1-1.7
# GB/s against 12-20 GB/s)
MEMORY_OVER_DISK = 10.0


def routing_trace(experts: np.ndarray, weights: np.ndarray, info: ModelInfo) -> Trace:
    """A trace of tokens routed in batches (Llama.record_routing), as the simulator replays it:
    one sequence, each token a step, as decoding would meet them."""
    n = len(experts)
    seq_start = np.zeros(n, np.uint8)
    seq_start[:1] = 1  # the first token starts the one sequence
    meta = {"model": info.path, "arch": info.arch, "n_expert": info.n_expert, "n_expert_used": info.n_expert_used,
            "expert_bytes": info.expert_bytes, "uniform": info.uniform}
    return Trace(experts=experts, weights=weights, probs=np.zeros((n, 0, 0), np.float16),
                 predicted=np.zeros((n, experts.shape[1], 0, experts.shape[2]), np.int32),
                 seq_start=seq_start, tokens=np.zeros(n, np.int32), meta=meta)


def modeled_cost(trace: Trace, layer_bytes: list[np.ndarray], placement: tuple[tuple[int, ...], ...] | None,
                 budget_bytes: int, policy: str) -> float:
    """MB per token of a static candidate. layer_bytes[level][moe_layer]: one expert's bytes;
    placement: each expert's level (None: one level). A placed ladder holds every expert, so
    it misses nothing; one level that the budget cannot hold whole misses what `policy`
    misses on the trace."""
    experts = trace.experts
    layer = np.broadcast_to(np.arange(experts.shape[1])[None, :, None], experts.shape)
    level = np.zeros(experts.shape, np.int64) if placement is None else np.array(placement, np.int64)[layer, experts]
    served = float(np.stack(layer_bytes)[level, layer].sum())
    waited = 0.0
    per_expert = int(layer_bytes[0].max())
    if placement is None and budget_bytes < int(layer_bytes[0].sum()) * trace.meta["n_expert"]:
        # every expert priced as the largest (a model whose layers mix types, as a Q4_K_M file's
        # down projections do): fewer slots and dearer misses than the run's, a cost no lower
        priced = dataclasses.replace(trace, meta={**trace.meta, "expert_bytes": per_expert, "uniform": True})
        waited = float(simulate(priced, budget_bytes / MB, policy).bytes_read)
    return (served + MEMORY_OVER_DISK * waited) / trace.n_tokens / MB


def replayed_cost(trace: Trace, info: ModelInfo, levels: tuple[ModelInfo, ...], config: OffloadConfig,
                  budget_bytes: int, level_paths: tuple[str | None, ...],
                  placement: tuple[tuple[int, ...], ...] | None) -> float:
    """MB per token of a static candidate whose levels' files exist: measured_cost of the
    counters the runtime's cache gives replaying the trace token by token at this budget (its
    pools per level and per expert signature, its hit rule, thresholds and placement), every
    miss loaded into the cache."""
    params, _strings = dataclasses.replace(config, mode="gpu-centric").to_native(budget_bytes, level_paths,
                                                                                 placement=placement)
    stats = replay(info.path, params, trace.experts, trace.weights, (), trace.seq_start)
    return measured_cost(stats, levels, info, trace.n_tokens)


def floor_cost(info: ModelInfo, levels: tuple[ModelInfo, ...]) -> float:
    """MB per token no configuration of these levels can cost less than: every selection at the
    cheapest level, nothing missed or loaded."""
    cheapest = min(level.expert_bytes_total / (level.n_layer_moe * level.n_expert) for level in levels)
    return cheapest * info.n_expert_used * info.n_layer_moe / MB


def measured_cost(stats: dict | None, levels: tuple[ModelInfo, ...], info: ModelInfo, n_tokens: int,
                  predicts_neurons: bool = False) -> float:
    """MB per token from the runtime's counters over a token-by-token run: what the matmuls
    streamed (with CORM's neuron prediction, each selection past the first MoE layer streams its
    gate projection, a third of it, once more: experts are multiplied whole), plus what loaded in
    the background (warm-up, upgrades: each a copy into a slot that competes with the matmuls
    for the cores), plus MEMORY_OVER_DISK times what decoding waited for from the disk."""
    if stats is None:  # stock: every expert resident (the budget held them all)
        return info.expert_bytes_total / info.n_expert * info.n_expert_used / MB
    per_expert = [level.expert_bytes_total / (level.n_layer_moe * level.n_expert) for level in levels]
    served = sum(n * b for n, b in zip(stats["served"], per_expert))
    if predicts_neurons:
        served *= 1.0 + (info.n_layer_moe - 1) / info.n_layer_moe / 3.0
    waited = stats["demand_bytes_read"]
    return (served + stats["background_bytes_read"] + MEMORY_OVER_DISK * waited) / max(1, n_tokens) / MB
