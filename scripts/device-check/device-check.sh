#!/usr/bin/env bash
# hobbitpy's GPU path checked on any Linux machine with an NVIDIA GPU, from the folder
# scripts/pack-device-check.sh made, with no network: hobbitpy and the pinned llama.cpp (patched,
# trimmed) built for this GPU's architecture only, test models written, then exactness and the
# table (device_check.py), JSON and a log in OUT.
#
#   bash device-check.sh OUT            # on the GPU machine: build (sm_XY of nvidia-smi), check
#   bash device-check.sh OUT --no-gpu   # anywhere: the CUDA build configured and a part of it
#                                       # compiled, then every step on the CPU build of the
#                                       # hobbitpy installed here, at a small size
#
# Needs: bash, python3 with numpy, jinja2 and typing-extensions, CMake, ninja, a C++ compiler,
# and for the GPU build nvcc, cuBLAS and scikit-build-core (the Python packages hobbitpy needs
# beyond those travel in the folder). WORK (default /tmp/hobbit-device-check) holds the build.
set -euo pipefail
bundle="$(cd "$(dirname "$0")" && pwd)"
out=${1:?usage: device-check.sh OUT [--no-gpu]}
mode=${2:-gpu}
mkdir -p "$out"
out="$(cd "$out" && pwd)"
work=${WORK:-/tmp/hobbit-device-check}
mkdir -p "$work"
log="$out/build.log"
say() { echo "device-check: $*" | tee -a "$log"; }
: > "$log"

# the toolkit: CUDA_HOME, else /usr/local/cuda, else the one nvcc on PATH belongs to
cuda_home=${CUDA_HOME:-}
if [ -z "$cuda_home" ]; then
    if [ -x /usr/local/cuda/bin/nvcc ]; then
        cuda_home=/usr/local/cuda
    else
        cuda_home=$(dirname "$(dirname "$(readlink -f "$(command -v nvcc || echo /nonexistent/bin/nvcc)")")")
    fi
fi

# cuBLAS (headers and libraries): the toolkit's own, else the CUDA wheels' (PyPI's nvidia-cublas:
# installed, or fetched where the network reaches PyPI, which only the compile check here needs)
cublas_args=()
find_cublas() {
    [ -f "$cuda_home/include/cublas_v2.h" ] && return 0
    local cu
    cu=$(python3 -c 'import nvidia.cu13, os; print(os.path.dirname(nvidia.cu13.__file__))' 2>/dev/null ||
         python3 -c 'import nvidia.cublas, os; print(os.path.dirname(nvidia.cublas.__file__))' 2>/dev/null || true)
    if [ -z "$cu" ] || [ ! -f "$cu/include/cublas_v2.h" ]; then
        [ "$1" = download ] || { say "no cuBLAS in $cuda_home nor among the Python packages"; exit 1; }
        local deps="$work/_cublas"
        if [ ! -d "$deps/nvidia" ]; then
            mkdir -p "$deps"
            python3 -m pip download --quiet --no-deps nvidia-cublas -d "$deps" >> "$log" 2>&1
            python3 -m zipfile -e "$deps"/nvidia_cublas-*.whl "$deps"
        fi
        cu=$(dirname "$(find "$deps/nvidia" -name cublas_v2.h | head -1)")/..
    fi
    for l in cublas cublasLt; do
        [ -e "$cu/lib/lib$l.so" ] || ln -sf "$(ls "$cu"/lib/lib$l.so.* | head -1)" "$cu/lib/lib$l.so"
    done
    cublas_args=(-DCUDA_cublas_LIBRARY="$cu/lib/libcublas.so" -DCUDA_cublasLt_LIBRARY="$cu/lib/libcublasLt.so"
                 "-DCMAKE_CUDA_FLAGS=-I$cu/include" "-DCMAKE_CXX_FLAGS=-I$cu/include")
    cublas_lib="$cu/lib"
}
cublas_lib=""

