"""The environment the README's install command makes holds what the suite's scripts build
with: scripts/build-wheels.sh (run by test_wheel.py and test_aarch64.py) builds without
build isolation, so the build backend [build-system] names must be installed by the install
command itself, not left over from an earlier build or installed on the machine by hand.
(.ci/run makes a new venv for the same reason.)"""

from __future__ import annotations

import importlib.metadata
import pathlib
import re
import shutil
import subprocess
import tomllib

from packaging.requirements import Requirement
from packaging.version import Version

ROOT = pathlib.Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_the_build_backend_comes_from_the_test_extra_and_is_installed():
    test_extra = {Requirement(r).name: Requirement(r) for r in PYPROJECT["project"]["optional-dependencies"]["test"]}
    for spec in PYPROJECT["build-system"]["requires"]:
        need = Requirement(spec)
        assert need.name in test_extra, f"{need.name} (the build backend) is not in the [test] extra"
        assert test_extra[need.name].specifier == need.specifier, (test_extra[need.name], need)
        try:
            have = importlib.metadata.version(need.name)
        except importlib.metadata.PackageNotFoundError:
            raise AssertionError(f"{need.name} is not installed here: scripts/build-wheels.sh cannot build") from None
        assert need.specifier.contains(have, prereleases=True), f"{need.name} {have} does not satisfy {spec}"
    backend = PYPROJECT["build-system"]["build-backend"]
    importlib.import_module(backend)


def test_cmake_on_the_path_is_as_new_as_the_build_asks():
    cmake = shutil.which("cmake")
    assert cmake, "no cmake on the PATH: scripts/build-wheels.sh cannot build"
    out = subprocess.run([cmake, "--version"], capture_output=True, text=True, check=True).stdout
    have = Version(re.search(r"version (\d+\.\d+(\.\d+)?)", out).group(1))
    need = PYPROJECT["tool"]["scikit-build"]["cmake"]["version"]
    assert Requirement(f"cmake{need}").specifier.contains(have), f"cmake {have} on the PATH, the build asks {need}"
