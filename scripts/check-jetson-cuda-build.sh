#!/usr/bin/env bash
# The Jetson AGX Orin's CUDA build, cross-compiled here as far as an x86-64 machine can take
# it: configured for aarch64 (Debian's cross toolchain, cmake/aarch64-linux-gnu.cmake) with
# CUDA 12.4's nvcc targeting aarch64-linux and sm_87, then the host part compiled (libllama,
# libggml, libhobbit with its GPU pools; the Orin's CPU variant linked) and the CUDA objects
# of patch 0006 compiled. Linking all of ggml-cuda for the Orin is left to the Orin (docs/JETSON.md):
# it takes hours here and its libraries would be Debian's Arm-server CUDA, not JetPack's.
#
#   scripts/get-cuda12-toolkit.sh DIR --aarch64      # nvcc 12.4 and the arm64 CUDA libraries
#   scripts/check-jetson-cuda-build.sh DIR/cuda [BUILD_DIR]
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cuda=$(cd "${1:?usage: check-jetson-cuda-build.sh CUDA_HOME [BUILD_DIR]}" && pwd)
build=${2:-$root/build/jetson-cuda}
[ -d "$cuda/targets/aarch64-linux/lib" ] || { echo "no aarch64 CUDA libraries in $cuda (get-cuda12-toolkit.sh DIR --aarch64)" >&2; exit 2; }
command -v aarch64-linux-gnu-g++ > /dev/null || { echo "no aarch64-linux-gnu-g++ (apt install g++-aarch64-linux-gnu)" >&2; exit 2; }

cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_TOOLCHAIN_FILE="$root/cmake/aarch64-linux-gnu.cmake" -DHOBBITPY_TESTS=OFF \
    -DHOBBITPY_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=87 -DCMAKE_CUDA_COMPILER="$cuda/bin/nvcc" \
    -DCMAKE_CUDA_HOST_COMPILER=aarch64-linux-gnu-g++ "-DCMAKE_CUDA_FLAGS=-target-dir aarch64-linux" \
    -DCUDAToolkit_ROOT="$cuda"
cuda_dir=llama.cpp/ggml/src/ggml-cuda/CMakeFiles/ggml-cuda.dir
# objects of libllama, libggml and libhobbit (linking libggml would wait for every backend
# module, ggml-cuda among them), libggml-base and the Orin's CPU variant linked
objects=$(ninja -C "$build" -t targets all | grep -oE "^[^:]*CMakeFiles/(llama|ggml|hobbit)\.dir/[^:]*\.o")
ninja -C "$build" bin/libggml-cpu-armv8.2_2.so $objects "$cuda_dir/mmid.cu.o" "$cuda_dir/mmvf.cu.o"
file "$build/bin/libggml-cpu-armv8.2_2.so" "$build/$cuda_dir/mmid.cu.o"
echo "Jetson CUDA build: configured, host part and patch 0006's CUDA objects compiled ($build)"
