#!/usr/bin/env bash
# The aarch64 wheel (Jetson, Graviton, Raspberry Pi 5), cross-compiled here with Debian's
# toolchain (scripts/build-wheels.sh --arch aarch64), and its libraries run under qemu-user:
# the native unit tests, and hobbit-offload-check (a prompt and greedy decode of the shipped
# model by stock llama.cpp and through the smallest expert cache: logits equal bit for bit)
# on an emulated Cortex-A76 (Armv8.2 with dot product and FP16, the class of a Jetson AGX
# Orin's Cortex-A78AE: ggml loads its armv8.2_2 variant) and Cortex-A53 (Armv8.0: the
# baseline variant). The cross compiler and qemu-user are installed first where missing
# (Debian packages; needs root). tests/package/test_aarch64.py runs it.
#   scripts/check-aarch64.sh [DIST]     (the aarch64 wheels are left in DIST, default dist/)
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
dist=${1:-$root/dist}

need=()
command -v aarch64-linux-gnu-g++ >/dev/null || need+=(g++-aarch64-linux-gnu)
command -v qemu-aarch64 >/dev/null || need+=(qemu-user)
if [ ${#need[@]} -gt 0 ]; then
    if [ "$(id -u)" != 0 ]; then
        echo "check-aarch64: needs the Debian packages ${need[*]} (run as root to install them)" >&2
        exit 1
    fi
    if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
            "${need[@]}" >/dev/null; }; then
        echo "check-aarch64: could not install the Debian packages ${need[*]} with apt-get (is a Debian mirror reachable?)" >&2
        exit 1
    fi
fi

# the aarch64 wheels, as a user gets them; their libraries run below
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$root/scripts/build-wheels.sh" --arch aarch64 "$dist"
wheel=$(ls "$dist"/hobbitpy-*-manylinux_*_aarch64.whl)
python -m zipfile -e "$wheel" "$tmp/wheel"
lib="$tmp/wheel/hobbitpy/lib"
chmod +x "$lib"/hobbit-*  # zipfile does not keep the mode
ls "$lib"

export QEMU_LD_PREFIX=/usr/aarch64-linux-gnu
mkdir "$tmp/native"
QEMU_CPU=cortex-a76 qemu-aarch64 "$lib/hobbit-native-tests" "$tmp/native"
for cpu in cortex-a76 cortex-a53; do
    echo "qemu-aarch64 -cpu $cpu:"
    QEMU_CPU=$cpu qemu-aarch64 "$lib/hobbit-offload-check" "$root/models/ref-mixtral-Q8_0.gguf" 4
done
echo "aarch64: native tests and offloaded generation equal to stock under qemu"
