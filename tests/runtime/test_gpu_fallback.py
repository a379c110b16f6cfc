"""A GPU build on a machine without a GPU: the CPU path, the same results, one clear line.

A CUDA wheel ships ggml's CUDA backend as a module beside libggml. Without NVIDIA's driver
it cannot load (libcuda.so.1 is missing) and ggml's loader says nothing. The module here
stands in for it the way such a machine sees it: a library that needs libcuda.so.1. The
real module built by scripts/build-wheels.sh --cuda fails the same way (docs/JETSON.md).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

from conftest import tiny_model
from hobbitpy.binding.native import LIB_DIR


def _module_needing_the_driver(tmp_path, lib_dir):
    """libggml-cuda.so in lib_dir, linked against a libcuda.so.1 that is then gone."""
    stub = tmp_path / "driver-stub"
    stub.mkdir()
    (tmp_path / "empty.c").write_text("int hobbitpy_stub;\n")
    for cmd in (["cc", "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", str(stub / "libcuda.so"), str(tmp_path / "empty.c")],
                ["cc", "-shared", "-fPIC", "-Wl,--no-as-needed", "-o", str(lib_dir / "libggml-cuda.so"),
                 str(tmp_path / "empty.c"), f"-L{stub}", "-lcuda"]):
        cc = subprocess.run(cmd, capture_output=True, text=True)
        assert cc.returncode == 0, cc.stderr
    shutil.rmtree(stub)


def _run(model, lib_dir, *flags):
    env = {k: v for k, v in os.environ.items() if k not in ("LLAMA_CPP_LIB_PATH", "LD_LIBRARY_PATH")}
    env["HOBBITPY_LIB_DIR"] = str(lib_dir)
    return subprocess.run([sys.executable, "-m", "hobbitpy", "run", str(model), "--prompt", "The harbour at dawn",
                           "-n", "12", "--temp", "0", "--threads", "2", *flags],
                          capture_output=True, text=True, env=env, timeout=300)


def _gpu_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "GPU" in line]


def test_a_gpu_build_without_a_gpu_runs_on_the_cpu_with_one_line(model_dir, tmp_path):
    path = tiny_model(model_dir, "llama")
    # (with what an installed wheel keeps two levels up, where the libraries' RPATH finds it:
    # auditwheel's copy of libgomp)
    lib_dir = tmp_path / "hobbitpy" / "lib"
    shutil.copytree(LIB_DIR, lib_dir)
    grafted = LIB_DIR.parent.parent / "hobbitpy.libs"
    if grafted.is_dir():
        shutil.copytree(grafted, tmp_path / "hobbitpy.libs")
    for shipped in lib_dir.glob("libggml-cuda*.so"):  # a CUDA wheel's own module: the CPU build first
        shipped.unlink()
    cpu = _run(path, lib_dir)
    assert cpu.returncode == 0 and _gpu_lines(cpu.stderr) == [], cpu.stderr

    _module_needing_the_driver(tmp_path, lib_dir)
    gpu = _run(path, lib_dir)
    assert gpu.returncode == 0, gpu.stderr
    assert _gpu_lines(gpu.stderr) == ["hobbitpy: no usable CUDA GPU (libcuda.so.1: cannot open shared object file: "
                                      "No such file or directory): running on the CPU"]
    assert gpu.stdout == cpu.stdout and gpu.stdout.startswith("The harbour at dawn")
    # a note like the others: -q keeps only errors
    quiet = _run(path, lib_dir, "-q")
    assert quiet.returncode == 0 and quiet.stderr == "" and quiet.stdout == cpu.stdout, quiet.stderr
