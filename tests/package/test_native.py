"""The runtime's C++ unit tests (store, pool, LRU, I/O scheduler), shipped as an
executable next to the libraries."""

import json
import subprocess

import pytest

from hobbitpy.binding.native import LIB_DIR
from conftest import ARCHES, tiny_model


def test_native_units(tmp_path):
    exe = LIB_DIR / "hobbit-native-tests"
    assert exe.exists(), f"{exe} is missing from the install"
    proc = subprocess.run([str(exe), str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "all native tests passed" in proc.stdout


@pytest.mark.parametrize("arch", ARCHES)
def test_offload_check_tool_finds_offloaded_logits_equal_stock(model_dir, arch):
    # the Python-free check a user runs on a device (docs/JETSON.md), as shipped in the wheel
    proc = subprocess.run([str(LIB_DIR / "hobbit-offload-check"), str(tiny_model(model_dir, arch)), "6"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.startswith("CPU backend: ")
    assert " on CPU (gpu-centric); " in proc.stdout  # where the pools lived (no GPU here) and the mode in effect
    assert proc.stdout.rstrip().endswith("offloaded logits equal stock's bit for bit")


def test_offload_check_tool_refuses_a_file_that_is_not_gguf(tmp_path):
    bad = tmp_path / "notes.gguf"
    bad.write_text("not a model")
    proc = subprocess.run([str(LIB_DIR / "hobbit-offload-check"), str(bad)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert str(bad) in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_offload_check_tool_at_a_share_of_the_experts_and_in_cooperative_mode(model_dir):
    # the device check's exactness runs (scripts/device-check/): a 60 % cache, where misses run
    proc = subprocess.run([str(LIB_DIR / "hobbit-offload-check"), str(tiny_model(model_dir, "qwen3moe")), "4",
                           "--share", "0.6", "--mode", "cooperative"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.rstrip().endswith("offloaded logits equal stock's bit for bit")
    for bad in (["--share", "1.5"], ["--mode", "fast"], ["--share"]):
        proc = subprocess.run([str(LIB_DIR / "hobbit-offload-check"), str(tiny_model(model_dir, "qwen3moe")), *bad],
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2 and proc.stderr.startswith("usage: "), (bad, proc.stderr)


def test_gpu_bench_tool_times_each_configuration_and_hobbit_keeps_stocks_logits(model_dir):
    # the device check's table (scripts/device-check/): one JSON line a configuration; on this CPU
    # build every configuration computes the same logits, the cache's included
    model = tiny_model(model_dir, "qwen3moe")
    rows = {}
    for config in ("stock", "exps-cpu", "n-cpu-moe=2", "hobbit=2", "hobbit=2:cooperative"):
        proc = subprocess.run([str(LIB_DIR / "hobbit-gpu-bench"), str(model), config, "--prompt", "16",
                               "--decode", "4", "--threads", "2"], capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, (config, proc.stdout + proc.stderr)
        rows[config] = json.loads(proc.stdout)
        assert rows[config]["decode_tok_s"] > 0 and rows[config]["prefill_tok_s"] > 0
    assert len({r["logits_hash"] for r in rows.values()}) == 1, rows
    assert rows["hobbit=2"]["pool_device"] == "CPU" and rows["hobbit=2"]["decode_misses"] > 0
    assert rows["stock"]["decode_hit_ratio"] is None and rows["stock"]["device_bytes_used"] == -1  # no GPU here
    for bad in ("n-cpu-moe=x", "hobbit=0", "hobbit=2:fast", "everything"):
        proc = subprocess.run([str(LIB_DIR / "hobbit-gpu-bench"), str(model), bad], capture_output=True, text=True,
                              timeout=60)
        assert proc.returncode == 2 and bad in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, (bad, proc.stderr)
