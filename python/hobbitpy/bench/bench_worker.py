"""One benchmark run, in its own process (inside the memory cap): load the model with
one configuration, measure time to first token for prompts of each length asked and the
decode speed (after the shortest prompt; greedy, or a beam search's steps), and print the
figures as one JSON line.

    python -m hobbitpy.bench.bench_worker '{"model": ..., "offload": {...} | null, ...}'

Run by ``hobbitpy bench``; a process per run, so every run starts from a cold cache.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time

import numpy as np

import hobbitpy  # noqa: F401  (first: points llama_cpp at the patched library)
from hobbitpy.settings.config import OffloadConfig
from hobbitpy.system.disk import read_bytes_of_process
from hobbitpy.bench.bench_plan import bench_context_shape
from hobbitpy.runtime.llama import Llama
from hobbitpy.plan.memory import fit_ubatch
from hobbitpy.files.model_file import inspect_model

# English prose for the prompts, cut to exact token counts with the model's tokenizer
PROMPT_TEXT = (
    "The history of the lighthouse begins with the fires that sailors lit on hills above dangerous coasts. "
    "Over the centuries these fires became towers of stone, and the towers carried lamps of oil, then of gas, "
    "and at last of electricity, whose beams were focused by great lenses of polished glass. A keeper lived "
    "beside each light, trimmed the wicks, wound the clockwork that turned the lens, and wrote in a log the "
    "weather of every night. Storms tested the towers and the people who kept them; some lights stood on bare "
    "rocks far from land, where supplies came by boat when the sea allowed it. Today most lights run on their "
    "own, watched from afar, yet ships still read the coast by their rhythm of flashes, each light with a "
    "pattern of its own, so that a captain who sees it knows at once where in the world the ship has come. "
)


def _prompt(llm: Llama, n_tokens: int) -> list[int]:
    ids: list[int] = []
    while len(ids) < n_tokens:
        ids += llm.tokenize(PROMPT_TEXT.encode(), add_bos=False, special=False)
    return ids[:n_tokens]


def _first_token(llm: Llama, prompt: list[int]) -> tuple[int, float]:
    """Prefill a new sequence; the time to its first token (ms) and the token."""
    llm.reset()
    t0 = time.perf_counter()
    llm.eval(prompt)
    tok = int(np.argmax(llm.last_logits()))
    return tok, (time.perf_counter() - t0) * 1000.0


def run(spec: dict) -> dict:
    offload = OffloadConfig(**spec["offload"]) if spec["offload"] is not None else OffloadConfig(enabled=False)
    n_predict = spec["n_predict"]
    beams = spec.get("beams", 1)
    lengths = sorted(spec["prompt_tokens"])
    t0 = time.perf_counter()
    shape = bench_context_shape(n_predict, tuple(lengths), beams)
    n_ubatch = None  # offloaded: the planner's, sized to the memory
    if not offload.enabled:
        # stock llama.cpp at the ubatch hobbitpy's planner gives the same file under this cap, as a
        # user would pass -ub: its default (the whole batch) allocates a compute buffer a tight cap
        # cannot hold (200 MB for a 512-token prompt of the inflated ref-mixtral). Stock's logits do
        # not depend on the ubatch (tests/runtime/test_memory.py).
        n_ubatch = fit_ubatch(inspect_model(spec["model"]), shape, OffloadConfig())
    llm = Llama(spec["model"], offload=offload, n_ctx=shape.n_ctx, n_batch=shape.n_batch, n_ubatch=n_ubatch,
                n_seq_max=beams, n_threads=spec["threads"], verbose=False, repack=spec.get("repack"))
    load_s = time.perf_counter() - t0
    with llm:
        # what the default (default_ladder.py) added to the configuration, which its quality is scored with
        added = {f.name: getattr(llm.offload_config, f.name) for f in dataclasses.fields(OffloadConfig)
                 if f.name != "auto" and getattr(llm.offload_config, f.name) != getattr(offload, f.name)}
        r = {"offloaded": llm.offloaded, "plan": llm.offload_plan.reason, "load_s": load_s, "repack": llm.repack,
             "budget_bytes": llm.offload_plan.budget_bytes or 0, "n_ubatch": int(llm.context_params.n_ubatch),
             "default_settings": added, "default_lossy": llm.offload_config.lossy}
        # time to first token per prompt length (JSON keys: strings); the shortest first, from a cold cache;
        # and what the process read from storage until then after its load (a warm-up's reads included):
        # the disk's speed swings between runs, the bytes a first token waited behind do not
        io_loaded = read_bytes_of_process()
        tok, first_ms = _first_token(llm, _prompt(llm, lengths[0]))
        r["ttft_ms"] = {str(lengths[0]): first_ms}
        r["first_token_disk_bytes"] = read_bytes_of_process() - io_loaded

        # decode from the short prompt: greedy, one token per step; or a beam search, one
        # batch of every beam per step (its prompt decoded again first, not timed)
        llm.reset_offload_stats()
        io0 = read_bytes_of_process()
        if beams > 1:
            result = llm.beam_search(_prompt(llm, lengths[0]), beams, n_predict)
            generated, decode_s, n_steps = result.tokens, result.step_seconds, max(1, result.steps)
        else:
            generated = [tok]
            t0 = time.perf_counter()
            for _ in range(n_predict - 1):
                llm.eval([tok])
                tok = int(np.argmax(llm.last_logits()))
                generated.append(tok)
            decode_s = time.perf_counter() - t0
            n_steps = max(1, n_predict - 1)
        r["decode_tok_s"] = n_steps / decode_s if decode_s > 0 else None
        r["decode_disk_bytes_per_token"] = (read_bytes_of_process() - io0) / n_steps
        stats = llm.offload_stats() if llm.offloaded else None
        r["runtime_bytes_per_token"] = stats["bytes_read"] / n_steps if stats else 0.0
        r["stall_ms_per_token"] = stats["stall_us"] / 1000.0 / n_steps if stats else 0.0
        r["dispatch_ms_per_token"] = stats["dispatch_us"] / 1000.0 / n_steps if stats else 0.0
        # expert bytes the matmuls streamed per token: what compute costs (served per level x its expert size)
        if stats:
            pools = llm.pool_stats()
            level_bytes = [max((p["expert_bytes"] for p in pools if p["level"] == l), default=0)
                           for l in range(stats["n_level"])]
            if stats["neuron_reads"] and stats["neuron_selections"]:
                # neuron reads: a slot holds the gate projection; up and down, its size each, stream their kept rows
                level_bytes[0] *= 1 + 2 * stats["neuron_kept"] / stats["neuron_selections"]
            r["served_expert_bytes_per_token"] = sum(n * b for n, b in zip(stats["served"], level_bytes)) / n_steps
        # what the decode did not spend waiting for expert loads
        r["compute_ms_per_token"] = (decode_s * 1000.0 - stats["stall_us"] / 1000.0) / n_steps if stats else None
        if stats:
            r["decode_stats"] = {k: stats[k] for k in ("n_level", "served", "n_skipped", "expert_hits", "expert_misses",
                                                       "prefetch_issued", "prefetch_used", "prefetch_wasted", "upgrades",
                                                       "warm_loads", "bytes_read", "demand_bytes_read", "stall_us",
                                                       "dispatch_us", "background_bytes_read", "n_substituted",
                                                       "neuron_selections", "neuron_whole", "neuron_kept",
                                                       "neuron_reads")}
        r["pools"] = [dict(p, hit_ratio=p["hits"] / max(1, p["hits"] + p["misses"])) for p in llm.pool_stats()]
        r["generated"] = generated

        for n in lengths[1:]:
            _, r["ttft_ms"][str(n)] = _first_token(llm, _prompt(llm, n))
    return r


def main() -> int:
    spec = json.loads(sys.argv[1])
    try:
        result = run(spec)
    except Exception as e:  # reported to the parent, which names the configuration
        print(json.dumps({"error": f"{type(e).__name__}: {e}"}))
        return 1
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
