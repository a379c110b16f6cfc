#!/usr/bin/env bash
# The native code under AddressSanitizer and UndefinedBehaviorSanitizer (float-to-integer
# overflow included): builds libhobbit and the patched llama.cpp with them, runs the native
# unit tests and the offload check (C++ executables: leaks checked too), then a slice of the
# Python tests against those libraries. Any report fails the run (halt_on_error). Takes ~25
# minutes to build on 2 cores and ~15 to test; run before each release, and write the result
# in docs/RELIABILITY.md. Data races: scripts/check-thread-sanitizer.sh.
# Usage: scripts/check-sanitizers.sh [BUILD_DIR] [PYTEST_ARGS...]
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
build=${1:-$root/build/sanitize}
shift || true
tests=("$@")
[ ${#tests[@]} -gt 0 ] || tests=(tests/runtime/test_exactness.py tests/files/test_bad_input.py tests/offload/test_mixed_precision.py
                                 tests/offload/test_cooperative.py tests/offload/test_placement.py tests/runtime/test_api.py tests/package/test_native.py
                                 tests/offload/test_shallow_layers.py tests/offload/test_overlap.py tests/offload/test_substitution.py
                                 tests/offload/test_fiddler.py tests/runtime/test_beam_search.py tests/files/test_fuzz_gguf.py
                                 tests/commands/test_serve.py tests/offload/test_neuron_reads.py)
flags="-fsanitize=address,undefined,float-cast-overflow -fno-sanitize-recover=all -fno-omit-frame-pointer -g -O1"

cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DHOBBITPY_PORTABLE=OFF -DGGML_NATIVE=ON \
    "-DCMAKE_C_FLAGS=$flags" "-DCMAKE_CXX_FLAGS=$flags" \
    "-DCMAKE_EXE_LINKER_FLAGS=-fsanitize=address,undefined" "-DCMAKE_SHARED_LINKER_FLAGS=-fsanitize=address,undefined"
cmake --build "$build" -j "$(nproc)"
prefix="$build/_install"
cmake --install "$build" --component hobbitpy --prefix "$prefix" >/dev/null

# this run's models, reports and pytest's folders (its own: a concurrent pytest session prunes
# all but the newest three under /tmp/pytest-of-$USER, models in use included)
work="$build/check"
rm -rf "$work" && mkdir -p "$work/models" "$work/reports"
# a report goes to a file: pytest captures stderr, and loses it when the process aborts
show_reports() {
    for f in "$work"/reports/*; do
        [ -e "$f" ] && { echo "== report $f"; cat "$f"; }
    done
    return 0
}
trap show_reports EXIT

export UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1:log_path=$work/reports/ubsan
export HOBBITPY_LIB_DIR="$prefix/hobbitpy/lib"
export LLAMA_CPP_LIB_PATH="$HOBBITPY_LIB_DIR"
preload="$(gcc -print-file-name=libasan.so):$(gcc -print-file-name=libubsan.so)"
asan=halt_on_error=1:abort_on_error=1:symbolize=1:log_path=$work/reports/asan

# the C++ executables own every allocation they make: a block still unreachable at exit is a leak
echo "== native unit tests (sanitized, leaks checked)"
ASAN_OPTIONS=$asan:detect_leaks=1 "$HOBBITPY_LIB_DIR/hobbit-native-tests" "$work"

echo "== offload check: runtime, API and patched llama.cpp (sanitized, leaks checked)"
cd "$root"
arches=(llama qwen2moe gpt-oss)
LD_PRELOAD="$preload" ASAN_OPTIONS=$asan:detect_leaks=0 python -c '
import sys
from hobbitpy.binding.native import DATA_DIR
from hobbitpy.files.synthetic_moe import make_synthetic_moe
for arch in sys.argv[2:]:
    make_synthetic_moe(f"{sys.argv[1]}/{arch}.gguf", arch, vocab_gguf=DATA_DIR / "ggml-vocab-llama-spm.gguf")' \
    "$work/models" "${arches[@]}"
for arch in "${arches[@]}"; do
    ASAN_OPTIONS=$asan:detect_leaks=1 "$HOBBITPY_LIB_DIR/hobbit-offload-check" "$work/models/$arch.gguf" 6
done

# The slow tests of the slice run too (the fuzz test is one). Python is not built with ASan:
# the runtime is preloaded. Leaks are not checked there: the interpreter keeps its objects at
# exit, and a suppression of CPython's frames would match every stack (each call into the
# libraries passes through them) and hide ours too
echo "== Python tests against the sanitized libraries"
LD_PRELOAD="$preload" ASAN_OPTIONS=$asan:detect_leaks=0 \
    python -m pytest -q -p no:cacheprovider -m "slow or not slow" --basetemp="$work/pytest" "${tests[@]}"
echo "sanitizers: no report ($build)"
