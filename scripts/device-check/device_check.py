#!/usr/bin/env python3
"""The GPU steps of device-check.sh, with hobbitpy built and importable: test models written,
then exactness (hobbit-offload-check) and the table a GPU user would make (hobbit-gpu-bench),
results as JSON and a log in OUT.

    python3 device_check.py OUT [--no-gpu]

With --no-gpu (a machine without a GPU, e.g. CI) every step runs on the CPU build at a small
size, so that the script itself is tested before any GPU time is spent; its figures say nothing
about a GPU and the JSON says so.

Exactness: with one precision, hobbitpy's logits (expert pools in device memory, every layer on
the GPU) equal stock llama.cpp's (every layer on the GPU) bit for bit, on three architectures, at
the smallest cache and at 60 % of the experts' bytes, GPU-centric and cooperative.

The table: a Qwen3-30B-A3B-shaped model with fewer layers (its real expert count, width and
types: scripts/make_real_size_random_moe.py) and a device budget below its experts' bytes;
stock with every layer on the GPU (what no budget gives), `-ot exps=CPU`, `--n-cpu-moe N` with
the fewest CPU layers whose experts fit the budget, and hobbitpy's cache of that budget (one
precision; GPU-centric and cooperative); and hobbitpy's default (no option, every layer on the
GPU) with the GPU left only that much free by a process holding the rest, so that it plans by
it as on a smaller card (one run). Medians of REPEATS (default 3) interleaved runs, with
min-max; TABLE_LAYERS (default 12) sets the table model's depth (about 0.37 GB a layer).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time

import numpy as np

import hobbitpy
from hobbitpy.binding.native import LIB_DIR
from hobbitpy.files.model_file import inspect_model
from hobbitpy.files.synthetic_moe import make_synthetic_moe

HERE = pathlib.Path(__file__).resolve().parent
EXACT_ARCHES = ("qwen3moe", "llama", "deepseek2")  # top-k softmax with Q/K norms; Mixtral's; MLA, shared expert, groups
BUDGET_SHARES = (0.0, 0.6)  # 0: the smallest cache (one token's top-k per layer)
MODES = ("gpu-centric", "cooperative")
TABLE_SHARE = 0.4           # the device budget for experts, as a share of their bytes (e.g. 2 GB for 5 GB)
CONTEXT_ROOM = 1 << 30      # what the default's run is left on the GPU beside weights and that budget (its context)
# a process of torch's (the GPU machine's image has it) holding all of the GPU's free memory but
# argv[1] bytes, until killed: the GPU as small as the table's budget, for hobbitpy's default to plan by
HOLD_GPU_MEMORY = """
import sys, time, torch
free, _ = torch.cuda.mem_get_info()
held = torch.empty(max(0, free - int(sys.argv[1])), dtype=torch.uint8, device="cuda")
print(torch.cuda.mem_get_info()[0], flush=True)
time.sleep(3600)
"""


def log_line(log, text: str) -> None:
    print(text, flush=True)
    log.write(text + "\n")
    log.flush()


def run(cmd: list[str], timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def exactness(models: dict[str, pathlib.Path], on_gpu_expected: bool, log) -> list[dict]:
    rows = []
    for arch, path in models.items():
        for share in BUDGET_SHARES:
            for mode in MODES:
                proc = run([str(LIB_DIR / "hobbit-offload-check"), str(path), "8", "--share", str(share), "--mode", mode],
                           timeout=300)
                out = (proc.stdout + proc.stderr).strip().splitlines()
                report = " ".join(out)
                # on a GPU the pools must have lived in device memory: a CUDA module that did not load
                # (no driver, no runtime library) runs everything on the CPU, equal but not the check
                on_gpu = not on_gpu_expected or " on CUDA" in report
                row = {"arch": arch, "share": share, "mode": mode, "equal": proc.returncode == 0 and on_gpu,
                       "rc": proc.returncode, "pools_on_gpu": " on CUDA" in report, "report": out[-2:] if out else []}
                rows.append(row)
                verdict = "equal" if row["equal"] else "NOT EQUAL" if proc.returncode else "equal, but NOT ON THE GPU"
                log_line(log, f"exactness {arch} share {share} {mode}: {verdict} "
                              f"(rc {proc.returncode}) {' | '.join(row['report'])}")
    return rows


def table_configs(path: pathlib.Path) -> tuple[list[str], dict]:
    info = inspect_model(path)
    experts = info.expert_bytes_total
    budget = int(TABLE_SHARE * experts)
    per_layer = experts / info.n_layer_moe
    gpu_layers = int(budget // per_layer)           # MoE layers whose experts fit the budget
    n_cpu_moe = info.n_layer - min(gpu_layers, info.n_layer_moe)  # llama.cpp counts blocks from the first
    mb = budget // 2**20
    configs = ["stock", "exps-cpu", f"n-cpu-moe={n_cpu_moe}", f"hobbit={mb}:gpu-centric", f"hobbit={mb}:cooperative"]
    facts = {"model": path.name, "file_bytes": info.file_bytes, "expert_bytes": experts,
             "expert_budget_bytes": budget, "n_layer": info.n_layer, "n_layer_moe": info.n_layer_moe,
             "n_expert": info.n_expert, "n_expert_used": info.n_expert_used, "n_cpu_moe": n_cpu_moe}
    return configs, facts


def speed_table(path: pathlib.Path, repeats: int, prompt: int, decode: int, threads: int, log) -> dict:
    configs, facts = table_configs(path)
    log_line(log, f"table on {path.name}: {json.dumps(facts)}")
    runs: dict[str, list[dict]] = {c: [] for c in configs}
    errors: dict[str, str] = {}
    for r in range(repeats):  # interleaved: each round runs every configuration once
        for c in configs:
            if c in errors:
                continue
            proc = run([str(LIB_DIR / "hobbit-gpu-bench"), str(path), c, "--prompt", str(prompt),
                        "--decode", str(decode), "--threads", str(threads)], timeout=600)
            if proc.returncode != 0:
                errors[c] = (proc.stderr or proc.stdout).strip()[-500:]
                log_line(log, f"  {c}: FAILED (rc {proc.returncode}) {errors[c]}")
                continue
            runs[c].append(json.loads(proc.stdout.strip().splitlines()[-1]))
            log_line(log, f"  round {r + 1} {c}: {proc.stdout.strip().splitlines()[-1]}")
    rows = []
    for c in configs:
        got = runs[c]
        if not got:
            rows.append({"config": c, "error": errors.get(c, "no run")})
            continue
        row = {"config": c, "runs": len(got)}
        for key in ("decode_tok_s", "prefill_tok_s"):
            values = [g[key] for g in got]
            row[key] = {"median": statistics.median(values), "min": min(values), "max": max(values)}
        last = got[-1]
        for key in ("device_bytes_used", "pool_device", "decode_hit_ratio", "decode_bytes_loaded_per_token",
                    "logits_hash"):
            row[key] = last[key]
        rows.append(row)
    stock_hash = next((r.get("logits_hash") for r in rows if r["config"] == "stock"), None)
    for row in rows:
        if "logits_hash" in row:
            row["logits_equal_stock"] = row["logits_hash"] == stock_hash
    return {"facts": facts, "rows": rows, "prompt_tokens": prompt, "decode_tokens": decode, "repeats": repeats}


def default_row(path: pathlib.Path, leave_bytes: int | None, prompt: int, decode: int, threads: int, log) -> dict:
    """hobbitpy's default (hobbitpy.Llama with every layer on the GPU and no option), timed as
    hobbit-gpu-bench times a configuration, with the GPU left leave_bytes free by a process
    holding the rest (None: no GPU, nothing held)."""
    holder = None
    row = {"config": "hobbitpy default"}
    try:
        if leave_bytes is not None:
            holder = subprocess.Popen([sys.executable, "-c", HOLD_GPU_MEMORY, str(leave_bytes)],
                                      stdout=subprocess.PIPE, text=True)
            row["gpu_free_bytes"] = int(holder.stdout.readline())
        t0 = time.time()
        llm = hobbitpy.Llama(str(path), n_gpu_layers=-1, n_ctx=prompt + decode + 16, n_batch=prompt,
                             n_threads=threads, verbose=False)
        row["load_s"] = round(time.time() - t0, 2)
        try:
            row["plan"] = llm.offload_plan.reason
            tokens = [int(t) for t in np.random.default_rng(0).integers(0, llm.n_vocab(), prompt)]
            t0 = time.time()
            llm.eval(tokens)
            row["prefill_tok_s"] = prompt / (time.time() - t0)
            after_prompt = llm.offload_stats()
            t0 = time.time()
            for _ in range(decode):
                llm.eval([int(np.argmax(llm.last_logits()))])
            row["decode_tok_s"] = decode / (time.time() - t0)
            stats = llm.offload_stats()
            hits, misses = (stats["expert_hits"] - after_prompt["expert_hits"],
                            stats["expert_misses"] - after_prompt["expert_misses"])
            row.update(offloaded=llm.offloaded, pool_device=stats.get("pool_device"),
                       decode_hit_ratio=hits / (hits + misses) if hits + misses else None,
                       decode_bytes_loaded_per_token=(stats["bytes_read"] - after_prompt["bytes_read"]) / decode)
        finally:
            llm.close()
    except Exception as e:  # noqa: BLE001 - the table records why the default did not run
        row["error"] = f"{type(e).__name__}: {e}"
    finally:
        if holder is not None:
            holder.kill()
            holder.wait()
    log_line(log, f"  {json.dumps(row)}")
    return row


def markdown(table: dict) -> str:
    lines = ["| configuration | decode tok/s | prefill tok/s | device memory | hit ratio | loaded / token | logits = stock |",
             "|---|---|---|---|---|---|---|"]
    for r in table["rows"]:
        if "error" in r:
            lines.append(f"| {r['config']} | failed: {r['error'][:80]} | | | | | |")
            continue
        d, p = r["decode_tok_s"], r["prefill_tok_s"]
        mem = r["device_bytes_used"]
        hit = r["decode_hit_ratio"]
        loaded = r["decode_bytes_loaded_per_token"]
        lines.append(f"| {r['config']} | {d['median']:.2f} ({d['min']:.2f}-{d['max']:.2f}) | "
                     f"{p['median']:.1f} ({p['min']:.1f}-{p['max']:.1f}) | "
                     f"{'n/a' if mem < 0 else f'{mem / 2**20:.0f} MiB'} | {'-' if hit is None else f'{hit:.3f}'} | "
                     f"{'-' if loaded is None else f'{loaded / 2**20:.1f} MiB'} | {'yes' if r['logits_equal_stock'] else 'no'} |")
    r = table.get("default")
    if r is not None:
        if "error" in r:
            lines.append(f"| hobbitpy default | failed: {r['error'][:80]} | | | | | |")
        else:
            hit, loaded = r.get("decode_hit_ratio"), r.get("decode_bytes_loaded_per_token")
            left = r.get("gpu_free_bytes")
            how = "offloaded" if r["offloaded"] else "every expert resident"
            lines.append(f"| hobbitpy default ({how}) | {r['decode_tok_s']:.2f} | {r['prefill_tok_s']:.1f} | "
                         f"{'-' if left is None else f'{left / 2**20:.0f} MiB left free'} | "
                         f"{'-' if hit is None else f'{hit:.3f}'} | "
                         f"{'-' if not loaded else f'{loaded / 2**20:.1f} MiB'} | - |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=pathlib.Path)
    ap.add_argument("--no-gpu", action="store_true", help="the CPU half only, at a small size")
    ap.add_argument("--models", type=pathlib.Path, help="where the test models are written (default OUT/models)")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    models_dir = a.models or a.out / "models"
    models_dir.mkdir(parents=True, exist_ok=True)
    started = time.time()
    with open(a.out / "device-check.log", "w") as log:
        log_line(log, f"device check, {'no GPU (CPU half only)' if a.no_gpu else 'GPU'}; libraries {LIB_DIR}")
        small = {arch: make_synthetic_moe(models_dir / f"exact-{arch}.gguf", arch, n_layer=4, n_expert=16,
                                          n_expert_used=4, n_embd=256, n_ff=512, n_ff_shared=512,
                                          expert_type="Q4_K", seed=1)
                 for arch in EXACT_ARCHES}
        exact = exactness(small, not a.no_gpu, log)
        log_line(log, f"exactness done ({time.time() - started:.0f} s in)")
        if a.no_gpu:
            table_model = make_synthetic_moe(models_dir / "table-qwen3moe.gguf", "qwen3moe", n_layer=6, n_expert=32,
                                             n_expert_used=8, n_embd=256, n_ff=256, expert_type="Q4_K", seed=2)
            table = speed_table(table_model, repeats=1, prompt=64, decode=8, threads=2, log=log)
        else:
            layers = int(os.environ.get("TABLE_LAYERS", "12"))
            table_model = models_dir / f"qwen3-30b-a3b-shape-{layers}-layers-Q4_K.gguf"
            if not table_model.exists():
                subprocess.run([sys.executable, str(HERE / "make_real_size_random_moe.py"), str(table_model),
                                "--n-layer", str(layers)], check=True, timeout=420)
            log_line(log, f"table model written ({time.time() - started:.0f} s in)")
            table = speed_table(table_model, repeats=int(os.environ.get("REPEATS", "3")), prompt=512, decode=32,
                                threads=os.cpu_count() or 16, log=log)
        facts = table["facts"]
        leave = None if a.no_gpu else (facts["file_bytes"] - facts["expert_bytes"] + facts["expert_budget_bytes"]
                                       + CONTEXT_ROOM)
        table["default"] = default_row(table_model, leave, table["prompt_tokens"], table["decode_tokens"],
                                       2 if a.no_gpu else os.cpu_count() or 16, log)
        md = markdown(table)
        log_line(log, md)
        result = {"gpu": not a.no_gpu, "exactness": exact, "exact_all_equal": all(r["equal"] for r in exact),
                  "table": table, "table_markdown": md, "seconds": round(time.time() - started, 1)}
        (a.out / "device-check.json").write_text(json.dumps(result, indent=1) + "\n")
        log_line(log, f"exactness: {sum(r['equal'] for r in exact)} of {len(exact)} equal; "
                      f"{time.time() - started:.0f} s")
    table_ok = all("error" not in r for r in [*table["rows"], table["default"]])
    if not a.no_gpu:  # the table is a GPU's only where the pools and stock's layers were on it
        table_ok = table_ok and all(r.get("pool_device", "").startswith("CUDA") for r in table["rows"]
                                    if r["config"].startswith("hobbit"))
        table_ok = table_ok and all(r.get("device_bytes_used", 0) > 0 for r in table["rows"] if r["config"] == "stock")
    return 0 if result["exact_all_equal"] and table_ok else 1


if __name__ == "__main__":
    sys.exit(main())
