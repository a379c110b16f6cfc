"""The wheel a user installs: built by scripts/build-wheels.sh, installed from binaries only
into a fresh Python 3.10 virtual environment (not editable, no source tree on the path),
where the exactness and native tests pass against it."""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys
import time
import zipfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
# the oldest Python the package supports (pyproject.toml); the suite itself runs on another
OLDEST_PYTHON = "python3.10"


def _oldest_python() -> str | None:
    """An interpreter of OLDEST_PYTHON: on the PATH, or one pyenv has installed but not enabled."""
    pyenv_root = pathlib.Path(os.environ.get("PYENV_ROOT", pathlib.Path.home() / ".pyenv"))
    candidates = [shutil.which(OLDEST_PYTHON), *sorted(pyenv_root.glob(f"versions/3.10*/bin/{OLDEST_PYTHON}"))]
    for exe in filter(None, candidates):
        probe = subprocess.run([str(exe), "-c", "import sys, venv; assert sys.version_info[:2] == (3, 10)"],
                               capture_output=True)
        if probe.returncode == 0:
            return str(exe)
    return None


def _run(cmd, **kw):
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, **kw)
    assert proc.returncode == 0, f"{cmd}:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return proc


def test_wheel_installs_without_a_compiler_and_is_exact(tmp_path):
    python_old = _oldest_python()
    assert python_old, f"{OLDEST_PYTHON} is not installed: the oldest supported Python cannot be tested"
    dist = tmp_path / "dist"
    _run(["bash", ROOT / "scripts" / "build-wheels.sh", dist], timeout=3600)

    wheels = sorted(dist.glob("hobbitpy-*.whl"))
    assert len(wheels) == 1, wheels
    wheel = wheels[0]
    # one wheel for every Python 3, with a manylinux tag auditwheel checked
    assert "-py3-none-manylinux_" in wheel.name, wheel.name
    names = zipfile.ZipFile(wheel).namelist()
    lib = {pathlib.PurePosixPath(n).name for n in names if n.startswith("hobbitpy/lib/")}
    assert {"libllama.so", "libggml.so", "libggml-base.so", "libhobbit.so", "hobbit-native-tests"} <= lib, lib
    # the CPU backend once per instruction-set level, the baseline among them
    variants = {n for n in lib if n.startswith("libggml-cpu-")}
    assert {"libggml-cpu-x64.so", "libggml-cpu-haswell.so", "libggml-cpu-skylakex.so"} <= variants, variants
    assert "libggml-cpu.so" not in lib  # no backend built for the building machine only
    assert any("libgomp" in n for n in names), "auditwheel did not bring OpenMP's runtime"

    venv = tmp_path / "venv"
    _run([python_old, "-m", "venv", venv])
    py = venv / "bin" / "python"
    # binaries only: pip refuses any source distribution, so nothing can be compiled
    t0 = time.monotonic()
    _run([py, "-m", "pip", "install", "--only-binary", ":all:", *sorted(dist.glob("*.whl")), "pytest"], timeout=900)
    print(f"installed {wheel.name} into a fresh {OLDEST_PYTHON} venv in {time.monotonic() - t0:.1f} s")

    # run from outside the source tree, with nothing of it on the path
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "LLAMA_CPP_LIB_PATH")}
    where = _run([py, "-c", "import hobbitpy, llama_cpp, sys; print(hobbitpy.__file__); print(sys.version_info[:2])"],
                 cwd=tmp_path, env=env).stdout.split("\n")
    assert where[0].startswith(str(venv)), where
    assert where[1] == "(3, 10)", where
    tests = ROOT / "tests"
    proc = _run([py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", tmp_path,
                 tests / "test_exactness.py", tests / "test_native.py", tests / "test_dropin.py"],
                cwd=tmp_path, env=env, timeout=1800)
    assert " passed" in proc.stdout and "skipped" not in proc.stdout, proc.stdout[-2000:]
    sys.stdout.write(proc.stdout[-400:])
