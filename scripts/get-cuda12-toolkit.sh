#!/usr/bin/env bash
# A CUDA 12 toolkit (nvcc 12.4) in DIR, from Debian trixie's non-free packages, installed
# nowhere else: for building the CUDA wheel on a Debian 12 machine that reaches only package
# registries (PyPI's nvidia-cuda-nvcc-cu12 has ptxas and libNVVM but no nvcc driver, cicc or
# cudafe++; NVIDIA's own repositories are out of reach). NVIDIA's binaries in these packages
# need glibc 2.17 at most and run on Debian 12 with its gcc 12, which CUDA 12.4 supports.
#
#   scripts/get-cuda12-toolkit.sh DIR [--aarch64]   # then: scripts/build-wheels.sh --cuda DIR/cuda
#
# --aarch64 adds the arm64 builds of the CUDA runtime and cuBLAS (Debian's arm64 packages, for
# Arm servers; a Jetson's own come with JetPack) as DIR/cuda/targets/aarch64-linux, where
# CMake looks when cross-compiling: enough to configure and compile the Jetson build here
# (scripts/check-jetson-cuda-build.sh). Run again with it on a DIR already set up: the x86-64
# part is kept.
#
# About 1.2 GB downloaded (apt checks every package against trixie's signed Release file),
# 3.2 GB unpacked. DIR/cuda is a CUDA_HOME-style tree of links into the unpacked packages,
# with an nvcc.profile of its own (Debian's points at /etc/nvcc.profile).
set -euo pipefail
dir=$(mkdir -p "${1:?usage: get-cuda12-toolkit.sh DIR [--aarch64]}" && cd "$1" && pwd)
aarch64=${2:-}
packages=(nvidia-cuda-toolkit nvidia-cuda-dev libcudart12 libcublas12 libcublaslt12 libnvvm4
          libcu++-dev libcub-dev libthrust-dev)
target_packages=(nvidia-cuda-dev:arm64 libcudart12:arm64 libcublas12:arm64 libcublaslt12:arm64)

# a private apt: its own sources, state and cache; the system's configuration untouched
apt_dir="$dir/apt"
mkdir -p "$apt_dir/etc" "$apt_dir/lists/partial" "$apt_dir/archives/partial"
touch "$apt_dir/status"
echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian trixie main contrib non-free" \
    > "$apt_dir/etc/sources.list"
cat > "$apt_dir/apt.conf" <<EOF
Dir::Etc::sourcelist "$apt_dir/etc/sources.list";
Dir::Etc::sourceparts "/nonexistent";
Dir::State "$apt_dir";
Dir::State::lists "$apt_dir/lists";
Dir::State::status "$apt_dir/status";
Dir::Cache "$apt_dir";
Dir::Cache::archives "$apt_dir/archives";
APT::Architecture "amd64";
APT::Architectures { "amd64"; "arm64"; };
Acquire::Languages "none";
EOF
export APT_CONFIG="$apt_dir/apt.conf"
apt-get update -q
cuda="$dir/cuda"

if [ "$aarch64" = "--aarch64" ]; then
    mkdir -p "$dir/dl-arm64" "$dir/root-arm64"
    (cd "$dir/dl-arm64" && apt-get download -q "${target_packages[@]}")
    for deb in "$dir"/dl-arm64/*.deb; do
        dpkg-deb -x "$deb" "$dir/root-arm64"
    done
    if [ -x "$cuda/bin/nvcc" ]; then
        mkdir -p "$cuda/targets/aarch64-linux"
        ln -sfn ../../include "$cuda/targets/aarch64-linux/include"  # the same headers
        ln -sfn ../../../root-arm64/usr/lib/aarch64-linux-gnu "$cuda/targets/aarch64-linux/lib"
        echo "aarch64 target libraries in $cuda/targets/aarch64-linux"
        exit 0
    fi
fi

mkdir -p "$dir/dl"
(cd "$dir/dl" && apt-get download -q "${packages[@]}")

mkdir -p "$dir/root"
for deb in "$dir"/dl/*.deb; do
    dpkg-deb -x "$deb" "$dir/root"
done

# the CUDA_HOME layout CMake's FindCUDAToolkit and nvcc expect
rm -rf "$cuda"
mkdir -p "$cuda/bin" "$cuda/nvvm/bin" "$cuda/nvvm/lib64"
tk=root/usr/lib/nvidia-cuda-toolkit
# nvcc reads nvcc.profile beside the path it was started by: a hard link, not a symlink
ln "$dir/$tk/bin/nvcc" "$cuda/bin/nvcc"
ln -s "../../$tk/bin/crt" "$cuda/bin/crt"
for t in ptxas nvlink fatbinary cudafe++ bin2c cuobjdump nvprune nvdisasm cu++filt; do
    ln -s "../../root/usr/bin/$t" "$cuda/bin/$t"
done
ln -s "../../../$tk/bin/cicc" "$cuda/nvvm/bin/cicc"
ln -s "../../$tk/libdevice" "$cuda/nvvm/libdevice"
for f in "$dir"/root/usr/lib/x86_64-linux-gnu/libnvvm.so*; do
    ln -s "../../../root/usr/lib/x86_64-linux-gnu/$(basename "$f")" "$cuda/nvvm/lib64/"
done
ln -s ../root/usr/include "$cuda/include"
ln -s ../root/usr/lib/x86_64-linux-gnu "$cuda/lib64"
ln -s lib64 "$cuda/lib"
# nvcc's profile finds headers and libraries per target (nvcc -target-dir, x86_64-linux by default)
mkdir -p "$cuda/targets/x86_64-linux"
ln -s ../../include "$cuda/targets/x86_64-linux/include"
ln -s ../../lib64 "$cuda/targets/x86_64-linux/lib"
cat > "$cuda/bin/nvcc.profile" <<'EOF'
TOP              = $(_HERE_)/..
NVVMIR_LIBRARY_DIR = $(TOP)/nvvm/libdevice
LD_LIBRARY_PATH += $(TOP)/lib64:
PATH            += $(TOP)/nvvm/bin:$(_HERE_):
INCLUDES        +=  "-I$(TOP)/$(_TARGET_DIR_)/include" $(_SPACE_)
LIBRARIES        =+ $(_SPACE_) "-L$(TOP)/$(_TARGET_DIR_)/lib/stubs" "-L$(TOP)/$(_TARGET_DIR_)/lib"
CUDAFE_FLAGS    +=
PTXAS_FLAGS     +=
EOF
if [ -d "$dir/root-arm64" ]; then
    mkdir -p "$cuda/targets/aarch64-linux"
    ln -s ../../include "$cuda/targets/aarch64-linux/include"
    ln -s ../../../root-arm64/usr/lib/aarch64-linux-gnu "$cuda/targets/aarch64-linux/lib"
fi
"$cuda/bin/nvcc" --version | tail -2
echo "CUDA toolkit in $cuda (scripts/build-wheels.sh --cuda $cuda)"
