#!/usr/bin/env bash
# The CUDA wheel on this machine (no GPU, no NVIDIA driver): install it from binaries into a
# fresh venv, with the CUDA runtime and cuBLAS it requires from PyPI; check that its CUDA
# module's libraries resolve there (the driver, libcuda.so.1, is the one thing missing); that
# a run falls back to the CPU with one line; and that the test suite passes against it.
#
#   scripts/build-wheels.sh --cuda CUDA_HOME DIST && scripts/check-cuda-wheel.sh DIST
#
# The suite runs from this source tree's tests/ with the venv's Python (hobbitpy imported
# from the venv, not from python/), without the tests that build wheels themselves.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
dist="$(cd "${1:?usage: check-cuda-wheel.sh DIST}" && pwd)"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
python3 -m venv "$work/venv"
py="$work/venv/bin/python"
"$py" -m pip install -q -U pip
start=$(date +%s)
wheel=$(echo "$dist"/hobbitpy-*.whl)
"$py" -m pip install -q --only-binary :all: --find-links "$dist" "$wheel[test]"
echo "installed in $(( $(date +%s) - start )) s"

lib=$(cd "$work" && "$py" -c 'import hobbitpy.binding.native as n; print(n.LIB_DIR)')
echo "== ldd $lib/libggml-cuda.so"
ldd "$lib/libggml-cuda.so" | grep -E "cuda|cublas"
for so in libcudart.so.12 libcublas.so.12 libcublasLt.so.12; do
    ldd "$lib/libggml-cuda.so" | grep -q "$so => $work/venv/.*/nvidia/" ||
        { echo "check-cuda-wheel: $so does not resolve to PyPI's copy in the venv" >&2; exit 1; }
done

echo "== a run without a GPU"
(cd "$work" && "$py" -m hobbitpy run --prompt "The harbour at dawn" -n 8 --temp 0) 2> "$work/run.err"
cat "$work/run.err"
grep -q "^hobbitpy: no usable CUDA GPU (" "$work/run.err" || { echo "check-cuda-wheel: no fallback line" >&2; exit 1; }

echo "== the suite against the wheel"
env -u PYTHONPATH -u LLAMA_CPP_LIB_PATH "$py" -m pytest -q -p no:cacheprovider "$root/tests" \
    --ignore "$root/tests/package/test_wheel.py" --ignore "$root/tests/package/test_aarch64.py"
