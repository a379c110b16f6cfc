#!/usr/bin/env python3
"""Decode speed of stock llama.cpp and hobbitpy under the same memory cap, side by side.

Each run is a fresh `hobbitpy run` process inside a child memory cgroup (v1) whose
limit caps RSS and page cache together; the model file is dropped from the page
cache (posix_fadvise DONTNEED, this file only) before every run. Configurations are
interleaved, repeated, and reported as medians with the ratio to stock.

    python scripts/bench_capped.py MODEL.gguf --cap-mb 1400 1000 --repeats 3 -n 32

(A first, minimal version of what issue 4 turns into `hobbitpy bench`.)
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile

PROMPT = "The history of the lighthouse begins with"


def own_memory_cgroup() -> pathlib.Path:
    for line in pathlib.Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, rel = line.split(":", 2)
        if "memory" in controllers.split(","):
            return pathlib.Path("/sys/fs/cgroup/memory") / rel.lstrip("/")
    raise SystemExit("no cgroup v1 memory controller here; cannot cap memory")


def drop_from_page_cache(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def run_capped(cg: pathlib.Path, cap_bytes: int, args: list[str]) -> dict:
    (cg / "memory.limit_in_bytes").write_text(str(cap_bytes))
    (cg / "memory.max_usage_in_bytes").write_text("0")
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        stats_path = f.name

    def enter_cgroup():
        (cg / "tasks").write_text(str(os.getpid()))

    proc = subprocess.run([sys.executable, "-m", "hobbitpy", "run", *args, "--stats-json", stats_path],
                          preexec_fn=enter_cgroup, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"run failed ({' '.join(args)}):\n{proc.stderr[-2000:]}")
    stats = json.loads(pathlib.Path(stats_path).read_text())
    os.unlink(stats_path)
    stats["peak_cgroup_bytes"] = int((cg / "memory.max_usage_in_bytes").read_text())
    stats["text"] = proc.stdout
    return stats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--cap-mb", type=float, nargs="+", required=True, help="memory caps in MB")
    ap.add_argument("--cache-mb", type=float, default=None, help="hobbitpy expert budget (default: derived from the cap)")
    ap.add_argument("-n", type=int, default=32, help="tokens to generate")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", help="write all results as JSON")
    a = ap.parse_args()

    parent = own_memory_cgroup()
    cg = parent / f"hobbitpy-bench-{os.getpid()}"
    cg.mkdir()
    common = [a.model, "--prompt", PROMPT, "-n", str(a.n), "--temp", "0", "--threads", str(a.threads)]
    configs = {"stock": ["--no-offload"],
               "hobbitpy-lru": ["--cache-mb", str(a.cache_mb)] if a.cache_mb else []}
    results = []
    try:
        for cap_mb in a.cap_mb:
            runs = {name: [] for name in configs}
            for _ in range(a.repeats):
                for name, extra in configs.items():  # interleaved
                    drop_from_page_cache(a.model)
                    runs[name].append(run_capped(cg, int(cap_mb * 1024 * 1024), common + extra))
            row = {"cap_mb": cap_mb}
            for name, rs in runs.items():
                row[name] = {
                    "decode_tok_s": statistics.median(r["decode_tok_s"] for r in rs),
                    "prefill_ms": statistics.median(r["prefill_ms"] for r in rs),
                    "bytes_read_per_token": statistics.median(r["bytes_read"] / max(1, r["n_tokens"]) for r in rs),
                    "peak_cgroup_mb": max(r["peak_cgroup_bytes"] for r in rs) / 2**20,
                    "budget_mb": rs[0]["budget_bytes"] / 2**20,
                    "all_decode_tok_s": [round(r["decode_tok_s"], 3) for r in rs],
                }
            row["same_text"] = len({r["text"] for rs in runs.values() for r in rs}) == 1
            row["ratio_hobbitpy_to_stock"] = row["hobbitpy-lru"]["decode_tok_s"] / row["stock"]["decode_tok_s"]
            results.append(row)
            print(f"cap {cap_mb:7.0f} MB | stock {row['stock']['decode_tok_s']:7.2f} tok/s "
                  f"(peak {row['stock']['peak_cgroup_mb']:.0f} MB) | hobbitpy LRU {row['hobbitpy-lru']['decode_tok_s']:7.2f} tok/s "
                  f"(budget {row['hobbitpy-lru']['budget_mb']:.0f} MB, peak {row['hobbitpy-lru']['peak_cgroup_mb']:.0f} MB, "
                  f"{row['hobbitpy-lru']['bytes_read_per_token'] / 2**20:.1f} MB read/token) | "
                  f"ratio {row['ratio_hobbitpy_to_stock']:.2f}x | same text: {row['same_text']}", flush=True)
    finally:
        cg.rmdir()
    if a.out:
        pathlib.Path(a.out).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
