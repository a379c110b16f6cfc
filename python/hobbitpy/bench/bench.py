"""``hobbitpy bench``: stock llama.cpp and hobbitpy configurations side by side, on the
same model and prompts, under the same memory cap, interleaved across configurations and caps.

Every run is a fresh process (hobbitpy.bench.bench_worker) inside a child memory cgroup
whose limit caps RSS and page cache together; the model file is dropped from the page
cache before every run. Per configuration and cap it reports medians over the repeats
of decode tok/s, time to first token for a short and a long prompt, bytes read from
disk per decoded token, hit ratio per pool, the cgroup's peak memory, the ratio to
stock in the same run, and the disk bound: bytes read per token over the read
bandwidth measured around the configuration's runs (expert-sized O_DIRECT reads, as the
loader does, before and after each run; the median of its runs).
"""

from __future__ import annotations

from collections.abc import Callable
import dataclasses
import json
import os
import subprocess
import sys
import time

from ..copies.quants import default_quant_dir, make_uniform_quant, quant_name
from ..errors import HobbitError
from ..files.model_file import inspect_model
from ..files.tokens import tokenize_text
from ..measure.evaluate import evaluate_against, measure_reference
from ..measure.tune import SCORING_CTX, measure_text, tune
from ..plan.memory import SLACK_BYTES, ContextShape, available_memory_bytes, context_sizes
from ..plan.run_plan import repack_fits
from ..settings.config import MB, OffloadConfig
from ..system.disk import drop_from_page_cache, measure_read_bandwidth
from ..system.memory_cgroup import MemoryCap
from ..system.progress import progress_bar
from .bench_output import BenchResult, format_row, format_run, summarize
from .bench_plan import (PROMPT_TOKENS, STOCK, TUNED, BenchConfig, Cap, TuneRequest, bench_context_shape, check_caps,
                         config_files, is_lossy)
from .frontier import format_frontier, mark_dominated


def now_to_the_minute() -> str:
    return time.strftime("%Y-%m-%d %H:%M")


def _machine() -> dict:
    import platform

    cpu = ""
    try:
        cpu = next(l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "kernel": platform.release(), "python": platform.python_version()}


def worker_start_bytes(memcap: MemoryCap | None) -> int:
    """The memory a fresh bench worker takes once its imports are done: what its cgroup is
    charged (libraries another process has in the page cache already are not charged to
    it: 32 MB against a VmRSS of 51 MB here), or its VmRSS without a cgroup."""
    probe = ("import hobbitpy.bench.bench_worker\nfrom hobbitpy.plan.memory import process_resident_bytes\n"
             "print(process_resident_bytes())")
    if memcap is not None:
        memcap.set_limit(None)
    p = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120,
                       preexec_fn=memcap.enter if memcap is not None else None)
    if p.returncode != 0:
        why = p.stderr.strip().splitlines()[-1] if p.stderr.strip() else f"exit status {p.returncode}"
        raise HobbitError(f"a bench worker cannot start: {why}")
    return memcap.peak_bytes() if memcap is not None else int(p.stdout.strip())


def _run_one(model: str, cfg: BenchConfig, cap: Cap, memcap: MemoryCap | None, n_predict: int, threads: int,
             prompt_tokens: tuple[int, ...], fallback_budget_mb: float | None, cold_files: set[str] = frozenset(),
             beams: int = 1, disk: Callable[[], float] | None = None) -> dict:
    """One run in a worker process under the cap. disk: measures the disk's read speed, then
    called just before and just after the run, their mean kept as the run's (this VM's disk
    moves by 2-4x within one invocation: the bytes' disk time is priced at the run's own speed)."""
    offload = cfg.offload
    if offload is not None and memcap is None and cap.limit_bytes is not None and offload.get("cache_mb") is None:
        offload = dict(offload, cache_mb=fallback_budget_mb)  # no cgroup: the budget stands in for the cap
    # stock with its best settings for the memory: where the file does not fit beside the CPU
    # backend's repacked copy of its Q4_0/Q4_K weights, it runs as a user who knows turns it off;
    # hobbitpy as its plan decides in the memory it finds (None), which is the same rule
    model_file = cfg.model or model
    memory = cap.limit_bytes if cap.limit_bytes is not None else available_memory_bytes()
    repack = None if offload is not None else repack_fits(inspect_model(model_file).file_bytes, memory)
    spec = {"model": model_file, "offload": offload, "n_predict": n_predict, "threads": threads,
            "prompt_tokens": list(prompt_tokens), "beams": beams, "repack": repack}
    # every file of the benchmark, not only this run's: page cache stays charged to the
    # cgroup after the run that read it has exited
    for path in cold_files:
        drop_from_page_cache(path)
    disk_before = disk() if disk is not None else None
    if memcap is not None:
        memcap.set_limit(cap.limit_bytes)
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "hobbitpy.bench.bench_worker", json.dumps(spec)],
                          preexec_fn=memcap.enter if memcap is not None else None, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    last = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    try:
        r = json.loads(last)
    except json.JSONDecodeError:
        r = {"error": f"exit status {proc.returncode}" + (" (killed: out of memory under the cap?)"
                                                          if proc.returncode < 0 else "")
                      + f"; stderr: {proc.stderr.strip()[-600:]}"}
    r["wall_s"] = wall
    r["peak_bytes"] = memcap.peak_bytes() if memcap is not None else None
    r["times_at_cap"] = memcap.times_at_limit() if memcap is not None and cap.limit_bytes is not None else None
    if disk is not None:
        r["disk_bytes_per_s"] = (disk_before + disk()) / 2
    return r


