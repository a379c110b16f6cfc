#!/usr/bin/env bash
# One folder holding what a GPU machine with no network needs to check hobbitpy's GPU path, and
# nothing else (at most 40 MiB, inside build/, which git ignores):
#   hobbitpy/     the sources (CMake, native, patches, python; not the GGUFs of models/)
#   llama.cpp/    the pinned llama.cpp: the llama-cpp-python sdist checked against its sha256,
#                 patched with patches/, trimmed to what the CUDA build compiles
#   py/           llama-cpp-python's Python part and the pinned gguf-py (pure Python)
#   wheels/       cffi (CPython 3.12, x86-64), pycparser, diskcache: what hobbitpy needs there
#   device-check.sh, device_check.py and the test-model writer
#
#   scripts/pack-device-check.sh [DIR]     # default build/device-check; its path is the last line
#
# The sdist comes from HOBBITPY_LLAMA_SDIST, a build tree's download, or PyPI; the wheels from PyPI
# (kept in DIR's cache between packs).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
dir=${1:-$root/build/device-check}
sha=$(sed -n 's/.*HOBBITPY_LLAMA_SDIST_SHA256 "\([0-9a-f]*\)".*/\1/p' "$root/cmake/fetch-llama.cmake")
url=$(sed -n 's/.*"\(https:[^"]*llama_cpp_python-[^"]*\.tar\.gz\)".*/\1/p' "$root/cmake/fetch-llama.cmake")
name=$(basename "$url" .tar.gz)
cache="$dir.cache"
mkdir -p "$cache"

sdist=${HOBBITPY_LLAMA_SDIST:-}
if [ -z "$sdist" ]; then
    sdist=$(ls "$root"/build/*/_llama/"$name".tar.gz 2>/dev/null | head -1 || true)
fi
if [ -z "$sdist" ]; then
    sdist="$cache/$name.tar.gz"
    [ -f "$sdist" ] || python3 -c "import sys, urllib.request; urllib.request.urlretrieve(sys.argv[1], sys.argv[2])" "$url" "$sdist"
fi
echo "$sha  $sdist" | sha256sum --check --quiet - || { echo "$sdist: not the pinned sdist (sha256 $sha)" >&2; exit 2; }

rm -rf "$dir"
mkdir -p "$dir"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
tar -xzf "$sdist" -C "$tmp" "$name/vendor/llama.cpp" "$name/llama_cpp"

# llama.cpp: patched as cmake/fetch-llama.cmake patches it, with the same stamp, then trimmed
src="$tmp/$name/vendor/llama.cpp"
stamp="$sha"
for p in $(ls "$root"/patches/*.patch | LC_ALL=C sort); do
    patch -d "$src" -p1 --forward --batch --quiet -i "$p"
    stamp="$stamp;$(sha256sum "$p" | cut -d' ' -f1)"
done
printf '%s' "$stamp" > "$src/hobbitpy-patched.stamp"
( cd "$src" && rm -rf docs examples tests tools benches media scripts conversion pocs app .devops .github ci \
    grammars prompts requirements* poetry.lock pyproject.toml flake.* Makefile build-xcframework.sh )
find "$src/models" -type f ! -name ggml-vocab-llama-spm.gguf -delete
for b in blas cann et hexagon hip metal musa opencl openvino rpc sycl virtgpu vulkan webgpu zdnn zendnn; do
    rm -rf "$src/ggml/src/ggml-$b"
done
mv "$src" "$dir/llama.cpp"

# hobbitpy's sources as in the working tree (tracked, and new files git does not ignore), not the GGUFs of models/
mkdir -p "$dir/hobbitpy"
( cd "$root" && git ls-files -z --cached --others --exclude-standard CMakeLists.txt pyproject.toml README.md LICENSE cmake native patches python \
    | tar --null -T - -cf - ) | tar -xf - -C "$dir/hobbitpy"

mkdir -p "$dir/py"
mv "$tmp/$name/llama_cpp" "$dir/py/llama_cpp"
cp -r "$dir/llama.cpp/gguf-py/gguf" "$dir/py/gguf"
if [ ! -d "$cache/wheels" ]; then
    python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$cache/wheels.part" \
        cffi==2.0.0 pycparser==2.23 diskcache==5.6.3
    mv "$cache/wheels.part" "$cache/wheels"
fi
cp -r "$cache/wheels" "$dir/wheels"
cp "$root/scripts/device-check/device-check.sh" "$root/scripts/device-check/device_check.py" \
   "$root/scripts/make_real_size_random_moe.py" "$dir/"

size=$(du -sm "$dir" | cut -f1)
if [ "$size" -gt 40 ]; then
    echo "$dir: $size MiB, over the 40 MiB a device call may carry beside the tree" >&2
    exit 1
fi
rel=${dir#"$root"/}
cat <<EOF
$size MiB. To run it on a GPU machine of the device tool: the call sends the tracked tree, and
the GGUFs of models/ alone are over its 64 MiB, so move them out for the call and back after:
  mkdir -p /tmp/models-aside && mv $root/models/*.gguf /tmp/models-aside/
  device run, carry ["$rel"], timeout_s 600:
    bash $rel/device-check.sh \$OUT/check
  mv /tmp/models-aside/*.gguf $root/models/
$dir
EOF
