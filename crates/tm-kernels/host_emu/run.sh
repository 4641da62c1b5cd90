#!/bin/sh
# Builds and runs the host emulation of q4_gemv.cu (see README.md). Needs g++ 12+ (C++20, _Float16).
# Twice: as the host compiles it (TM_Q4_LEAN_B1 = 0: the lean kernels' general loop) and with
# -DTM_Q4_LEAN_B1=2 (their batch-1 loop, the sm_90 default), so the n = 1 cases run both loops.
# Exit status: non-zero when either run has a failure.
set -eu
here=$(cd "$(dirname "$0")" && pwd)
out=${TMPDIR:-/tmp}/tm-q4-gemv-emu
mkdir -p "$out"
python3 "$here/gen.py" "$here/../cuda/q4_gemv.cu" "$out/q4_gemv_emu.inc"
build() {  # build NAME [FLAGS...]
    name=$1
    shift
    # shellcheck disable=SC2086  # CXX may carry flags
    ${CXX:-g++} -std=c++20 -O2 -fno-strict-aliasing -pthread "$@" -I"$here/include" -I"$here/../cuda" -I"$out" \
        "$here/q4_gemv_emu.cpp" -o "$out/$name"
}
build q4_gemv_emu &
p1=$!
build q4_gemv_emu_b1 -DTM_Q4_LEAN_B1=2 &
p2=$!
wait $p1
wait $p2
echo "== the general loops"
"$out/q4_gemv_emu"
echo "== TM_Q4_LEAN_B1=2: the lean kernels' batch-1 loop at n = 1"
"$out/q4_gemv_emu_b1"
