#!/usr/bin/env bash
# One device call: the CUDA test suite, then the Llama-3-8B-shaped benchmark, logs under $OUT.
# Run from the repository root on the GPU machine after scripts/gpu_bundle.sh built the bundle:
#   OUT=/some/dir bash scripts/gpu_session.sh [suite|bench|all]
set -uo pipefail
OUT="${OUT:-target/gpu-logs}"
mkdir -p "$OUT"
WHAT="${1:-all}"
CLI=target/gpu-bundle/bin/tm-cli
export TM_KERNELS_DIR="${TM_KERNELS_DIR:-$PWD/target/gpu-bundle/kernels}"
nvidia-smi --query-gpu=name,memory.total,memory.used,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
python3 scripts/gpu/copy_bandwidth.py 2>&1 | tee "$OUT/bandwidth.txt"
if [ "$WHAT" = all ] || [ "$WHAT" = suite ]; then
    $CLI check-env > "$OUT/check-env.txt" 2>&1
    TM_TEST_TIMEOUT=${TM_TEST_TIMEOUT:-90} OUT="$OUT/suite" bash target/gpu-bundle/run.sh > "$OUT/suite.txt" 2>&1
    echo "suite exit $?"; tail -15 "$OUT/suite/summary.txt" 2>/dev/null
fi
if [ "$WHAT" = all ] || [ "$WHAT" = bench ]; then
    python3 scripts/make_llama8b.py /tmp/l8b > "$OUT/make8b.txt" 2>&1 || { echo "make8b failed"; tail "$OUT/make8b.txt"; }
    export RUST_LOG=info
    b() { local name=$1; shift; timeout 100 $CLI bench --model /tmp/l8b --backend cuda "$@" > "$OUT/bench-$name.txt" 2>&1; echo "== bench $name (exit $?)"; tail -12 "$OUT/bench-$name.txt"; }
    b b1 --num-prompts 3 --concurrency 1 --input-len 512 --output-len 128
    b b64 --num-prompts 64 --concurrency 64 --input-len 512 --output-len 256
    b c256 --num-prompts 256 --concurrency 256 --input-len 512 --output-len 256
fi
