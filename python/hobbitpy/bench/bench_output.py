"""What `hobbitpy bench` reports: each configuration's runs summarized (medians, min-max, the
disk bound, the decode time's split), the lines it prints as it goes, the PNGs, and the
output folder's files (bench.json, bench.png, frontier.png)."""

from __future__ import annotations

from dataclasses import dataclass, field
import io
import json
import os
import pathlib
import statistics
import time

from ..errors import HobbitError
from ..files.model_file import inspect_model
from ..settings.config import MB
from ..system.outputs import new_output_error, write_new
from .bench_plan import Cap, BenchConfig
from .frontier import plot_frontier

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


def _median(runs: list[dict], key: str):
    vals = [r[key] for r in runs if r.get(key) is not None]
    return statistics.median(vals) if vals else None


def summarize(name: str, runs: list[dict], disk_bw: float, stock_compute_s: float | None) -> dict:
    """A configuration's runs under one cap: medians, and the bound of the bytes read at the disk's
    speed measured around its runs (their median), else disk_bw (the invocation's start)."""
    ok = [r for r in runs if "error" not in r]
    s = {"config": name, "n_runs": len(runs), "errors": [r["error"] for r in runs if "error" in r]}
    if not ok:
        return s
    around = [r["disk_bytes_per_s"] for r in ok if r.get("disk_bytes_per_s")]
    disk_bw = statistics.median(around) if around else disk_bw
    s["disk_bytes_per_s"] = disk_bw
    s.update({
        "decode_tok_s": _median(ok, "decode_tok_s"),
        "all_decode_tok_s": [round(r["decode_tok_s"], 3) for r in ok if r.get("decode_tok_s")],
        "ttft_ms": {n: statistics.median(r["ttft_ms"][n] for r in ok) for n in ok[0]["ttft_ms"]},
        # each run's, in run order: a first token's time swings with the disk more than a decode's
        "all_ttft_ms": {n: [round(r["ttft_ms"][n]) for r in ok] for n in ok[0]["ttft_ms"]},
        "first_token_read_mb": (_median(ok, "first_token_disk_bytes") or 0) / MB,
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
        "default_lossy": bool(ok[0].get("default_lossy")),
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


def format_run(cap: Cap, cfg: BenchConfig, r: dict) -> str:
    head = f"run: cap {cap.label} {cfg.name}: "
    if "error" in r:
        return head + "failed: " + r["error"][:200]
    mb_read = r.get("decode_disk_bytes_per_token")
    tok_s = r.get("decode_tok_s")
    first_mb = r.get("first_token_disk_bytes")
    ttft = ", ".join(f"{int(n)}-token prompt {ms / 1000:.1f} s" for n, ms in r.get("ttft_ms", {}).items())
    return head + ((f"{tok_s:.3f} tok/s" if tok_s else "no decode") + f", load {r.get('load_s', 0.0):.1f} s"
                   + (f", first token after a {ttft}" if ttft else "")
                   + (f", {first_mb / MB:.0f} MB read to the first token" if first_mb is not None else "")
                   + (f", {mb_read / MB:.1f} MB read a token" if mb_read is not None else "")
                   + (f", peak {r['peak_bytes'] / MB:.0f} MB" if r.get("peak_bytes") else "")
                   + (f", disk {r['disk_bytes_per_s'] / 1e9:.2f} GB/s" if r.get("disk_bytes_per_s") else ""))


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
