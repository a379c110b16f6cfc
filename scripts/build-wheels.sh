#!/usr/bin/env bash
# Build the wheels a user installs without a compiler, into DIST (default: dist/):
#   hobbitpy-<version>-py3-none-manylinux_<glibc>_<arch>.whl
#       the patched llama.cpp with ggml's CPU backend once per instruction-set level (the best
#       one this CPU runs is loaded at start), libhobbit and the Python package; one wheel
#       for every Python 3 (no CPython extension), repaired by auditwheel to the manylinux tag
#       this machine's glibc and libstdc++ allow (libgomp copied in);
#   llama_cpp_python-0.3.36-py3-none-<platform>.whl
#       llama-cpp-python's Python API only (LLAMA_BUILD=OFF: it runs on hobbitpy's library);
#       PyPI has only its source, whose default build compiles llama.cpp again.
# Install both with `pip install DIST/*.whl`. The build reuses the editable install's build
# directory (build/py3-none-linux_<arch>): after `pip install -e .` only the packaging runs.
#
#   scripts/build-wheels.sh [DIST]
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
dist="$(mkdir -p "${1:-$root/dist}" && cd "${1:-$root/dist}" && pwd)"
raw="$(mktemp -d)"
trap 'rm -rf "$raw"' EXIT
# the same arguments as the README's install command, so the build directory is reused as is
export CMAKE_ARGS="${CMAKE_ARGS:--DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF}"

python -m pip wheel "$root" --no-deps --no-build-isolation --wheel-dir "$raw"
python -m pip wheel "llama-cpp-python==0.3.36" --no-deps --no-build-isolation --no-binary llama-cpp-python \
    --wheel-dir "$raw"

# the manylinux tag: the oldest policy whose symbol versions cover the libraries'
python -m auditwheel repair --wheel-dir "$dist" "$raw"/hobbitpy-*.whl
cp "$raw"/llama_cpp_python-*.whl "$dist"/
ls -l "$dist"
