#!/usr/bin/env bash
# Regenerate patches/ from a development tree of llama.cpp.
#
#   scripts/dev-tree.sh DIR         # once: DIR = pinned llama.cpp, patches applied as commits
#   (edit and commit in DIR, one commit per concern, each message saying why)
#   scripts/regen-patches.sh DIR    # write the commits since the tag "base" to patches/
set -euo pipefail
tree=${1:?usage: regen-patches.sh LLAMA_DEV_TREE}
out="$(cd "$(dirname "$0")/.." && pwd)/patches"
rm -f "$out"/*.patch
git -C "$tree" format-patch --quiet --no-signature --zero-commit --no-numbered base..HEAD -o "$out"
ls "$out"
