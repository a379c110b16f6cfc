#!/usr/bin/env bash
# Build the wheels a user installs without a compiler, into DIST (default: dist/):
#   hobbitpy-<version>-py3-none-manylinux_<glibc>_<arch>.whl
#       the patched llama.cpp with ggml's CPU backend once per instruction-set level (the best
#       one this CPU runs is loaded at start), libhobbit and the Python package; one wheel
#       for every Python 3 (no CPython extension), repaired by auditwheel to the manylinux tag
#       the libraries' glibc and libstdc++ symbols allow (libgomp copied in);
#   llama_cpp_python-0.3.36-py3-none-<platform>.whl
#       llama-cpp-python's Python API only (LLAMA_BUILD=OFF: it runs on hobbitpy's library);
#       PyPI has only its source, whose default build compiles llama.cpp again.
# Install both with `pip install DIST/*.whl`.
#
#   scripts/build-wheels.sh [--arch aarch64] [DIST]
#   scripts/build-wheels.sh --cuda CUDA_HOME [DIST]     (this machine's architecture)
#
# --cuda: the same wheel with ggml's CUDA backend module beside the CPU ones, built with the
# CUDA 12 toolkit in CUDA_HOME for CUDA_ARCHITECTURES (default 75-virtual: PTX that the
# driver compiles once for any GPU from Turing on), in build/cuda12, and requiring
# PyPI's CUDA runtime and cuBLAS, which its RPATH names (CMakeLists.txt); the driver stays
# the system's (auditwheel is told to leave all three out). Without a GPU it runs on the CPU.
#
# For this machine's architecture the build reuses the editable install's build directory
# (build/py3-none-linux_<arch>): after `pip install -e .` only the packaging runs. Another
# architecture is cross-compiled with cmake/<arch>-linux-gnu.cmake (Debian's toolchain:
# scripts/check-aarch64.sh installs it and runs the result under qemu).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
arch=$(uname -m)
cuda_home=""
if [ "${1:-}" = "--arch" ]; then
    arch=${2:?--arch needs an architecture}
    shift 2
elif [ "${1:-}" = "--cuda" ]; then
    cuda_home=$(cd "${2:?--cuda needs the CUDA toolkit directory}" && pwd)
    shift 2
fi
dist="$(mkdir -p "${1:-$root/dist}" && cd "${1:-$root/dist}" && pwd)"
raw="$(mktemp -d)"
trap 'rm -rf "$raw"' EXIT
# the same arguments as the README's install command, so the build directory is reused as is
export CMAKE_ARGS="${CMAKE_ARGS:--DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF}"
repair=()
no_cache=()
build_dir=()
# the CUDA wheel's runtime libraries, pinned to the toolkit it is built with (Debian trixie's
# nvidia-cuda-toolkit 12.4.131: cudart 12.4.127, cuBLAS 12.4.5.8)
cuda_requires=("nvidia-cuda-runtime-cu12==12.4.127" "nvidia-cublas-cu12==12.4.5.8")
if [ -n "$cuda_home" ]; then
    "$cuda_home/bin/nvcc" --version | grep -q "release 12\." || { echo "build-wheels: $cuda_home/bin/nvcc is not CUDA 12" >&2; exit 2; }
    export CMAKE_ARGS="$CMAKE_ARGS -DHOBBITPY_CUDA=ON -DCMAKE_CUDA_COMPILER=$cuda_home/bin/nvcc -DCUDAToolkit_ROOT=$cuda_home -DCMAKE_CUDA_ARCHITECTURES=${CUDA_ARCHITECTURES:-75-virtual}"
    build_dir=(--config-settings=build-dir="$root/build/cuda12")
    repair=(--exclude libcuda.so.1 --exclude libcudart.so.12 --exclude libcublas.so.12 --exclude libcublasLt.so.12)
fi
if [ "$arch" != "$(uname -m)" ]; then
    toolchain="$root/cmake/$arch-linux-gnu.cmake"
    [ -f "$toolchain" ] || { echo "build-wheels: no toolchain file for $arch ($toolchain)" >&2; exit 2; }
    export CMAKE_ARGS="$CMAKE_ARGS -DCMAKE_TOOLCHAIN_FILE=$toolchain"
    export _PYTHON_HOST_PLATFORM="linux-$arch"  # the wheels' platform tag (and build directory)
    # the libraries to graft and check against are the cross toolchain's, not this machine's
    repair=(--ldpaths "/usr/$arch-linux-gnu/lib")
    no_cache=(--no-cache-dir)  # pip's cache holds this machine's llama_cpp_python wheel
fi

# the llama.cpp source (llama-cpp-python's sdist) a build here already downloaded, if any:
# both wheels are built from it
sdist="llama-cpp-python==0.3.36"
for f in "${HOBBITPY_LLAMA_SDIST:-}" "$root"/build/*/_llama/llama_cpp_python-0.3.36.tar.gz; do
    if [ -n "$f" ] && [ -f "$f" ]; then sdist=$f; export HOBBITPY_LLAMA_SDIST=$f; break; fi
done

python -m pip wheel "$root" --no-deps --no-build-isolation "${build_dir[@]}" --wheel-dir "$raw"
python -m pip wheel "$sdist" --no-deps --no-build-isolation --no-binary llama-cpp-python "${no_cache[@]}" \
    --wheel-dir "$raw"

if [ -n "$cuda_home" ]; then
    # the CUDA runtime and cuBLAS the module needs, as requirements of this wheel only
    python -m wheel unpack --dest "$raw/unpacked" "$raw"/hobbitpy-*.whl
    meta=$(echo "$raw"/unpacked/hobbitpy-*/hobbitpy-*.dist-info/METADATA)
    for r in "${cuda_requires[@]}"; do
        sed -i "0,/^Requires-Dist:/s//Requires-Dist: $r\nRequires-Dist:/" "$meta"
    done
    rm "$raw"/hobbitpy-*.whl
    python -m wheel pack --dest-dir "$raw" "$raw"/unpacked/hobbitpy-*
fi
# the manylinux tag: the oldest policy whose symbol versions cover the libraries'
python -m auditwheel repair "${repair[@]}" --wheel-dir "$dist" "$raw"/hobbitpy-*.whl
cp "$raw"/llama_cpp_python-*.whl "$dist"/
ls -l "$dist"
