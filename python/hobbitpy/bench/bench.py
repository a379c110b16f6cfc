"""``hobbitpy bench``: stock llama.cpp and hobbitpy configurations side by side, on the
same model and prompts, under the same memory cap, interleaved across configurations and caps.

Every run is a fresh process (hobbitpy.bench.bench_worker) inside a child memory cgroup
whose limit caps RSS and page cache together; the model file is dropped from the page
cache before every run. Per configuration and cap it reports medians over the repeats
of decode tok/s, time to first token for a short and a long prompt, bytes read from
disk per decoded token, hit ratio per pool, the cgroup's peak memory, the ratio to
stock in the same run, and the disk bound: bytes read per token over the read
bandwidth measured at the start (expert-sized O_DIRECT reads, as the loader does).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
import io
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time

from ..copies.companions import default_companion_path, resolve_levels
from ..settings.config import MAX_MEAN_KL, MB, OffloadConfig
from ..runtime.default_ladder import LOW_TYPE, applies
from ..system.disk import drop_from_page_cache, measure_read_bandwidth
from ..errors import HobbitError
from ..measure.evaluate import evaluate_against, measure_reference
from ..system.memory_cgroup import MemoryCap
from .frontier import format_frontier, mark_dominated, plot_frontier
from ..plan.memory import SLACK_BYTES, ContextShape, context_sizes
from ..files.model_file import inspect_model, model_parts
from ..system.outputs import new_output_error, write_new
from ..system.progress import progress_bar
from ..copies.quants import default_quant_dir, make_uniform_quant, quant_name
from ..files.tokens import tokenize_text
from ..measure.tune import SCORING_CTX, measure_text, tune

STOCK = "stock"


# prompt lengths whose time to first token every run measures (--prompt-tokens; the papers
# add 512: stock runs then get the ubatch the planner sizes to the cap, bench_worker)
PROMPT_TOKENS = (16, 128)


def bench_context_shape(n_predict: int, prompt_tokens: tuple[int, ...], beams: int = 1) -> ContextShape:
    """The context every benchmark run uses: room for the longest prompt, or the shortest and the
    decode (of every beam: each beam's tokens take cells of their own)."""
    return ContextShape(n_ctx=max(min(prompt_tokens) + beams * n_predict, max(prompt_tokens)) + 8, n_batch=512)


@dataclass
class BenchConfig:
    name: str
    offload: dict | None  # OffloadConfig fields; None = stock llama.cpp
    model: str | None = None  # another file of the model (a uniform quant); None = the benchmarked one

    def offload_config(self, cache_mb: float | None):
        """The OffloadConfig of this configuration with another budget (None: from memory)."""
        fields = dict(self.offload, cache_mb=cache_mb, policy_weights=tuple(self.offload["policy_weights"]))
        if fields["level_shares"] is not None:
            fields["level_shares"] = tuple(fields["level_shares"])
        return OffloadConfig(**fields)


@dataclass
class Cap:
    label: str             # "none", "0.55" (of the model size) or "1000MB"
    limit_bytes: int | None


def parse_caps(fractions: list[str], mbs: list[float], model_bytes: int) -> list[Cap]:
    caps = []
    for f in fractions:
        if f == "none":
            caps.append(Cap("none", None))
            continue
        v = float(f)
        if not 0 < v <= 4:
            raise ValueError(f"a cap fraction must be in (0, 4], got {f}")
        caps.append(Cap(f"{v:g}", int(v * model_bytes)))
    caps += [Cap(f"{mb:g}MB", int(mb * MB)) for mb in mbs]
    return caps


@dataclass
class BenchResult:
    model: str
    machine: dict
    disk_bytes_per_s: float
    disk_direct: bool
    cap_method: str
    rows: list[dict] = field(default_factory=list)
    stock_compute_ms: float | None = None  # per token, warm and uncapped
    quality: dict | None = None  # tokens scored and the stock perplexity (--quality)
    tuned: dict = field(default_factory=dict)  # per cap: what `tune` chose for its memory (--tune)
    command: str | None = None  # the command line that ran it, for a report to print above its figures
    started: str | None = None  # local time, ISO 8601, to the minute
    finished: str | None = None

    def as_dict(self) -> dict:
        return {"model": self.model, "command": self.command, "started": self.started, "finished": self.finished,
                "machine": self.machine, "disk_bytes_per_s": self.disk_bytes_per_s,
                "disk_direct": self.disk_direct, "cap_method": self.cap_method,
                "stock_compute_ms": self.stock_compute_ms, "quality": self.quality, "tuned": self.tuned,
                "rows": self.rows}


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


def config_files(model: str, cfg: BenchConfig) -> set[str]:
    """Every file a run of this configuration may read."""
    if cfg.offload is None:
        return set(model_parts(cfg.model or model))
    offload = cfg.offload_config(cfg.offload["cache_mb"])
    levels = resolve_levels(model, offload.high_file, offload.mid, offload.low, offload.high_flag)
    # the default's low copy, where it chooses one (made before the runs when missing: default_ladder.py)
    default_low = default_companion_path(model, LOW_TYPE) if applies(offload) else None
    return {*model_parts(cfg.model or model), *(p for p in levels if p is not None),
            *([str(default_low)] if default_low is not None and default_low.is_file() else [])}


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


def check_caps(info, caps: list[Cap], shape: ContextShape, process_bytes: int) -> None:
    """Refuse, before any run, a cap below what a run's process holds before its first expert:
    process_bytes (Python, llama.cpp) and the context's buffers. Such a cap would only get
    every run killed."""
    minimum = process_bytes + context_sizes(info, shape).total
    for cap in caps:
        if cap.limit_bytes is not None and cap.limit_bytes < minimum:
            raise HobbitError(f"cap {cap.label} ({cap.limit_bytes / MB:.0f} MB) is below the {minimum / MB:.0f} MB a run "
                              f"needs before any weight (the process and the context's buffers): every run would be "
                              f"killed; use caps of at least {minimum / MB:.0f} MB")


def _run_one(model: str, cfg: BenchConfig, cap: Cap, memcap: MemoryCap | None, n_predict: int, threads: int,
             prompt_tokens: tuple[int, ...], fallback_budget_mb: float | None, cold_files: set[str] = frozenset(),
             beams: int = 1) -> dict:
    offload = cfg.offload
    if offload is not None and memcap is None and cap.limit_bytes is not None and offload.get("cache_mb") is None:
        offload = dict(offload, cache_mb=fallback_budget_mb)  # no cgroup: the budget stands in for the cap
    # stock with its best settings for the memory: under a cap below its file, the CPU backend's
    # repacked copy of the Q4_0/Q4_K weights cannot fit beside the mapping (killed, or evicting the
    # pages every token reads), so it runs as a user who knows turns it off (--no-repack)
    model_file = cfg.model or model
    repack = offload is not None or cap.limit_bytes is None or cap.limit_bytes >= 1.25 * inspect_model(model_file).file_bytes
    spec = {"model": model_file, "offload": offload, "n_predict": n_predict, "threads": threads,
            "prompt_tokens": list(prompt_tokens), "beams": beams, "repack": repack}
    # every file of the benchmark, not only this run's: page cache stays charged to the
    # cgroup after the run that read it has exited
    for path in cold_files:
        drop_from_page_cache(path)
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
    return r


def _median(runs: list[dict], key: str):
    vals = [r[key] for r in runs if r.get(key) is not None]
    return statistics.median(vals) if vals else None


def _summarize(name: str, runs: list[dict], disk_bw: float, stock_compute_s: float | None) -> dict:
    ok = [r for r in runs if "error" not in r]
    s = {"config": name, "n_runs": len(runs), "errors": [r["error"] for r in runs if "error" in r]}
    if not ok:
        return s
    s.update({
        "decode_tok_s": _median(ok, "decode_tok_s"),
        "all_decode_tok_s": [round(r["decode_tok_s"], 3) for r in ok if r.get("decode_tok_s")],
        "ttft_ms": {n: statistics.median(r["ttft_ms"][n] for r in ok) for n in ok[0]["ttft_ms"]},
        "load_s": _median(ok, "load_s"),
        "bytes_per_token": _median(ok, "decode_disk_bytes_per_token"),
        "runtime_bytes_per_token": _median(ok, "runtime_bytes_per_token"),
        "stall_ms_per_token": _median(ok, "stall_ms_per_token"),
        "dispatch_ms_per_token": _median(ok, "dispatch_ms_per_token"),
        "served_expert_mb_per_token": (_median(ok, "served_expert_bytes_per_token") or 0) / MB,
        "peak_mb": max((r["peak_bytes"] or 0) for r in ok) / MB if ok[0]["peak_bytes"] is not None else None,
        "times_at_cap": max(r["times_at_cap"] for r in ok) if ok[0].get("times_at_cap") is not None else None,
        "min_decode_tok_s": min((r["decode_tok_s"] for r in ok if r.get("decode_tok_s")), default=None),
        "max_decode_tok_s": max((r["decode_tok_s"] for r in ok if r.get("decode_tok_s")), default=None),
        "budget_mb": ok[0]["budget_bytes"] / MB,
        # each run's own: a budget derived from the memory a run finds may differ by a slot between
        # runs, and an LRU whose slots fall one short of a token's experts hits half as often
        "all_budget_mb": [round(r["budget_bytes"] / MB, 3) for r in ok],
        "all_slots": [sum(p["n_slot"] for p in r["pools"]) for r in ok],
        "all_decode_hits": [(r.get("decode_stats") or {}).get("expert_hits") for r in ok],
        "n_ubatch": ok[0].get("n_ubatch"),
        "offloaded": ok[0]["offloaded"],
        "plan": ok[0]["plan"],
        "default_settings": ok[0].get("default_settings") or {},
        "pool_hit_ratio": [round(statistics.median(r["pools"][i]["hit_ratio"] for r in ok), 4)
                           for i in range(len(ok[0]["pools"]))],
        "generated": ok[0]["generated"],
        "same_output_all_repeats": len({tuple(r["generated"]) for r in ok}) == 1,
        "decode_stats": ok[0].get("decode_stats"),
    })
    d = s.get("decode_stats")
    if d and s["decode_tok_s"]:
        # decode time per token = the graph (matmuls, and whatever competes with them for the
        # cores: background reads and copies) + waits for on-demand loads + the dispatch ops
        s["graph_ms_per_token"] = 1000.0 / s["decode_tok_s"] - s["stall_ms_per_token"] - s["dispatch_ms_per_token"]
        background_share = d["background_bytes_read"] / d["bytes_read"] if d["bytes_read"] else 0.0
        s["background_mb_per_token"] = background_share * s["runtime_bytes_per_token"] / MB
    # compute per token: what a hobbitpy run did not spend waiting for loads; for stock, a
    # warm run without a cap (every weight in the page cache)
    s["compute_ms_per_token"] = _median(ok, "compute_ms_per_token") if s["offloaded"] else (
        stock_compute_s * 1000.0 if stock_compute_s else None)
    if s["decode_tok_s"] and s["bytes_per_token"] is not None:
        disk_s = s["bytes_per_token"] / disk_bw
        s["disk_bound_tok_s"] = 1.0 / disk_s if disk_s > 0 else None
        # the bound: the disk time of the bytes read plus compute; decode time over it (1.0 = at the bound)
        bound_s = disk_s + (s["compute_ms_per_token"] or 0.0) / 1000.0
        s["bound_tok_s"] = 1.0 / bound_s if bound_s > 0 else None
        s["time_over_bound"] = (1.0 / s["decode_tok_s"]) / bound_s if bound_s > 0 else None
        d = s.get("decode_stats")
        if d and d.get("bytes_read"):
            # only on-demand loads stall a decode; background reads (prefetch, upgrades, warm-up)
            # run under compute: the bound of the critical path counts the on-demand bytes
            demand_s = d["demand_bytes_read"] / d["bytes_read"] * s["runtime_bytes_per_token"] / disk_bw
            critical_s = demand_s + (s["compute_ms_per_token"] or 0.0) / 1000.0
            s["time_over_critical_bound"] = (1.0 / s["decode_tok_s"]) / critical_s if critical_s > 0 else None
    return s


def _lossy(cfg: BenchConfig) -> bool:
    """May the configuration's tokens differ from stock's (another file, another precision,
    substitution)?"""
    return cfg.model is not None or (cfg.offload is not None and cfg.offload_config(None).lossy)


TUNED = "tuned"


@dataclass
class TuneRequest:
    """Run `tune` at every cap's memory and benchmark its pick there as the configuration "tuned"."""
    text: str
    candidates: list[str] | None = None  # names as tune prints them; None: all
    max_tokens: int = 1024
    max_mean_kl: float = MAX_MEAN_KL


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
                                 every_file, beams=beams)
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
                   "configs": [_summarize(c.name, runs[cap.label, c.name], disk_bw, stock_compute_s)
                               for c in this_cap]}
            stock = row["configs"][0]
            for cfg, s in zip(this_cap, row["configs"]):
                s["settings"] = cfg.offload
                s["lossy"] = _lossy(cfg) or bool(s.get("default_settings"))
                s["file_mb"] = inspect_model(cfg.model or model).file_bytes / MB
                s["failed"] = s.get("decode_tok_s") is None  # every run of it failed
                # a hobbitpy configuration whose every expert fit ran stock's own path: no ratio to claim
                s["stock_path"] = cfg.offload is not None and not s["failed"] and not s["offloaded"]
                if s.get("decode_tok_s") and stock.get("decode_tok_s") and not s["stock_path"]:
                    s["ratio_to_stock"] = s["decode_tok_s"] / stock["decode_tok_s"]
                # stock's tokens with llama.cpp's defaults (the warm uncapped run): a capped stock
                # run without repacking computes Q4_K with other kernels, and its tokens may differ
                reference = warm[-1].get("generated") or stock.get("generated")
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


