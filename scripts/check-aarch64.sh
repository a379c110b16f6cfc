#!/usr/bin/env bash
# The aarch64 build (Jetson, Graviton, Raspberry Pi 5), cross-compiled here with Debian's
# toolchain and run under qemu-user: the native unit tests, and hobbit-offload-check (a
# prompt and greedy decode of the shipped model by stock llama.cpp and through the smallest
# expert cache: logits equal bit for bit) on an emulated Cortex-A76 (Armv8.2 with dot
# product and FP16, the class of a Jetson AGX Orin's Cortex-A78AE: ggml loads its armv8.2_2
# variant) and Cortex-A53 (Armv8.0: the baseline variant). The cross compiler and qemu-user
# are installed first where missing (Debian packages; needs root). tests/test_aarch64.py
# runs it.
#   scripts/check-aarch64.sh [BUILD_DIR]
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
build=${1:-$root/build/aarch64}

need=()
command -v aarch64-linux-gnu-g++ >/dev/null || need+=(g++-aarch64-linux-gnu)
command -v qemu-aarch64 >/dev/null || need+=(qemu-user)
if [ ${#need[@]} -gt 0 ]; then
    if [ "$(id -u)" != 0 ]; then
        echo "check-aarch64: needs the Debian packages ${need[*]} (run as root to install them)" >&2
        exit 1
    fi
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi

# the llama.cpp source the host build already downloaded, if there is one
if [ -z "${HOBBITPY_LLAMA_SDIST:-}" ]; then
    for f in "$root"/build/*/_llama/llama_cpp_python-0.3.36.tar.gz; do
        if [ -f "$f" ]; then export HOBBITPY_LLAMA_SDIST="$f"; break; fi
    done
fi
cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_TOOLCHAIN_FILE="$root/cmake/aarch64-linux-gnu.cmake" >/dev/null
cmake --build "$build"
rm -rf "$build/stage"
cmake --install "$build" --component hobbitpy --prefix "$build/stage" >/dev/null
lib="$build/stage/hobbitpy/lib"
ls "$lib"

export QEMU_LD_PREFIX=/usr/aarch64-linux-gnu
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
QEMU_CPU=cortex-a76 qemu-aarch64 "$lib/hobbit-native-tests" "$tmp"
for cpu in cortex-a76 cortex-a53; do
    echo "qemu-aarch64 -cpu $cpu:"
    QEMU_CPU=$cpu qemu-aarch64 "$lib/hobbit-offload-check" "$root/models/ref-mixtral-Q8_0.gguf" 4
done
echo "aarch64: native tests and offloaded generation equal to stock under qemu"
