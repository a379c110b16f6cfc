"""The runtime's C++ unit tests (store, pool, LRU, I/O scheduler), shipped as an
executable next to the libraries."""

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
    assert " on CPU; " in proc.stdout  # where the pools lived: no GPU here
    assert proc.stdout.rstrip().endswith("offloaded logits equal stock's bit for bit")


def test_offload_check_tool_refuses_a_file_that_is_not_gguf(tmp_path):
    bad = tmp_path / "notes.gguf"
    bad.write_text("not a model")
    proc = subprocess.run([str(LIB_DIR / "hobbit-offload-check"), str(bad)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert str(bad) in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
