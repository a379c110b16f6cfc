"""The GPU device check, everything of it that runs without a GPU: scripts/pack-device-check.sh
makes a folder that travels (at most 40 MiB, the pinned llama.cpp checked, patched and trimmed), and
its device-check.sh --no-gpu configures the CUDA build from that folder alone, compiles a part of it
with nvcc, and runs every step (test models, exactness on three architectures at two cache sizes in
both modes, the table's five configurations and hobbitpy's default) on this machine's build."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess

import pytest

pytestmark = pytest.mark.slow  # minutes: run by `python -m pytest -m slow` (and CI)

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_pack_then_device_check_without_a_gpu(tmp_path):
    bundle = tmp_path / "bundle"
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "pack-device-check.sh"), str(bundle)], capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == str(bundle)
    assert "mv " in proc.stdout and "models/*.gguf" in proc.stdout  # how to send it without the models
    size = sum(f.stat().st_size for f in bundle.rglob("*") if f.is_file())
    assert size <= 40 * 2**20, size
    for part in ("device-check.sh", "device_check.py", "make_real_size_random_moe.py", "hobbitpy/CMakeLists.txt",
                 "hobbitpy/native/tests/gpu-bench.cpp", "llama.cpp/ggml/src/ggml-cuda/mmid.cu",
                 "llama.cpp/hobbitpy-patched.stamp", "py/llama_cpp/llama.py", "py/gguf/gguf_reader.py"):
        assert (bundle / part).exists(), part
    assert not list((bundle / "hobbitpy").rglob("*.gguf"))  # the models stay behind
    assert not (bundle / "llama.cpp" / "ggml" / "src" / "ggml-vulkan").exists()
    assert {w.name.split("-")[0] for w in (bundle / "wheels").glob("*.whl")} == {"cffi", "pycparser", "diskcache"}

    out = tmp_path / "out"
    env = dict(os.environ, WORK=str(tmp_path / "work"))
    proc = subprocess.run(["bash", str(bundle / "device-check.sh"), str(out), "--no-gpu"], capture_output=True,
                          text=True, timeout=1800, env=env)
    build_log = (out / "build.log").read_text() if (out / "build.log").exists() else ""
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:] + build_log[-3000:]
    assert "Building CUDA object" in build_log and "mmid.cu.o" in build_log  # nvcc compiled the patched kernel
    result = json.loads((out / "device-check.json").read_text())
    assert result["gpu"] is False
    assert {(r["arch"], r["share"], r["mode"]) for r in result["exactness"]} == {
        (a, s, m) for a in ("qwen3moe", "llama", "deepseek2") for s in (0.0, 0.6) for m in ("gpu-centric", "cooperative")}
    assert result["exact_all_equal"], result["exactness"]
    rows = {r["config"].split("=")[0]: r for r in result["table"]["rows"]}
    assert set(rows) == {"stock", "exps-cpu", "n-cpu-moe", "hobbit"} and len(result["table"]["rows"]) == 5
    assert all(r["logits_equal_stock"] for r in result["table"]["rows"]), result["table"]["rows"]
    assert rows["hobbit"]["decode_hit_ratio"] is not None and rows["hobbit"]["pool_device"] == "CPU"
    # hobbitpy's default as the API runs it (here the host's memory holds every expert: stock's path)
    default = result["table"]["default"]
    assert "error" not in default and default["decode_tok_s"] > 0 and default["offloaded"] is False, default
    assert "| configuration | decode tok/s |" in (out / "device-check.log").read_text()


def test_device_check_without_a_gpu_or_the_flag_says_so(tmp_path):
    # on a machine with no NVIDIA GPU, the GPU run stops at once with one line (exit 2)
    script = ROOT / "scripts" / "device-check" / "device-check.sh"
    env = dict(os.environ, WORK=str(tmp_path / "work"), PATH="/usr/bin:/bin")
    proc = subprocess.run(["bash", str(script), str(tmp_path / "out")], capture_output=True, text=True, timeout=120,
                          env=env)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "no NVIDIA GPU here" in proc.stdout
