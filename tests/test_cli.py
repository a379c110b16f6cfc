"""hobbitpy run: the same greedy text offloaded and stock, statistics as JSON."""

from __future__ import annotations

import json
import subprocess
import sys

import hobbitpy
from conftest import MB, tiny_model

REQUIRED_STATS = ["n_prompt_tokens", "n_tokens", "prefill_ms", "decode_tok_s", "expert_hits",
                  "expert_misses", "bytes_read", "peak_pool_bytes", "budget_bytes"]


def run(*args):
    proc = subprocess.run([sys.executable, "-m", "hobbitpy", "run", *map(str, args)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return proc


def test_half_budget_prints_the_stock_greedy_text(model_dir, tmp_path):
    path = tiny_model(model_dir, "qwen2moe")
    info = hobbitpy.inspect_model(path)
    half_mb = f"{info.expert_bytes_total / 2 / MB:.4f}"
    common = [path, "--prompt", "The harbour at dawn", "-n", "24", "--temp", "0", "--threads", "2"]

    stock = run(*common, "--no-offload", "--stats-json", tmp_path / "stock.json")
    offl = run(*common, "--cache-mb", half_mb, "--mode", "gpu-centric", "--stats-json", tmp_path / "offload.json")
    assert len(stock.stdout.strip()) > 0
    assert offl.stdout == stock.stdout

    s = json.loads((tmp_path / "offload.json").read_text())
    for key in REQUIRED_STATS:
        assert key in s, key
    assert s["n_tokens"] == 24 and s["n_prompt_tokens"] > 0
    assert s["decode_tok_s"] > 0 and s["prefill_ms"] > 0
    assert s["expert_misses"] > 0 and s["bytes_read"] == s["expert_misses"] * info.expert_bytes
    assert 0 < s["peak_pool_bytes"] <= s["budget_bytes"] == int(float(half_mb) * MB)

    ref = json.loads((tmp_path / "stock.json").read_text())
    assert ref["offload"] is False and ref["bytes_read"] == 0


def test_budget_from_available_memory_keeps_a_small_model_resident(model_dir):
    # no --cache-mb: the budget comes from the memory available; a tiny model fits
    proc = run(tiny_model(model_dir, "llama"), "--prompt", "Hi", "-n", "2", "--temp", "0")
    assert "fit in the" in proc.stderr and "no offload" in proc.stderr


def test_available_memory_is_plausible():
    avail = hobbitpy.available_memory_bytes()
    total = int(open("/proc/meminfo").read().split("MemTotal:")[1].split()[0]) * 1024
    assert 0 < avail <= total


def test_plan_for_a_model_larger_than_memory():
    avail = hobbitpy.available_memory_bytes()
    expert = 64 * MB
    info = hobbitpy.ModelInfo(path="big.gguf", arch="llama", n_layer=32, n_layer_moe=32, n_expert=64,
                              n_expert_used=2, n_embd=4096, expert_bytes=expert,
                              expert_bytes_total=32 * 64 * expert, min_budget_bytes=2 * expert,
                              file_bytes=32 * 64 * expert + 512 * MB, uniform=True)
    plan = hobbitpy.plan_offload(info, hobbitpy.OffloadConfig(), context_bytes=64 * MB)
    assert plan.budget_bytes is not None
    assert info.min_budget_bytes <= plan.budget_bytes < avail - info.resident_bytes


def test_split_model_runs_without_offload():
    info = hobbitpy.ModelInfo(path="big-00001-of-00003.gguf", arch="llama", n_layer=2, n_layer_moe=2, n_expert=8,
                              n_expert_used=2, n_embd=64, expert_bytes=MB, expert_bytes_total=16 * MB,
                              min_budget_bytes=2 * MB, file_bytes=20 * MB, uniform=True, n_split=3)
    plan = hobbitpy.plan_offload(info, hobbitpy.OffloadConfig(cache_mb=8), context_bytes=64 * MB)
    assert plan.budget_bytes is None and "split into 3 files" in plan.reason


def test_default_model_runs_without_a_model_argument():
    # the shipped mixtral-style reference model (models/README.md) is the default
    proc = run("--prompt", "And God said", "-n", "24", "--temp", "0", "--cache-mb", "8")
    words = proc.stdout.split()
    assert len(words) >= 8, proc.stdout
    assert sum(w.strip(",.;:").isalpha() for w in words) >= len(words) // 2, proc.stdout