def format_run(cap: Cap, cfg: BenchConfig, r: dict) -> str:
    head = f"run: cap {cap.label} {cfg.name}: "
    if "error" in r:
        return head + "failed: " + r["error"][:200]
    mb_read = r.get("decode_disk_bytes_per_token")
    tok_s = r.get("decode_tok_s")
    return head + ((f"{tok_s:.3f} tok/s" if tok_s else "no decode") + f", load {r.get('load_s', 0.0):.1f} s"
                   + (f", {mb_read / MB:.1f} MB read a token" if mb_read is not None else "")
                   + (f", peak {r['peak_bytes'] / MB:.0f} MB" if r.get("peak_bytes") else ""))


def format_row(row: dict) -> str:
    head = f"cap {row['cap']}" + (f" ({row['cap_mb']:.0f} MB)" if row["cap_mb"] else " (no limit)")
    same = {True: "yes", False: "NO", None: "not compared (a run failed)"}[row["same_output_as_stock"]]
    lengths = next((list(s["ttft_ms"]) for s in row["configs"] if s.get("ttft_ms")), [])
    ttft_head = " ".join(f"{'TTFT' + n:>8}" for n in lengths)
    lines = [head + f"   one-precision configurations reproduce stock: {same}",
             f"  {'config':<14} {'tok/s':>7} {'x stock':>7} {'load':>6} {ttft_head} {'MB/tok':>7} "
             f"{'bound':>6} {'t/bound':>7} {'t/crit':>6} {'hit':>13} {'low/skip':>9} {'=stock':>6} {'budget':>7} "
             f"{'peak MB':>7}"]
    for s in row["configs"]:
        if s.get("decode_tok_s") is None:
            lines.append(f"  {s['config']:<14} failed: {'; '.join(s['errors'])[:300]}")
            continue
        ratio = f"{s['ratio_to_stock']:.2f}" if s.get("ratio_to_stock") else "stock" if s.get("stock_path") else "-"
        bound = f"{s['bound_tok_s']:.1f}" if s.get("bound_tok_s") else "-"
        over = f"{s['time_over_bound']:.2f}" if s.get("time_over_bound") else "-"
        crit = f"{s['time_over_critical_bound']:.2f}" if s.get("time_over_critical_bound") else "-"
        hits = ",".join(f"{h:.2f}" for h in s["pool_hit_ratio"]) or "-"
        budget = f"{s['budget_mb']:.0f}" if s["offloaded"] else "stock"
        peak = f"{s['peak_mb']:.0f}" if s.get("peak_mb") is not None else "-"
        d = s.get("decode_stats") or {}
        served = d.get("served") or []
        total = sum(served) + d.get("n_skipped", 0)
        shares = f"{sum(served[1:]) / total:.0%}/{d.get('n_skipped', 0) / total:.0%}" if total and len(served) > 1 else "-"
        same = "yes" if s.get("same_output_as_stock") else "no"
        load = f"{s['load_s']:.2f}s" if s.get("load_s") is not None else "-"
        ttft = " ".join(f"{s['ttft_ms'][n]:>6.0f}ms" for n in lengths)
        lines.append(f"  {s['config']:<14} {s['decode_tok_s']:>7.2f} {ratio:>7} {load:>6} {ttft} "
                     f"{s['bytes_per_token'] / MB:>7.1f} {bound:>6} {over:>7} {crit:>6} "
                     f"{hits:>13} {shares:>9} {same:>6} {budget:>7} {peak:>7}")
        if s["errors"]:
            lines.append(f"  {'':<14} {len(s['errors'])} run(s) failed: {s['errors'][0][:200]}")
    split = [s for s in row["configs"] if s.get("graph_ms_per_token") is not None]
    if split:
        lines.append("  decode time per token = graph (matmuls and whatever competes with them) + stall + dispatch; "
                     "background reads alongside")
        for s in split:
            lines.append(f"  {s['config']:<14} {1000.0 / s['decode_tok_s']:6.2f} ms = {s['graph_ms_per_token']:6.2f} + "
                         f"{s['stall_ms_per_token']:5.2f} + {s['dispatch_ms_per_token']:4.2f}   "
                         f"experts streamed {s['served_expert_mb_per_token']:6.1f} MB, background {s['background_mb_per_token']:5.1f} MB")
    return "\n".join(lines)