def tuned_configs(model: str, caps: list[Cap], request: TuneRequest, shape: ContextShape, threads: int,
                  process_bytes: int, result: BenchResult, log=print) -> dict[str, BenchConfig]:
    """Per cap label, the configuration `tune` picks for that much memory (a cap where no
    candidate stays within the mean-KL limit gets none). process_bytes: what a run's
    process holds before it loads a model (this one holds far more once tune has run)."""


    # the reference and the routing once, for every cap, within the least memory
    least = min(cap.limit_bytes for cap in caps) - process_bytes
    measured = measure_text(model, request.text, request.max_tokens, SCORING_CTX, least, threads,
                            log=lambda m: log("tune: " + m))
    picked = {}
    for cap in caps:
        log(f"tune for cap {cap.label} ({cap.limit_bytes / MB:.1f} MB):")
        try:
            profile, rows = tune(model, request.text, memory_bytes=cap.limit_bytes,
                                 max_mean_kl=request.max_mean_kl, max_tokens=request.max_tokens,
                                 run_shape=shape, threads=threads, log=lambda m: log("  " + m), names=request.candidates,
                                 process_bytes=process_bytes, measured=measured)
        except HobbitError as e:
            log(f"  nothing chosen: {e}")
            result.tuned[cap.label] = {"chosen": None, "why": str(e)}
            continue
        chosen = profile.calibration["chosen"]
        log(f"  chosen: {chosen}")
        result.tuned[cap.label] = {"chosen": chosen, "settings": profile.settings, "candidates": rows,
                                   "not_scored": profile.calibration["not_scored"]}
        picked[cap.label] = BenchConfig(TUNED, dataclasses.asdict(OffloadConfig(**profile.settings)))
    return picked


