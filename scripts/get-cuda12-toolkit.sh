#!/usr/bin/env bash
# A CUDA 12 toolkit (nvcc 12.4) in DIR, from Debian trixie's non-free packages, installed
# nowhere else: for building the CUDA wheel on a Debian 12 machine that reaches only package
# registries (PyPI's nvidia-cuda-nvcc-cu12 has ptxas and libNVVM but no nvcc driver, cicc or
# cudafe++; NVIDIA's own repositories are out of reach). NVIDIA's binaries in these packages
# need glibc 2.17 at most and run on Debian 12 with its gcc 12, which CUDA 12.4 supports.
#
#   scripts/get-cuda12-toolkit.sh DIR      # then: scripts/build-wheels.sh --cuda DIR/cuda
#
# About 1.2 GB downloaded (apt checks every package against trixie's signed Release file),
# 3.2 GB unpacked. DIR/cuda is a CUDA_HOME-style tree of links into the unpacked packages,
# with an nvcc.profile of its own (Debian's points at /etc/nvcc.profile).
set -euo pipefail
dir=$(mkdir -p "${1:?usage: get-cuda12-toolkit.sh DIR}" && cd "$1" && pwd)
packages=(nvidia-cuda-toolkit nvidia-cuda-dev libcudart12 libcublas12 libcublaslt12 libnvvm4
          libcu++-dev libcub-dev libthrust-dev)

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
APT::Architectures { "amd64"; };
Acquire::Languages "none";
EOF
export APT_CONFIG="$apt_dir/apt.conf"
apt-get update -q
mkdir -p "$dir/dl"
(cd "$dir/dl" && apt-get download -q "${packages[@]}")

mkdir -p "$dir/root"
for deb in "$dir"/dl/*.deb; do
    dpkg-deb -x "$deb" "$dir/root"
done

# the CUDA_HOME layout CMake's FindCUDAToolkit and nvcc expect
cuda="$dir/cuda"
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
cat > "$cuda/bin/nvcc.profile" <<'EOF'
TOP              = $(_HERE_)/..
NVVMIR_LIBRARY_DIR = $(TOP)/nvvm/libdevice
LD_LIBRARY_PATH += $(TOP)/lib64:
PATH            += $(TOP)/nvvm/bin:$(_HERE_):
INCLUDES        +=  "-I$(TOP)/include" $(_SPACE_)
LIBRARIES        =+ $(_SPACE_) "-L$(TOP)/lib64/stubs" "-L$(TOP)/lib64"
CUDAFE_FLAGS    +=
PTXAS_FLAGS     +=
EOF
"$cuda/bin/nvcc" --version | tail -2
echo "CUDA toolkit in $cuda (scripts/build-wheels.sh --cuda $cuda)"
