"""The aarch64 wheel (a Jetson's, a Graviton's): cross-compiled and its libraries run under
qemu-user by scripts/check-aarch64.sh — its native unit tests pass, and an offloaded generation of the
shipped model equals stock llama.cpp's bit for bit on an emulated Armv8.2 (dot product,
FP16: a Jetson AGX Orin's class) and Armv8.0 core, each loading its own CPU variant."""

from __future__ import annotations

import pathlib
import re
import subprocess

import pytest

pytestmark = pytest.mark.slow  # minutes: run by `python -m pytest -m slow` (and CI)

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_aarch64_build_under_qemu_equals_stock(tmp_path):
    dist = tmp_path / "dist"
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "check-aarch64.sh"), str(dist)], capture_output=True,
                          text=True, timeout=3600)
    out = proc.stdout
    assert proc.returncode == 0, out[-3000:] + proc.stderr[-3000:]
    # the wheels a user on an aarch64 machine installs
    assert len(list(dist.glob("hobbitpy-*-py3-none-manylinux_*_aarch64.whl"))) == 1, sorted(dist.iterdir())
    assert len(list(dist.glob("llama_cpp_python-0.3.36-py3-none-*aarch64.whl"))) == 1, sorted(dist.iterdir())
    assert "all native tests passed" in out
    runs = re.findall(r"qemu-aarch64 -cpu (\S+):\nCPU backend: ([^\n]*)\n[^\n]*misses[^\n]*\n([^\n]*)", out)
    assert [cpu for cpu, _, _ in runs] == ["cortex-a76", "cortex-a53"], out[-3000:]
    for cpu, _, verdict in runs:
        assert verdict == "offloaded logits equal stock's bit for bit", (cpu, verdict)
    # each core got the variant its features allow: dot product on the A76, none on the A53
    assert "DOTPROD" in runs[0][1] and "DOTPROD" not in runs[1][1], runs