def run_bench(model: str, configs: list[BenchConfig], caps: list[Cap], *, repeats: int = 3, n_predict: int = 32,
              threads: int | None = None, prompt_tokens: tuple[int, ...] = PROMPT_TOKENS, progress=True,
              quants: list[str] = (), quant_dir: str | None = None, quality_text: str | None = None,
              quality_tokens: int = 4096, tune_request: TuneRequest | None = None, beams: int = 1,
              log=print) -> BenchResult:
    """quants: uniform quants of the model (made with llama.cpp's quantizer into quant_dir,
    or reused from there) run by stock llama.cpp as further baselines; quality_text: score
    every configuration's perplexity and KL against the model (stock) on this text;
    tune_request: first run `tune` at each cap's memory and add its pick there; beams > 1:
    decode is a beam search of that width (beam_search.py), its speed in steps per second."""
    info = inspect_model(model)
    threads = threads or os.cpu_count() or 1
    log(f"{model}: {info.file_bytes / MB:.0f} MB, {info.arch}, {info.n_layer_moe} MoE layers x {info.n_expert} experts "
        f"(top-{info.n_expert_used}), {info.expert_bytes_total / MB:.0f} MB of experts")
    if tune_request is not None and any(c.limit_bytes is None for c in caps):
        raise HobbitError("tuning needs a memory size: every cap must be a limit (not 'none')")
    memcap = MemoryCap.create(f"hobbitpy-bench-{os.getpid()}")
    try:
        # what a run's process takes before it loads anything (cap check, tune's budgets): a
        # worker's as it starts (this process's VmRSS is 20 MB more: tune planned for less
        # cache than the runs got)
        process_bytes = worker_start_bytes(memcap)
        shape = bench_context_shape(n_predict, prompt_tokens, beams)
        check_caps(info, caps, shape, process_bytes)
        quant_configs = []
        for q in quants:
            path, made = make_uniform_quant(model, q, quant_dir or default_quant_dir(model), threads)
            log(f"{'made' if made else 'reusing'} {path}: {os.path.getsize(path) / MB:.0f} MB")
            quant_configs.append(BenchConfig(quant_name(q), None, model=str(path)))

        def disk() -> float:
            return measure_read_bandwidth(model, info.expert_bytes or (1 << 20), n_threads=2)[0]

        disk_bw, direct = measure_read_bandwidth(model, info.expert_bytes or (1 << 20), n_threads=2)
        log(f"disk: {disk_bw / 1e9:.2f} GB/s with {'O_DIRECT' if direct else 'buffered'} reads of "
            f"{info.expert_bytes / MB:.1f} MB, 2 readers")
        if beams > 1:
            log(f"decode: a beam search of {beams} beams, one batch of every beam a step: tok/s below are steps/s")
        if memcap is None:
            log("no writable memory cgroup here: caps are NOT enforced; hobbitpy runs get an expert budget of "
                "cap - resident weights - context buffers, stock runs are uncapped")
        else:
            log(f"memory cap: {memcap}, RSS and page cache together")
        result = BenchResult(model=os.path.abspath(model), machine=_machine(), disk_bytes_per_s=disk_bw,
                             disk_direct=direct, cap_method=str(memcap) if memcap else "none (budgets only)")
        tuned = {} if tune_request is None else tuned_configs(
            model, caps, tune_request, shape, threads, process_bytes, result, log)
    except BaseException:  # an error or an interrupt before the runs: the cgroup goes too
        if memcap is not None:
            memcap.remove()
        raise
    all_configs = [BenchConfig(STOCK, None)] + quant_configs + configs
    # each cap's configurations: the same everywhere, but for tune's pick for that cap's memory
    cap_configs = {cap.label: all_configs + ([tuned[cap.label]] if cap.label in tuned else []) for cap in caps}
    configs_seen = [c for cs in cap_configs.values() for c in cs]
    total = repeats * sum(len(cs) for cs in cap_configs.values())
    bar = None
    if progress:
        bar = progress_bar(total=total, desc="bench", unit="run")
    try:
        # compute of stock decode: a warm run with no cap (the file read once, then from memory)
        warm = [_run_one(model, BenchConfig(STOCK, None), Cap("none", None), memcap, n_predict, threads, prompt_tokens,
                         None, beams=beams) for _ in range(2)]
        stock_compute_s = 1.0 / warm[-1]["decode_tok_s"] if warm[-1].get("decode_tok_s") else None
        result.stock_compute_ms = stock_compute_s * 1000.0 if stock_compute_s else None
        if stock_compute_s:
            log(f"stock compute: {stock_compute_s * 1000.0:.1f} ms per token (warm, no cap)")
        fallbacks = {}
        for cap in caps:
            fallbacks[cap.label] = None
            if cap.limit_bytes is not None:
                context = context_sizes(info, shape).total
                fallbacks[cap.label] = max(info.min_budget_bytes, cap.limit_bytes - info.resident_bytes - context
                                           - SLACK_BYTES - 2 * info.expert_bytes) / MB
        # every file any run may read, asked anew: the default makes its low copy in its first run
        every_file = set().union(*(config_files(model, c) for c in configs_seen))
        runs = {(cap.label, c.name): [] for cap in caps for c in cap_configs[cap.label]}
        for _ in range(repeats):
            # interleaved, caps and configurations alike, so drifts of the machine (this disk's
            # bandwidth moves by 4x) hit every cell of the table alike
            for cap in caps:
                for cfg in cap_configs[cap.label]:
                    if bar is not None:
                        bar.set_postfix_str(f"cap {cap.label} {cfg.name}")
                    r = _run_one(model, cfg, cap, memcap, n_predict, threads, prompt_tokens, fallbacks[cap.label],
                                 every_file, beams=beams, disk=disk)
                    runs[cap.label, cfg.name].append(r)
                    # each run in one line as it ends: a long bench stopped halfway keeps what it measured
                    if bar is not None:
                        bar.clear()
                    log(format_run(cap, cfg, r))
                    if bar is not None:
                        bar.update(1)
        for cap in caps:
            this_cap = cap_configs[cap.label]
            row = {"cap": cap.label, "cap_mb": cap.limit_bytes / MB if cap.limit_bytes else None,
                   "configs": [summarize(c.name, runs[cap.label, c.name], disk_bw, stock_compute_s)
                               for c in this_cap]}
            stock = row["configs"][0]
            for cfg, s in zip(this_cap, row["configs"]):
                s["settings"] = cfg.offload
                s["lossy"] = is_lossy(cfg) or bool(s.get("default_lossy"))
                s["file_mb"] = inspect_model(cfg.model or model).file_bytes / MB
                s["failed"] = s.get("decode_tok_s") is None  # every run of it failed
                # a hobbitpy configuration whose every expert fit ran stock's own path: no ratio to claim
                s["stock_path"] = cfg.offload is not None and not s["failed"] and not s["offloaded"]
                if s.get("decode_tok_s") and stock.get("decode_tok_s") and not s["stock_path"]:
                    s["ratio_to_stock"] = s["decode_tok_s"] / stock["decode_tok_s"]
                # stock's tokens under the same cap: hobbitpy repacks where that run does (the same
                # rule, run_plan.repack_fits), so it computes with the same kernels; the warm
                # uncapped run's where the capped one failed
                reference = stock.get("generated") or warm[-1].get("generated")
                if "generated" in s and reference is not None:
                    s["same_output_as_stock"] = s["generated"] == reference
            # hobbitpy's configurations at the model's precision must reproduce stock exactly
            # (others may differ); None when stock or one of them failed: nothing was compared
            exact = [s for cfg, s in zip(this_cap, row["configs"]) if cfg.offload is not None and not s["lossy"]]
            row["same_output_as_stock"] = (None if any(s["failed"] for s in exact) else
                                           all(s.get("same_output_as_stock", True) for s in exact))
            result.rows.append(row)
            if bar is not None:
                bar.clear()
            log(format_row(row))
            if bar is not None:
                bar.refresh()
    finally:
        if bar is not None:
            bar.close()
        if memcap is not None:
            memcap.remove()
    if quality_text is not None:
        score_quality(result, model, [cap_configs[c.label] for c in caps], quality_text, quality_tokens, threads,
                      progress, log)
    return result


