"""Routing traces recorded: the expert runtime, with a hook on every router, while the model
generates from a set of prompts (the file: trace_file.py).
"""

from __future__ import annotations

import os
import pathlib
import time

import numpy as np

from ..settings.config import OffloadConfig
from ..errors import HobbitError
from ..runtime.llama import Llama
from ..plan.memory import ContextShape, available_memory_bytes, default_context, whole_memory_budget_mb
from ..files.model_file import inspect_model
from ..analysis.neurons import GateWeights, check_arch, neuron_stats
from ..files.trace_file import TRACE_VERSION, Trace


def read_prompts(path: str | os.PathLike) -> list[str]:
    p = pathlib.Path(path)
    try:
        lines = p.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise HobbitError(f"{p}: cannot read the prompts ({e})") from e
    prompts = [line.strip() for line in lines if line.strip()]
    if not prompts:
        raise HobbitError(f"{p}: no prompts (one prompt per line, blank lines ignored)")
    return prompts


TRACE_CTX = 512  # the default context's upper end: room for a prompt and its generation


def record_trace(model_path: str | os.PathLike, prompts: list[str], *, n_predict: int = 32, lookahead: int = 4,
                 n_ctx: int | None = None, n_threads: int | None = None, cache_mb: float | None = None,
                 policy: str = "lru", n_batch: int = 512, neuron_thetas: tuple[float, ...] = (), progress=None,
                 keep_inputs: bool = False, shallow_layers: int | None = None) -> Trace:
    """Generate greedily from each prompt and record the routing of every token.

    neuron_thetas: also measure CORM's neuron statistics at these thresholds (neurons.py;
    SwiGLU models), from the router inputs; keep_inputs: keep those inputs in
    ``trace.inputs`` (float32 [tokens, moe_layers, n_embd]; not saved with the trace).
    n_ctx: the context (None: memory.default_context with every row's logits, at most TRACE_CTX).

    The run's own cache (cache_mb, policy, shallow_layers: a pool per layer) does not change
    the trace, only how fast it is recorded; its hit and miss counts are kept in
    meta["runtime"]. With n_batch=1 every token is its own step, as the offline simulator
    replays it."""
    model_path = os.fspath(model_path)
    if not 0 <= lookahead <= 4:
        raise ValueError(f"lookahead must be 0..4, got {lookahead}")
    if n_predict < 0:
        raise ValueError(f"n_predict must be >= 0, got {n_predict}")
    info = inspect_model(model_path)
    if not info.is_moe:
        raise HobbitError(f"{model_path} is a dense model: it has no routing to trace")
    # a prompt and its generation at a time: the shared default (with every row's logits kept), at most TRACE_CTX
    n_ctx = n_ctx or min(TRACE_CTX, default_context(info, available_memory_bytes(),
                                                    ContextShape(n_batch=n_batch, logits_all=True)))
    if neuron_thetas:
        check_arch(model_path, info.arch)
    # the trace comes from the runtime, so it must attach: as much cache as memory allows,
    # never more than every expert (the outputs are the same at any budget)
    if cache_mb is None:
        cache_mb = whole_memory_budget_mb(info, ContextShape(n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_batch, logits_all=True))
    # logits_all: otherwise llama.cpp drops every row but the last of a batch before the
    # last layer, whose routing would then be missing for prompt tokens
    # gpu-centric: every miss is loaded, so the runtime's own counts are the pool's (what
    # the simulator replays)
    offload = OffloadConfig(cache_mb=cache_mb, policy=policy, mode="gpu-centric", shallow_layers=shallow_layers)
    llm = Llama(model_path, offload=offload, n_ctx=n_ctx, logits_all=True, n_batch=n_batch, n_ubatch=n_batch,
                n_threads=n_threads or os.cpu_count() or 1, verbose=False)
    try:
        if not llm.offloaded:
            raise HobbitError(f"{model_path}: the expert runtime did not attach; cannot trace")
        with_inputs = bool(neuron_thetas) or keep_inputs
        prompt_ids = []
        for prompt in prompts:
            ids = llm.tokenize(prompt.encode("utf-8"), add_bos=True, special=False)
            if n_ctx - len(ids) < 1:
                raise HobbitError(f"a prompt of {len(ids)} tokens does not fit the context of {n_ctx}: "
                                  f"{prompt[:60]!r}...")
            prompt_ids.append(ids)
        routing = llm.record_routing(prompt_ids, n_predict=n_predict, lookahead=lookahead, with_inputs=with_inputs,
                                     progress=progress)
        experts, weights, probs, predicted, inputs = (routing.experts, routing.weights, routing.probs,
                                                      routing.predicted, routing.inputs)
        L, D, k, E = experts.shape[1], predicted.shape[2], info.n_expert_used, info.n_expert
        tokens, seq_start = routing.tokens, routing.seq_start
        stats = llm.offload_stats()
        runtime = {"cache_mb": cache_mb, "policy": policy, "n_batch": n_batch, "n_slot": stats["n_slot"],
                   "expert_hits": stats["expert_hits"], "expert_misses": stats["expert_misses"]}
    finally:
        llm.close()

    meta = {
        "trace_version": TRACE_VERSION,
        "model": os.path.abspath(model_path),
        "model_bytes": info.file_bytes,
        "arch": info.arch,
        "n_moe_layer": L,
        "n_expert": E,
        "n_expert_used": k,
        "expert_bytes": info.expert_bytes,
        "n_ff_expert": info.n_ff_expert,
        "expert_bytes_total": info.expert_bytes_total,
        "uniform": info.uniform,
        "lookahead": D,
        "n_prompts": len(prompts),
        "n_predict": n_predict,
        "runtime": runtime,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    trace = Trace(experts=experts, weights=weights, probs=probs.astype(np.float16), predicted=predicted,
                  seq_start=np.array(seq_start, np.uint8), tokens=np.array(tokens, np.int32), meta=meta)
    if neuron_thetas:
        trace.neurons = neuron_stats(trace, inputs, GateWeights(model_path, L), neuron_thetas)
    if keep_inputs:
        trace.inputs = inputs
    return trace
