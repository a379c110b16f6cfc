#!/usr/bin/env bash
# The native code under AddressSanitizer and UndefinedBehaviorSanitizer (float-to-integer
# overflow included): builds libhobbit and the patched llama.cpp with them, runs the native
# unit tests, then a slice of the Python tests against those libraries. Any report fails
# the run (halt_on_error). Takes ~25 minutes on 2 cores; run before each release, and write
# the result in docs/RELIABILITY.md.
# Usage: scripts/check-sanitizers.sh [BUILD_DIR] [PYTEST_ARGS...]
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
build=${1:-$root/build/sanitize}
shift || true
tests=("$@")
[ ${#tests[@]} -gt 0 ] || tests=(tests/test_exactness.py tests/test_bad_input.py tests/test_mixed_precision.py
                                 tests/test_cooperative.py tests/test_placement.py tests/test_api.py tests/test_native.py
                                 tests/test_allocation.py tests/test_overlap.py tests/test_substitution.py
                                 tests/test_fiddler.py tests/test_beam_search.py)
flags="-fsanitize=address,undefined,float-cast-overflow -fno-sanitize-recover=all -fno-omit-frame-pointer -g -O1"

cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DHOBBITPY_PORTABLE=OFF -DGGML_NATIVE=ON \
    "-DCMAKE_C_FLAGS=$flags" "-DCMAKE_CXX_FLAGS=$flags" \
    "-DCMAKE_EXE_LINKER_FLAGS=-fsanitize=address,undefined" "-DCMAKE_SHARED_LINKER_FLAGS=-fsanitize=address,undefined"
cmake --build "$build" -j "$(nproc)"
prefix="$build/_install"
cmake --install "$build" --component hobbitpy --prefix "$prefix" >/dev/null

# Python is not built with ASan: the runtime is preloaded; leaks are not checked (the
# interpreter keeps its objects at exit), every other report halts the process
export ASAN_OPTIONS=detect_leaks=0:halt_on_error=1:abort_on_error=1:symbolize=1
export UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1
export HOBBITPY_LIB_DIR="$prefix/hobbitpy/lib"
export LLAMA_CPP_LIB_PATH="$HOBBITPY_LIB_DIR"

echo "== native unit tests (sanitized)"
"$HOBBITPY_LIB_DIR/hobbit-native-tests"

echo "== Python tests against the sanitized libraries"
cd "$root"
LD_PRELOAD="$(gcc -print-file-name=libasan.so):$(gcc -print-file-name=libubsan.so)" \
    python -m pytest -q -p no:cacheprovider "${tests[@]}"
echo "sanitizers: no report ($build)"
