#!/usr/bin/env bash
# Compile-check of the CUDA build (HOBBITPY_CUDA=ON) on a machine without a GPU.
#
# Configures the whole project with llama.cpp's CUDA backend and compiles a few CUDA
# objects plus the expert runtime. The CUDA toolkit here ships nvcc and cudart but not
# cuBLAS nor the driver stub: cuBLAS comes from PyPI's nvidia-cublas wheel, and the
# driver library is only named (nothing is linked), which is enough to configure and
# compile. Usage: scripts/check-cuda-build.sh [BUILD_DIR] [CUDA_ARCH]
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
build=${1:-$root/build/cuda-check}
arch=${2:-87}   # Jetson AGX Orin
deps="$build/_cublas"
mkdir -p "$deps"
if [ ! -d "$deps/nvidia" ]; then
    pip download --quiet --no-deps nvidia-cublas -d "$deps"
    python3 -m zipfile -e "$deps"/nvidia_cublas-*.whl "$deps"
fi
cu=$(dirname "$(find "$deps/nvidia" -name cublas_v2.h | head -1)")/..
ln -sf libcublas.so.13 "$cu/lib/libcublas.so"
ln -sf libcublasLt.so.13 "$cu/lib/libcublasLt.so"
cudart=""
for f in "${CUDA_HOME:-/usr/local/cuda}"/lib64/libcudart.so /usr/local/cuda*/lib64/libcudart.so; do
    if [ -f "$f" ]; then cudart=$f; break; fi
done
[ -n "$cudart" ] || { echo "no libcudart.so found; set CUDA_HOME" >&2; exit 1; }

cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DHOBBITPY_CUDA=ON \
    -DCMAKE_CUDA_ARCHITECTURES="$arch" \
    -DCUDA_cublas_LIBRARY="$cu/lib/libcublas.so" -DCUDA_cublasLt_LIBRARY="$cu/lib/libcublasLt.so" \
    -DCUDA_cuda_driver_LIBRARY="$cudart" \
    "-DCMAKE_CUDA_FLAGS=-I$cu/include" "-DCMAKE_CXX_FLAGS=-I$cu/include"
cuda_dir=llama.cpp/ggml/src/ggml-cuda/CMakeFiles/ggml-cuda.dir
hobbit_dir=native/CMakeFiles/hobbit.dir/src
# objects only: linking would build all of ggml-cuda (hours on 2 cores)
# (mmid.cu and mmvf.cu carry patch 0006's skip; mmvq.cu and ggml-cuda.cu too, but take minutes each)
ninja -C "$build" "$cuda_dir/arange.cu.o" "$cuda_dir/argsort.cu.o" "$cuda_dir/getrows.cu.o" \
    "$cuda_dir/mmid.cu.o" "$cuda_dir/mmvf.cu.o" \
    "$hobbit_dir/hobbit-runtime.cpp.o" "$hobbit_dir/hobbit-runtime-waves.cpp.o" "$hobbit_dir/hobbit-runtime-loads.cpp.o" \
    "$hobbit_dir/hobbit-runtime-plan.cpp.o" "$hobbit_dir/hobbit-model-files.cpp.o" "$hobbit_dir/hobbit-expert-cache.cpp.o" "$hobbit_dir/hobbit-runtime-neurons.cpp.o" "$hobbit_dir/hobbit-runtime-stats.cpp.o" \
    "$hobbit_dir/hobbit-expert-pool.cpp.o" "$hobbit_dir/hobbit-slot-table.cpp.o" "$hobbit_dir/hobbit-api.cpp.o" \
    "$hobbit_dir/hobbit-executor-choice.cpp.o" "$hobbit_dir/hobbit-precision-scorer.cpp.o" "$hobbit_dir/hobbit-predictor.cpp.o"
echo "CUDA configure and compile-check passed ($build)"
