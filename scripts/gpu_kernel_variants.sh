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
#
# With TM_VARIANT_MODULE=<module> (e.g. q4_gemv) only that module's cubin is built, straight with
# nvcc (~1 min instead of ~1.5 per variant; xtask's flags), into OUT_DIR/kernels-<name>/: overlay
# it on a copy of the full kernels directory on the GPU machine,
#   cp -r kernels kernels-<name> && cp OUT_DIR/kernels-<name>/*.cubin kernels-<name>/
# so that the directory's manifest still names the binary's sources and PDL stays on (a
# directory whose manifest differs is launched without PDL, which no A/B should compare).
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
    if [ -n "${TM_VARIANT_MODULE:-}" ]; then
        sm=${ARCH#sm_}
        code=$ARCH
        [ "$sm" = 90 ] && code=sm_90a  # xtask builds sm_90 cubins arch-specific
        rm -rf "$OUT/kernels-$name"
        mkdir -p "$OUT/kernels-$name"
        # shellcheck disable=SC2086  # the flags are words
        "$NV" -O3 -std=c++17 -cubin -gencode "arch=compute_${code#sm_},code=$code" $flags \
            -I crates/tm-kernels/cuda -o "$OUT/kernels-$name/$TM_VARIANT_MODULE.$ARCH.cubin" \
            "crates/tm-kernels/cuda/$TM_VARIANT_MODULE.cu"
        echo "$OUT/kernels-$name/$TM_VARIANT_MODULE.$ARCH.cubin: $flags"
        continue
    fi
    printf '#!/bin/sh\nexec "%s" "$@" %s\n' "$NV" "$flags" > "$WRAP/nvcc-$name"
    chmod +x "$WRAP/nvcc-$name"
    rm -rf "$OUT/kernels-$name"
    NVCC="$WRAP/nvcc-$name" cargo xtask build-kernels --arch "$ARCH" --out "$OUT/kernels-$name"
    echo "$OUT/kernels-$name: $flags"
done
