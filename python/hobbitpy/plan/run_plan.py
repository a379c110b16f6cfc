"""What a run will be, decided once before anything is loaded: the precision levels' files, the
context's shape, the expert cache's budget and why, the placement of every expert. Reads the
model files' headers and the memory available; changes nothing (hobbitpy.Llama carries it out)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..copies.companions import resolve_levels
from ..errors import BudgetError, HobbitError, ModelFileError
from ..files.model_file import OFFLOAD_REFUSED, ModelInfo, inspect_model
from ..settings.config import MB, OffloadConfig
from .memory import ContextShape, OffloadPlan, context_sizes, fit_ubatch, plan_offload
from .placement import check_profiles, placement_for


@dataclass(frozen=True)
class RunPlan:
    offload: OffloadConfig                   # what the experts are served with
    level_paths: tuple[str | None, ...]      # each precision level's file, high to low (None: the model's own)
    shape: ContextShape                      # the context, its ubatch decided
    offload_plan: OffloadPlan                # the expert cache's budget (None: stock) and the line saying why
    placement: tuple[tuple[int, ...], ...] | None  # the level of every expert, where placed by importance
    repack: bool                             # the CPU backend's repacked copy of Q4_0/Q4_K/IQ4_NL weights (repack_fits)

    @property
    def offloaded(self) -> bool:
        return self.offload_plan.budget_bytes is not None


# the repacked copy of a file's weights, with the mapping's pages the compute still touches
REPACK_ROOM = 1.25


def repack_fits(file_bytes: int, memory_bytes: int | None) -> bool:
    """Whether llama.cpp's CPU backend may copy the weights it repacks (Q4_0, Q4_K, IQ4_NL) into
    memory of its own: where the file does not fit beside that copy, the copy evicts the pages
    every token reads, or the process is killed, and stock's best setting is --no-repack."""
    return memory_bytes is None or memory_bytes >= REPACK_ROOM * file_bytes


def check_offload_allowed(info: ModelInfo, offload: OffloadConfig) -> None:
    """An architecture whose experts hobbitpy cannot serve is refused with offload on."""
    if offload.enabled and info.arch in OFFLOAD_REFUSED:
        raise ModelFileError(f"{info.path}: a {info.arch} model: {OFFLOAD_REFUSED[info.arch]}; run it without offload "
                             "(--no-offload)")


def plan_run(info: ModelInfo, offload: OffloadConfig, shape: ContextShape, available: int, *,
             gpu_bytes: int | None = None, vocab_only: bool = False, lora_path: str | None = None,
             default_reason: str | None = None, cache_reason: str | None = None) -> RunPlan:
    """The run a config gives on this model with `available` bytes of memory (and gpu_bytes free
    on a GPU with memory of its own that holds every layer: plan_offload). Raises what the run
    would fail on (a refused architecture, a context that does not fit, a profile of another
    model, an adapter on offloaded experts) before anything is loaded. default_reason: the
    default's line (default_ladder.py), put before the plan's own; cache_reason: what chose the
    expert cache's policy (default_ladder.with_kept_prior), put after it where there is a cache."""
    check_offload_allowed(info, offload)
    level_paths: tuple[str | None, ...] = (
        resolve_levels(info.path, offload.high_file, offload.mid, offload.low, offload.high_flag)
        if offload.enabled else (None,))
    levels = tuple(info if p is None else inspect_model(p) for p in level_paths)
    if shape.n_ubatch is None:  # left open: narrower when the compute buffer would crowd out the experts
        shape = dataclasses.replace(shape, n_ubatch=fit_ubatch(info, shape, offload, levels, available))
    context = context_sizes(info, shape)
    # (a vocabulary-only load makes no context: nothing to refuse, e.g. tokenizing under a cap)
    if context.total > available and not vocab_only:  # llama.cpp would only say "Failed to create llama_context"
        raise BudgetError(f"{info.path}: a context of {shape.n_ctx} tokens needs {context.kv / MB:.0f} MB of KV cache "
                          f"and {(context.total - context.kv) / MB:.0f} MB of other buffers, more than the "
                          f"{available / MB:.0f} MB of memory available; use a smaller context (n_ctx, --ctx)")
    plan = plan_offload(info, offload, context.total if offload.enabled else 0, levels, available_bytes=available,
                        gpu_bytes=gpu_bytes)
    if plan.shared_pool:  # a pool per layer does not fit: the plan falls back to one
        offload = dataclasses.replace(offload, shallow_layers=None)
    if plan.budget_bytes is not None:
        reasons = (plan.reason, f"ubatches of {shape.n_ubatch} tokens", cache_reason)
        plan = dataclasses.replace(plan, reason="; ".join(filter(None, reasons)))
    if default_reason:
        plan = dataclasses.replace(plan, reason=f"{default_reason}; {plan.reason}")
    if offload.enabled:
        check_profiles(info, offload)
    placement = None
    if plan.budget_bytes is not None:
        if lora_path:  # an adapter on expert weights would be applied once per pass of a layer
            raise HobbitError(f"{lora_path}: LoRA adapters are not supported with expert offload yet; "
                              "load the model with OffloadConfig(enabled=False)")
        placement = placement_for(info, offload, level_paths, plan.budget_bytes)
    # the weights are repacked as stock llama.cpp's best setting for this memory has them, the
    # pools' experts too (to_native's cpu_repack): the same kernels as that stock run, its bits
    repack = repack_fits(info.file_bytes, available)
    return RunPlan(offload, level_paths, shape, plan, placement, repack)
