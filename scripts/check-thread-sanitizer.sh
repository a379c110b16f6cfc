#!/usr/bin/env bash
# The native code under ThreadSanitizer: builds libhobbit and the patched llama.cpp with it
# (ggml without OpenMP, so its own thread pool is instrumented instead of hidden in libgomp),
# runs the native unit tests, the offload check, then a threaded slice of the Python tests
# (I/O threads, prefetch, row readers, cooperative mode) against those libraries. The first
# report fails the run (halt_on_error). Takes ~25 minutes to build on 2 cores and ~20 to
# test; run before each release with scripts/check-sanitizers.sh, and write the result in
# docs/RELIABILITY.md.
# Usage: scripts/check-thread-sanitizer.sh [BUILD_DIR] [PYTEST_ARGS...]
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
build=${1:-$root/build/tsan}
shift || true
tests=("$@")
# a decode under TSan is 10-30x slower: a few tests of each threaded path, not whole files (the
# executables of tests/package/test_native.py run below without Python: the shell one of them starts
# crashes with libtsan preloaded, in its setjmp interceptor)
[ ${#tests[@]} -gt 0 ] || tests=(
    tests/offload/test_overlap.py::test_prefetch_completes_while_compute_runs
    tests/offload/test_overlap.py::test_adaptive_prefetch_is_exact_and_accounts_for_its_guesses
    tests/offload/test_overlap.py::test_mixed_precision_prefetch_is_exact_with_identical_levels
    tests/offload/test_neuron_reads.py::test_theta_zero_reads_every_neuron_and_computes_the_experts
    tests/offload/test_neuron_reads.py::test_neurons_read_cost_what_the_exact_pricing_says_and_read_fewer_bytes
    tests/offload/test_cooperative.py::test_cooperative_with_prefetch_and_mixed_precision
    "tests/offload/test_mixed_precision.py::test_the_same_text_gives_the_same_logits_whatever_the_disks_timing[cooperative-upgrade]")
flags="-fsanitize=thread -fno-omit-frame-pointer -g -O1"
# GCC instruments the resolver of a target_clones function, which the loader runs while it
# relocates, before TSan is initialized (a SIGSEGV before main): the attribute is renamed into
# one GCC ignores (with a warning), each function keeps its default build (-march=native here)
cxx_flags="$flags -Dtarget_clones=hobbit_no_clones_under_tsan"

cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DHOBBITPY_PORTABLE=OFF -DGGML_NATIVE=ON \
    -DGGML_OPENMP=OFF "-DCMAKE_C_FLAGS=$flags" "-DCMAKE_CXX_FLAGS=$cxx_flags" \
    "-DCMAKE_EXE_LINKER_FLAGS=-fsanitize=thread" "-DCMAKE_SHARED_LINKER_FLAGS=-fsanitize=thread"
cmake --build "$build" -j "$(nproc)"
prefix="$build/_install"
cmake --install "$build" --component hobbitpy --prefix "$prefix" >/dev/null

# this run's models, reports and pytest's folders (its own: a concurrent pytest session prunes
# all but the newest three under /tmp/pytest-of-$USER, models in use included)
work="$build/check"
rm -rf "$work" && mkdir -p "$work/models" "$work/reports"
# a report goes to a file: pytest captures stderr, and loses it when the process halts
show_reports() {
    for f in "$work"/reports/*; do
        [ -e "$f" ] && { echo "== report $f"; cat "$f"; }
    done
    return 0
}
trap show_reports EXIT

# every report halts the process with exit code 66; no suppressions: none was needed, a report
# inside ggml or CPython is to be read before it is hidden
export TSAN_OPTIONS="halt_on_error=1:exitcode=66:second_deadlock_stack=1:history_size=4:log_path=$work/reports/tsan"
export HOBBITPY_LIB_DIR="$prefix/hobbitpy/lib"
export LLAMA_CPP_LIB_PATH="$HOBBITPY_LIB_DIR"
preload="$(gcc -print-file-name=libtsan.so)"

echo "== native unit tests (TSan)"
"$HOBBITPY_LIB_DIR/hobbit-native-tests" "$work"

echo "== offload check: runtime, I/O threads and ggml's thread pool (TSan)"
cd "$root"
arches=(llama qwen2moe gpt-oss)
LD_PRELOAD="$preload" python -c '
import sys
from hobbitpy.binding.native import DATA_DIR
from hobbitpy.files.synthetic_moe import make_synthetic_moe
for arch in sys.argv[2:]:
    make_synthetic_moe(f"{sys.argv[1]}/{arch}.gguf", arch, vocab_gguf=DATA_DIR / "ggml-vocab-llama-spm.gguf")' \
    "$work/models" "${arches[@]}"
for arch in "${arches[@]}"; do
    "$HOBBITPY_LIB_DIR/hobbit-offload-check" "$work/models/$arch.gguf" 6
done

# Python is not built with TSan: the runtime is preloaded; the interpreter's own accesses are
# not seen, its locks (the GIL included) are, so calls into the libraries from two Python
# threads are ordered as they really are
echo "== threaded Python tests against the TSan libraries"
LD_PRELOAD="$preload" python -m pytest -q -p no:cacheprovider -m "slow or not slow" --basetemp="$work/pytest" "${tests[@]}"
echo "thread sanitizer: no report ($build)"