def plot(result: BenchResult) -> bytes | None:
    """tok/s against the cap, one line per configuration, as PNG bytes; None if matplotlib is
    missing or no capped run decoded."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    capped = [r for r in result.rows if r["cap_mb"]]
    if not capped:
        return None
    model_mb = inspect_model(result.model).file_bytes / MB
    lines = {}  # configuration: (caps, median, min, max) of the caps where it decoded
    for r in capped:
        for s in r["configs"]:
            if s.get("decode_tok_s"):
                lines.setdefault(s["config"], []).append((r["cap_mb"] / model_mb, s["decode_tok_s"],
                                                          s["min_decode_tok_s"], s["max_decode_tok_s"]))
    if not lines:
        return None  # every capped run failed: no picture rather than an empty one
    fig, ax = plt.subplots(figsize=(7.0, 4.6))
    for name, points in lines.items():
        xs, ys, lo, hi = zip(*points)
        ax.errorbar(xs, ys, yerr=([y - l for y, l in zip(ys, lo)], [h - y for y, h in zip(ys, hi)]), marker="o",
                    capsize=3, label=name)
    for name in dict.fromkeys(s["config"] for r in capped for s in r["configs"]):
        if name not in lines:
            ax.plot([], [], " ", label=f"{name}: every run failed")
    ax.set_xlabel("memory cap / model size")
    ax.set_ylabel("decode tokens/s (median)")
    ax.set_yscale("log")
    ax.set_title(f"{pathlib.Path(result.model).name}: decode under a memory cap\n(median, bars: min–max)", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=120)
    plt.close(fig)
    return buf.getvalue()


OUTPUT_NAMES = ("bench.json", "bench.png", "frontier.png")


def write_outputs(result: BenchResult, out_dir: pathlib.Path, replace: bool = False) -> list[pathlib.Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    # a new file, or with replace one renamed over the old (never through a symlink planted there, nothing
    # left of a failed write)
    json_name, png_name, frontier_name = OUTPUT_NAMES
    written.append(write_new(out_dir / json_name, json.dumps(result.as_dict(), indent=2) + "\n", replace))
    # the pictures too: rendered in memory, then written as the JSON is
    png = plot(result)
    if png is not None:
        written.append(write_new(out_dir / png_name, png, replace))
    png = None if result.quality is None else plot_frontier(result.rows, pathlib.Path(result.model).name)
    if png is not None:
        written.append(write_new(out_dir / frontier_name, png, replace))
    return written


def default_out_dir(model: str) -> pathlib.Path:
    stem = pathlib.Path(model).stem
    return pathlib.Path(f"bench-{stem}-{time.strftime('%Y%m%d-%H%M%S')}")


def check_out_dir(path: pathlib.Path, replace: bool = False) -> None:
    """Refuse an output folder with files in it, unless replace (then its results are replaced)."""
    if path.exists() and not path.is_dir():
        raise HobbitError(f"{path}: exists and is not a folder")
    if path.exists() and any(path.iterdir()) and not replace:
        raise HobbitError(f"{path}: the output folder exists and is not empty; bench replaces results only with "
                          "--force")
    for name in OUTPUT_NAMES:  # a symlink or a folder at a result's name: refused before the hours of measuring
        if os.path.lexists(path / name) and (why := new_output_error(path / name, replace)):
            raise HobbitError(why)
