#!/usr/bin/env bash
# Issue 7's open figure in one device call: AWQ Llama-3-8B-shaped batch-1 decode against bf16 on
# the same card (target >= 2.4x; the issue asks for it on the H200), as a fraction of the int4
# roofline, with the GPU suite after it when time is left.
#
# Here (no GPU; a fresh checkout has no target/, so build everything first, ~10 min on 2 cores):
#   bash scripts/gpu_b1_ratio.sh build
# installs the pinned nvcc wheels when missing (scripts/cuda_wheels.sh, as .ci/run does), builds
# the sm_90 kernels and the bundle with them shipped separately (scripts/gpu_bundle.sh,
# TM_BUNDLE_KERNELS=separate), and a stripped examples/q4_gemv_bench into target/gpu-bundle/bin/. Then a device call from the
# repository root, carry ["target/gpu-bundle"], kind nvidia-h200:
#   OUT=$OUT bash scripts/gpu_b1_ratio.sh
# It exits 3 within a second when the GPU's name lacks $REQUIRE_GPU (default H200; empty: any
# card), so a call that got another card costs only the machine's start. Otherwise:
# scripts/gpu_b1_ab.sh with VARIANTS=base ROUNDS=3 BF16=1 and the cold q4_gemv_bench at n = 1
# (f16, --variants ln), the ratio and roofline line, then target/gpu-bundle/run.sh if at least
# 150 s of LIMIT (default 560) are left. Results: $OUT/ratio.txt, $OUT/ab/ (summary.txt,
# bandwidth.txt, logs.tgz), $OUT/suite/summary.txt, $OUT/suite-logs.tgz.
set -u
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

if [ "${1:-}" = build ]; then
    set -e
    . scripts/cuda_wheels.sh
    ensure_nvcc
    NVCC="$NVCC_BIN" TM_KERNEL_ARCH=sm_90 TM_BUNDLE_KERNELS=separate bash scripts/gpu_bundle.sh
    # The bundle's build embeds no kernels; the bench must match it (same TM_KERNELS_DIR at build
    # time), or its manifest check would launch without programmatic dependent launch.
    TM_KERNELS_DIR="$ROOT/target/gpu-bundle-no-kernels" cargo build --release -p tm-cuda --example q4_gemv_bench
    cp target/release/examples/q4_gemv_bench target/gpu-bundle/bin/
    strip target/gpu-bundle/bin/q4_gemv_bench
    du -sh target/gpu-bundle
    exit 0
fi

OUTD="${OUT:-target/gpu-logs}"
mkdir -p "$OUTD"
name=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1)
echo "GPU: $name" | tee "$OUTD/ratio.txt"
want="${REQUIRE_GPU-H200}"
case "$name" in
*"$want"*) ;;
*)
    echo "gpu_b1_ratio: not an $want: nothing run" | tee -a "$OUTD/ratio.txt"
    exit 3
    ;;
esac
mkdir -p "$OUTD/ab"
bench=target/gpu-bundle/bin/q4_gemv_bench
[ -x "$bench" ] || bench=
OUT="$OUTD/ab" VARIANTS=base ROUNDS="${ROUNDS:-3}" BF16=1 ROUND_DEADLINE_S="${ROUND_DEADLINE_S:-200}" \
    GEMV_BENCH="$bench" GEMV_ARGS="--n 1 --iters 200 --variants ln" timeout "${AB_T:-360}" bash scripts/gpu_b1_ab.sh
# The ratio: mean bf16 replay over mean AWQ replay; the roofline: the AWQ checkpoint's weight bytes
# (the loader's "MB of weights") over the measured copy bandwidth.
awk -v bw="$(grep -o '[0-9.]* TB/s' "$OUTD/ab/bandwidth.txt" | head -n 1 | cut -d' ' -f1)" \
    -v mb="$(tar xzf "$OUTD/ab/logs.tgz" -O b1ab/awq-b1-base-1.txt 2>/dev/null | grep -o '[0-9.]* MB of weights' | head -n 1 | cut -d' ' -f1)" '
    /^awq-b1-base/ { if (match($0, /took [0-9.]+ us/)) { a += substr($0, RSTART + 5, RLENGTH - 8); na++ } }
    /^bf16-b1/ { if (match($0, /took [0-9.]+ us/)) { b += substr($0, RSTART + 5, RLENGTH - 8); nb++ } }
    END {
        if (na == 0 || nb == 0) { print "ratio: missing runs (awq " na ", bf16 " nb ")"; exit }
        a /= na; b /= nb
        printf "AWQ b1 replay %.1f us (mean of %d), bf16 %.1f us (mean of %d): %.2fx bf16\n", a, na, b, nb, b / a
        if (bw > 0 && mb > 0) printf "roofline %.1f us (%.1f MB at %.3f TB/s): AWQ at %.1f%%\n", mb / bw, mb, bw, 100 * (mb / bw) / a
    }' "$OUTD/ab/summary.txt" | tee -a "$OUTD/ratio.txt"
cat "$OUTD/ab/summary.txt"
if [ -n "$bench" ]; then tar xzf "$OUTD/ab/logs.tgz" -O b1ab/gemv-base.txt 2>/dev/null | grep -E "(ops|ln graph|ln chain) "; fi
if [ $((SECONDS + 150)) -lt "${LIMIT:-560}" ]; then
    OUT="$OUTD/suite" TM_TEST_TIMEOUT=$(((${LIMIT:-560} - SECONDS - 20) / 3)) bash target/gpu-bundle/run.sh >"$OUTD/suite-run.txt" 2>&1
    echo "suite exit $? at t=${SECONDS}s"
    cat "$OUTD/suite/summary.txt"
    (cd "$OUTD/suite" && tar czf ../suite-logs.tgz ./*.log && rm -f ./*.log)
    gzip -f "$OUTD/suite-run.txt"
else
    echo "suite skipped at t=${SECONDS}s"
fi
