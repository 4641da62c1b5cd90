#!/bin/sh
# Builds and runs the host emulation of q4_gemv.cu (see README.md). Needs g++ 12+ (C++20, _Float16).
set -eu
here=$(cd "$(dirname "$0")" && pwd)
out=${TMPDIR:-/tmp}/tm-q4-gemv-emu
mkdir -p "$out"
python3 "$here/gen.py" "$here/../cuda/q4_gemv.cu" "$out/q4_gemv_emu.inc"
${CXX:-g++} -std=c++20 -O2 -fno-strict-aliasing -pthread -I"$here/include" -I"$here/../cuda" -I"$out" \
    "$here/q4_gemv_emu.cpp" -o "$out/q4_gemv_emu"
"$out/q4_gemv_emu"
