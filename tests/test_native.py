"""The runtime's C++ unit tests (store, pool, LRU, I/O scheduler), shipped as an
executable next to the libraries."""

import subprocess

from hobbitpy._native import LIB_DIR


def test_native_units(tmp_path):
    exe = LIB_DIR / "hobbit-native-tests"
    assert exe.exists(), f"{exe} is missing from the install"
    proc = subprocess.run([str(exe), str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "all native tests passed" in proc.stdout
