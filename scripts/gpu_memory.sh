#!/usr/bin/env bash
# Issue 10 on the GPU machine: plan against measured memory in both CUDA memory models, and the
# CUDA test suites in the unified (integrated-GPU, Jetson) variant. Needs the bundle of
# scripts/gpu_bundle.sh (bin/tm-cli and the test binaries) and no Rust. Run from the repository
# root (the suites read fixtures/):
#
#   OUT=logs bash scripts/gpu_memory.sh
#
# Steps, each logged to $OUT/memory-*.log, with a summary in $OUT/memory-summary.txt:
#   1. check-env
#   2. plan tables of the model on every device profile (no GPU needed)
#   3. `plan --measure` of the model with --memory-model discrete and unified: plans, loads, serves
#      a few requests, prints the device peak (allocator peak, plus the weights read in place and
#      the pinned staging buffer in the unified model) and the process's anonymous RSS next to
#      the plan; fails when the device peak is more than 5% off the plan or loading grew the
#      host's anonymous memory beyond plan + staging
#   4. the same greedy completion in both memory models (must be identical: zero-copy weights are
#      the file's bytes)
#   5. the CUDA unit, conformance and end-to-end test binaries with TM_CUDA_MEMORY_MODEL=unified
#      (through the bundle's run.sh, logs under $OUT/unified/)
#
# Environment:
#   OUT               where logs go (default target/gpu-logs)
#   TM_BUNDLE_DIR     the bundle (default target/gpu-bundle)
#   TM_MEMORY_MODEL   the checkpoint (default /tmp/l8b, made by scripts/make_llama8b.py)
#   TM_MEASURE_FLAGS  serving flags of the plan (default below: 4096-token sessions, 64 at once)
#   TM_SKIP_SUITES=1  skip step 5
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
LOGS="${OUT:-$ROOT/target/gpu-logs}"
BUNDLE="${TM_BUNDLE_DIR:-$ROOT/target/gpu-bundle}"
MODEL="${TM_MEMORY_MODEL:-/tmp/l8b}"
TM="$BUNDLE/bin/tm-cli"
# shellcheck disable=SC2206 # word splitting of the flags is intended
FLAGS=(${TM_MEASURE_FLAGS:---max-len 4096 --max-batch-size 64 --max-batched-tokens 4096 --measure-requests 8 --measure-input-len 512 --measure-output-len 16})
mkdir -p "$LOGS"
SUMMARY="$LOGS/memory-summary.txt"
: >"$SUMMARY"
FAILED=0

[ -x "$TM" ] || { echo "gpu_memory: no $TM (build the bundle with scripts/gpu_bundle.sh)" >&2; exit 2; }
[ -d "$MODEL" ] || { echo "gpu_memory: no checkpoint at $MODEL (python3 scripts/make_llama8b.py $MODEL)" >&2; exit 2; }
if [ -d "$BUNDLE/kernels" ] && [ -z "${TM_KERNELS_DIR:-}" ]; then
    export TM_KERNELS_DIR="$BUNDLE/kernels"
fi
export RUST_LOG="${RUST_LOG:-info}"

# step NAME COMMAND...: runs it, logs to $LOGS/memory-NAME.log, records the outcome.
step() {
    local name="$1"
    shift
    echo "== $name: $*" | tee "$LOGS/memory-$name.log"
    "$@" 2>&1 | tee -a "$LOGS/memory-$name.log"
    local status=${PIPESTATUS[0]}
    if [ "$status" = 0 ]; then
        echo "ok    $name" >>"$SUMMARY"
    else
        echo "FAIL  $name (exit $status)" >>"$SUMMARY"
        FAILED=1
    fi
    return "$status"
}

step check-env "$TM" check-env

for profile in orin-nano-8gb orin-nx-16gb agx-orin-64gb rtx3060ti-8gb rtx4090-24gb h200-141gb; do
    # A plan that does not fit exits 1 with the numbers; that is a result here, not a failure.
    "$TM" plan --model "$MODEL" --device-profile "$profile" "${FLAGS[@]}" >"$LOGS/memory-profile-$profile.log" 2>&1
    echo "plan  profile $profile: exit $? ($(grep -E '^(fits|DOES NOT FIT)' "$LOGS/memory-profile-$profile.log" | head -1))" >>"$SUMMARY"
done

for mm in discrete unified; do
    step "measure-$mm" "$TM" plan --model "$MODEL" --backend cuda --memory-model "$mm" --measure "${FLAGS[@]}"
    grep -E "device peak|planned device peak|load: host" "$LOGS/memory-measure-$mm.log" | sed "s/^/      $mm: /" >>"$SUMMARY"
done

GEN=(generate --model "$MODEL" --backend cuda --prompt "The memory of a Jetson is" --temperature 0 --max-tokens 24)
for mm in discrete unified; do
    # Only the generated text goes to stdout.
    "$TM" "${GEN[@]}" --memory-model "$mm" >"$LOGS/memory-generate-$mm.txt" 2>"$LOGS/memory-generate-$mm.log"
    echo "generate $mm: exit $?" >>"$SUMMARY"
done
if [ -s "$LOGS/memory-generate-discrete.txt" ] && cmp -s "$LOGS/memory-generate-discrete.txt" "$LOGS/memory-generate-unified.txt"; then
    echo "ok    generate: the same text in both memory models" >>"$SUMMARY"
else
    echo "FAIL  generate: the memory models differ (memory-generate-{discrete,unified}.txt)" >>"$SUMMARY"
    FAILED=1
fi
grep -h -i "zero-copy\|unified memory" "$LOGS/memory-generate-unified.log" | head -3 | sed 's/^/      /' >>"$SUMMARY"

if [ "${TM_SKIP_SUITES:-0}" != 1 ]; then
    mkdir -p "$LOGS/unified"
    echo "== suites with TM_CUDA_MEMORY_MODEL=unified" | tee "$LOGS/memory-suites.log"
    if TM_CUDA_MEMORY_MODEL=unified OUT="$LOGS/unified" bash "$BUNDLE/run.sh" 2>&1 | tee -a "$LOGS/memory-suites.log" >/dev/null; then
        echo "ok    suites (TM_CUDA_MEMORY_MODEL=unified): see unified/summary.txt" >>"$SUMMARY"
    else
        echo "FAIL  suites (TM_CUDA_MEMORY_MODEL=unified): see unified/summary.txt" >>"$SUMMARY"
        FAILED=1
    fi
    sed 's/^/      /' "$LOGS/unified/summary.txt" >>"$SUMMARY" 2>/dev/null
fi

echo
cat "$SUMMARY"
exit "$FAILED"
