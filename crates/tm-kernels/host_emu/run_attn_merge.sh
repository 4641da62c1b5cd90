#!/bin/sh
# Builds and runs the host emulation of attention.cu's split-K merge (see README.md). Needs g++ 12+
# (C++20: std::barrier, std::atomic_ref).
set -eu
here=$(cd "$(dirname "$0")" && pwd)
out=${TMPDIR:-/tmp}/tm-attn-merge-emu
mkdir -p "$out"
python3 "$here/attn_merge_gen.py" "$here/../cuda/attention.cu" "$out/attn_merge_emu.inc"
${CXX:-g++} -std=c++20 -O2 -pthread -Wall -Wno-unused-function -I"$out" "$here/attn_merge_emu.cpp" -o "$out/attn_merge_emu"
"$out/attn_merge_emu"
