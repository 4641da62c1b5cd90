#!/usr/bin/env bash
# Builds kernel directories that differ from the shipped ones only by extra nvcc flags (the
# tuning knobs a kernel source exposes as macros, e.g. TM_Q4_JOIN_TILED_U in q4_gemv.cu), for an
# A/B of the engine on the GPU machine with one binary: TM_KERNELS_DIR picks the directory.
#
#   bash scripts/gpu_kernel_variants.sh OUT_DIR 'ju2:-DTM_Q4_JOIN_TILED_U=2' 'ru3:-DTM_Q4_ROPE_TILED_U=3' ...
#
# writes OUT_DIR/kernels-<name> per argument (`cargo xtask build-kernels --arch $TM_KERNEL_ARCH`,
# default sm_90, with $NVCC or the nvcc xtask finds, behind a wrapper that appends the flags).
# Carry OUT_DIR with the bundle; run the binary built without embedded kernels
# (TM_BUNDLE_KERNELS=separate in scripts/gpu_bundle.sh) with TM_KERNELS_DIR=OUT_DIR/kernels-<name>.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
OUT="${1:?usage: gpu_kernel_variants.sh OUT_DIR name:flags ...}"
shift
ARCH="${TM_KERNEL_ARCH:-sm_90}"
NV="${NVCC:-$(command -v nvcc || true)}"
if [ -z "$NV" ]; then
    NV=$(ls -d "$HOME"/.cache/tm/nvcc-*/lib/python3*/site-packages/nvidia/cu13/bin/nvcc 2>/dev/null | head -1)
fi
[ -x "$NV" ] || { echo "nvcc not found: set NVCC" >&2; exit 1; }
mkdir -p "$OUT"
WRAP=$(mktemp -d)
trap 'rm -rf "$WRAP"' EXIT
for v in "$@"; do
    name=${v%%:*}
    flags=${v#*:}
    printf '#!/bin/sh\nexec "%s" "$@" %s\n' "$NV" "$flags" > "$WRAP/nvcc-$name"
    chmod +x "$WRAP/nvcc-$name"
    rm -rf "$OUT/kernels-$name"
    NVCC="$WRAP/nvcc-$name" cargo xtask build-kernels --arch "$ARCH" --out "$OUT/kernels-$name"
    echo "$OUT/kernels-$name: $flags"
done