def score_quality(result: BenchResult, model: str, row_configs: list[list[BenchConfig]], text: str, max_tokens: int,
                  threads: int, progress: bool, log=print) -> None:
    """Perplexity and KL of every configuration against stock on the model, as decoding meets
    them: stock files in wide batches (their logits do not depend on the batch), hobbitpy
    configurations token by token with the expert budget each got under each cap.
    row_configs: the configurations of each of result.rows, in its order."""

    bar = None
    if progress:
        bar = lambda xs: progress_bar(xs, desc="quality", unit="window", leave=False)  # noqa: E731
    ids = tokenize_text(model, text, max_tokens)
    reference = measure_reference(model, ids, n_threads=threads)
    log(f"quality: {len(ids)} tokens, stock perplexity {reference.perplexity:.4f}")
    stock_scores = {STOCK: {"perplexity": reference.perplexity, "mean_kl": 0.0, "top1_agreement": 1.0,
                            "ppl_increase_se": 0.0}}
    for cfg in row_configs[0]:
        if cfg.offload is None and cfg.model is not None:
            r = evaluate_against(cfg.model, reference, OffloadConfig(enabled=False), n_threads=threads, progress=bar)
            stock_scores[cfg.name] = {"perplexity": r.perplexity, "mean_kl": r.mean_kl, "top1_agreement": r.top1_agreement,
                                      "ppl_increase_se": r.log_ppl_ratio_se}
    scored = {}  # (settings, budget): the same cache shape under two caps is scored once
    for row, configs in zip(result.rows, row_configs):
        for cfg, s in zip(configs, row["configs"]):
            key = (json.dumps(cfg.offload, sort_keys=True), json.dumps(s.get("default_settings"), sort_keys=True),
                   s.get("budget_mb"), s.get("offloaded"))
            score = stock_scores.get(cfg.name) or scored.get(key)
            if score is None and cfg.offload is not None and s.get("decode_tok_s") is not None:
                # the budget the run got under this cap; a run that kept every expert resident is stock's path
                # (with what the default added: the run chose it from the memory it found)
                offload = (dataclasses.replace(cfg.offload_config(s["budget_mb"]), **s["default_settings"])
                           if s["offloaded"] else OffloadConfig(enabled=False))
                if not offload.lossy:
                    # one precision, nothing substituted: stock's logits bit for bit (the exactness tests); scoring
                    # it token by token would price only ubatch 1's order of sums against the batched reference
                    score = {**stock_scores[STOCK], "exact": True}
                else:
                    r = evaluate_against(model, reference, offload, n_ubatch=1, n_threads=threads, progress=bar)
                    score = scored[key] = {"perplexity": r.perplexity, "mean_kl": r.mean_kl,
                                           "top1_agreement": r.top1_agreement, "ppl_increase_se": r.log_ppl_ratio_se}
            if score is not None:
                s.update(score, ppl_increase=score["perplexity"] / reference.perplexity - 1.0)
        mark_dominated(row)
        log(format_frontier(row))
    result.quality = {"n_tokens": len(ids), "reference_perplexity": reference.perplexity}