if [ "$mode" = "--no-gpu" ]; then
    arch=${CUDA_ARCH:-90}
    say "no GPU: configuring the CUDA build for sm_$arch and compiling a part of it"
    find_cublas download
    build="$work/cuda-build"
    rm -rf "$build"
    cmake -S "$bundle/hobbitpy" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DHOBBITPY_CUDA=ON \
        -DHOBBITPY_PORTABLE=ON -DHOBBITPY_LLAMA_SRC="$bundle/llama.cpp" -DCMAKE_CUDA_ARCHITECTURES="$arch" \
        -DCMAKE_CUDA_COMPILER="$cuda_home/bin/nvcc" -DCUDA_cuda_driver_LIBRARY="$(ls "$cuda_home"/lib64/libcudart.so | head -1)" \
        "${cublas_args[@]}" >> "$log" 2>&1
    cuda_dir=llama.cpp/ggml/src/ggml-cuda/CMakeFiles/ggml-cuda.dir
    hobbit_dir=native/CMakeFiles/hobbit.dir/src
    # objects only (linking all of ggml-cuda takes hours on 2 cores): the files patch 0006 changes
    # that compile in seconds, and the expert runtime
    ninja -C "$build" "$cuda_dir/getrows.cu.o" "$cuda_dir/mmid.cu.o" \
        "$hobbit_dir/hobbit-runtime.cpp.o" "$hobbit_dir/hobbit-runtime-loads.cpp.o" \
        "$hobbit_dir/hobbit-expert-pool.cpp.o" >> "$log" 2>&1
    say "CUDA objects compiled; the steps on this machine's hobbitpy (CPU)"
    python3 "$bundle/device_check.py" "$out" --no-gpu
    exit
fi

command -v nvidia-smi > /dev/null || { say "no nvidia-smi: no NVIDIA GPU here (--no-gpu runs the CPU half)"; exit 2; }
arch=${CUDA_ARCH:-$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d '. ')}
say "GPU: $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | head -1); sm_$arch; $(nproc) cores"
# the Python packages that travel: cffi's wheel (and pycparser, diskcache), llama-cpp-python's
# Python part (it loads hobbitpy's libllama), gguf-py of the pinned llama.cpp
site="$work/site"
mkdir -p "$site"
python3 -m pip install --quiet --no-index --no-deps --no-compile --upgrade --target "$site" "$bundle"/wheels/*.whl >> "$log" 2>&1
cp -r "$bundle/py/." "$site/"
find_cublas installed
# built as the wheels users install are, the CPU backend for every x86-64 level (a native build
# turns on AMX where the CPU has it, and stock llama.cpp's deepseek2 graph then aborts in ggml's
# scheduler: seen on this project's CPU build), and ggml's CUDA module for this GPU alone. Its
# FlashAttention kernels (most of its compile time) only with CUDA_FA=ON: stock and hobbitpy
# run the same kernels either way, so exactness and the table's ratios hold
start=$(date +%s)
python3 -m pip install --no-build-isolation --no-deps --no-index --no-compile --upgrade --target "$site" "$bundle/hobbitpy" \
    -C build-dir="$work/build" -C cmake.define.HOBBITPY_CUDA=ON -C cmake.define.HOBBITPY_PORTABLE=ON \
    -C cmake.define.HOBBITPY_LLAMA_SRC="$bundle/llama.cpp" -C cmake.define.CMAKE_CUDA_ARCHITECTURES="$arch" \
    -C cmake.define.GGML_CUDA_FA="${CUDA_FA:-OFF}" -C cmake.define.CMAKE_CUDA_COMPILER="$cuda_home/bin/nvcc" "${cublas_args[@]/#-D/-Ccmake.define.}" \
    >> "$log" 2>&1 || { tail -40 "$log"; say "the build failed (its log: $log)"; exit 1; }
say "built in $(( $(date +%s) - start )) s (FlashAttention kernels ${CUDA_FA:-OFF})"
# ggml's CUDA module finds the CUDA runtime and cuBLAS where a wheel's RPATH points (PyPI's nvidia
# packages beside it) or on the loader's path: the toolkit's here
export LD_LIBRARY_PATH="$cuda_home/lib64${cublas_lib:+:$cublas_lib}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export PYTHONPATH="$site" LLAMA_CPP_LIB_PATH="$site/hobbitpy/lib"
python3 "$bundle/device_check.py" "$out"
