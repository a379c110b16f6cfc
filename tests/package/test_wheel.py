"""The wheel a user installs: built by scripts/build-wheels.sh, installed from binaries only
into fresh virtual environments of the oldest and the newest supported Python (not
editable, no source tree on the path), where the exactness, native and drop-in tests pass
against it. (The suite itself runs on a third.)"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys
import time
import zipfile

import pytest

pytestmark = pytest.mark.slow  # minutes: run by `python -m pytest -m slow` (and CI)

ROOT = pathlib.Path(__file__).resolve().parents[2]
# the oldest Python pyproject.toml allows, and the newest released when it was written
PYTHONS = ["3.10", "3.13"]


def _python(version: str) -> str | None:
    """An interpreter of that version: on the PATH, or one pyenv has installed but not enabled."""
    pyenv_root = pathlib.Path(os.environ.get("PYENV_ROOT", pathlib.Path.home() / ".pyenv"))
    name = f"python{version}"
    candidates = [shutil.which(name), *sorted(pyenv_root.glob(f"versions/{version}.*/bin/{name}"))]
    for exe in filter(None, candidates):
        probe = subprocess.run([str(exe), "-c", f"import sys, venv; assert sys.version_info[:2] == ({version.replace('.', ', ')})"],
                               capture_output=True)
        if probe.returncode == 0:
            return str(exe)
    return None


def _run(cmd, **kw):
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, **kw)
    assert proc.returncode == 0, f"{cmd}:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return proc


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> pathlib.Path:
    out = tmp_path_factory.mktemp("dist")
    _run(["bash", ROOT / "scripts" / "build-wheels.sh", out], timeout=3600)
    return out


def test_wheel_holds_every_cpu_variant_and_a_manylinux_tag(dist):
    wheels = sorted(dist.glob("hobbitpy-*.whl"))
    assert len(wheels) == 1, wheels
    # one wheel for every Python 3, with a manylinux tag auditwheel checked
    assert "-py3-none-manylinux_" in wheels[0].name, wheels[0].name
    names = zipfile.ZipFile(wheels[0]).namelist()
    lib = {pathlib.PurePosixPath(n).name for n in names if n.startswith("hobbitpy/lib/")}
    assert {"libllama.so", "libggml.so", "libggml-base.so", "libhobbit.so", "hobbit-native-tests",
            "hobbit-offload-check"} <= lib, lib
    # the CPU backend once per instruction-set level, the baseline among them
    variants = {n for n in lib if n.startswith("libggml-cpu-")}
    assert {"libggml-cpu-x64.so", "libggml-cpu-haswell.so", "libggml-cpu-skylakex.so"} <= variants, variants
    assert "libggml-cpu.so" not in lib  # no backend built for the building machine only
    assert any("libgomp" in n for n in names), "auditwheel did not bring OpenMP's runtime"
    assert "hobbitpy/data/calibration.txt" in names  # the default ladder's calibration text
    assert len(list(dist.glob("llama_cpp_python-0.3.36-py3-none-*.whl"))) == 1


@pytest.mark.parametrize("version", PYTHONS)
def test_wheel_installs_without_a_compiler_and_is_exact(dist, tmp_path, version):
    python = _python(version)
    assert python, f"Python {version} is not installed: a supported Python cannot be tested"
    venv = tmp_path / "venv"
    _run([python, "-m", "venv", venv])
    py = venv / "bin" / "python"
    # binaries only: pip refuses any source distribution, so nothing can be compiled
    t0 = time.monotonic()
    _run([py, "-m", "pip", "install", "--only-binary", ":all:", *sorted(dist.glob("*.whl")), "pytest"], timeout=900)
    print(f"installed the wheels into a fresh Python {version} venv in {time.monotonic() - t0:.1f} s")

    # run from outside the source tree, with nothing of it on the path
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "LLAMA_CPP_LIB_PATH")}
    where = _run([py, "-c", "import hobbitpy, llama_cpp, sys; print(hobbitpy.__file__); print(sys.version_info[:2])"],
                 cwd=tmp_path, env=env).stdout.split("\n")
    assert where[0].startswith(str(venv)), where
    assert where[1] == repr(tuple(int(x) for x in version.split("."))), where
    tests = ROOT / "tests"
    # (--confcutdir: tests/conftest.py, above the files' folders, is loaded though the root is elsewhere)
    proc = _run([py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", tmp_path, "--confcutdir", tests,
                 tests / "runtime" / "test_exactness.py", tests / "package" / "test_native.py",
                 tests / "runtime" / "test_dropin.py"],
                cwd=tmp_path, env=env, timeout=1800)
    assert " passed" in proc.stdout and "skipped" not in proc.stdout, proc.stdout[-2000:]
    sys.stdout.write(proc.stdout[-400:])
