#!/usr/bin/env bash
# Make a git work tree of the pinned llama.cpp with patches/ applied as commits,
# for editing the patch series (see regen-patches.sh).
set -euo pipefail
dir=${1:?usage: dev-tree.sh DIR}
root="$(cd "$(dirname "$0")/.." && pwd)"
url="https://files.pythonhosted.org/packages/ec/e9/e7de2b0463ea3ffbf0ede6cb21b58c1258a8f6521aae45ca773a59fe7cf3/llama_cpp_python-0.3.36.tar.gz"
sha=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
sdist=${HOBBITPY_LLAMA_SDIST:-$tmp/sdist.tar.gz}
[ -f "$sdist" ] || curl -sSL -o "$sdist" "$url"
echo "$sha  $sdist" | sha256sum -c --quiet
tar -xzf "$sdist" -C "$tmp" llama_cpp_python-0.3.36/vendor/llama.cpp
mkdir -p "$dir"
cp -r "$tmp/llama_cpp_python-0.3.36/vendor/llama.cpp/." "$dir"
rm -f "$dir/.git"  # the sdist keeps a submodule pointer
cd "$dir"
git init -q
git add -A
git -c user.name=base -c user.email=base@localhost commit -qm "llama.cpp 0c1e570 from llama-cpp-python 0.3.36"
git tag base
git -c user.name=hobbitpy -c user.email=dev@hobbitpy am -q "$root"/patches/*.patch
git log --oneline base..HEAD
