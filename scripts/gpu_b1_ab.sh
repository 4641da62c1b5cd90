#!/usr/bin/env bash
# One device call that A/Bs kernel variants on the AWQ 8B batch-1 decode step (issue 7's open
# target), with the figures the ratio needs from the same call: copy bandwidth and, optionally,
# bf16 batch 1 on the same card.
#
# Here (no GPU):
#   TM_BUNDLE_KERNELS=separate bash scripts/gpu_bundle.sh
#   TM_VARIANT_MODULE=q4_gemv bash scripts/gpu_kernel_variants.sh target/variants 'base:' \
#       'j3:-DTM_Q4_JOIN_TILED_U=3'
# On the GPU machine (carry target/gpu-bundle and target/variants), from the repository root:
#   VARIANTS="base j3" ROUNDS=3 BF16=1 OUT=dir bash scripts/gpu_b1_ab.sh
#
# Each variant's kernels are the bundle's kernels/ with target/variants/kernels-<name>/*.cubin laid
# over them (the bundle's manifest.txt stays, so the binary keeps PDL on), and its runs get the
# environment in target/variants/kernels-<name>/env if there is one (KEY=VALUE lines, e.g.
# TM_GATE_UP_TILED_SCALES=0 for a variant that changes a layout, not a kernel). A variant folder with
# a `tm-cli` (another build of the engine, e.g. stripped from another commit's bundle) runs that
# binary, and then its folder must hold that build's manifest.txt (this bundle's would not match
# that binary's sources and would leave PDL off) and those of its cubins that differ from this
# bundle's (`cmp`; the rest come from the bundle, which keeps the carry under its limit). `base`
# should be built with no flags, so that every variant comes from the same compiler run. Rounds
# alternate the variants (base j3 base j3 ...): clocks and the machine drift within a call. Writes
# $OUT/summary.txt (per run: the graph replay time of a decode step, output tok/s and TPOT p50),
# $OUT/bandwidth.txt and $OUT/logs.tgz (every log). Environment: VARIANTS (default "base"),
# ROUNDS (default 2), BF16=1 (also make the bf16 checkpoint and run it twice; ~16 GB, minutes),
# GEMV_BENCH=path (a stripped q4_gemv_bench, run once per variant while the checkpoints are made,
# with GEMV_ARGS, e.g. "--variants ln --iters 100", after --dtype f16),
# GEMM_BENCH=path (a stripped q4_gemm_bench: prefill products against cuBLAS, run once, also
# while the checkpoints are made), C64=1 (after the batch-1 runs, the base kernels and bf16 at
# concurrency 64, 512 in / 256 out), OUTPUT_LEN (default 128; 512 tokens in), ROUND_DEADLINE_S
# (default 420: no AWQ round starts after this many seconds of the script, so the bf16 runs still
# fit a 600-s call), REQUIRE_GPU (e.g. H200: exit 3 at once, running nothing, when the GPU's name
# does not contain it).
set -u
FINAL="${OUT:-target/gpu-logs}"
LOGS=/tmp/b1ab
rm -rf "$LOGS"
mkdir -p "$FINAL" "$LOGS"
finish() {
    tar czf "$FINAL/logs.tgz" -C /tmp b1ab
    cp "$LOGS/summary.txt" "$LOGS/bandwidth.txt" "$FINAL/" 2>/dev/null
}
trap finish EXIT
trap 'exit 1' TERM INT
BUNDLE=target/gpu-bundle
CLI=$BUNDLE/bin/tm-cli
VARIANTS="${VARIANTS:-base}"
if [ -n "${REQUIRE_GPU:-}" ]; then
    # e.g. REQUIRE_GPU=H200: a call that asked for an H200 and got another card stops here, in
    # seconds, instead of spending minutes of device time on figures for the wrong card.
    name=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1)
    case "$name" in
    *"$REQUIRE_GPU"*) ;;
    *)
        echo "gpu_b1_ab: the GPU is '$name', not $REQUIRE_GPU: nothing run" | tee "$LOGS/summary.txt" >&2
        exit 3
        ;;
    esac
fi
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv >"$LOGS/gpu.txt" 2>&1
cat "$LOGS/gpu.txt" >>"$LOGS/summary.txt"

(python3 scripts/make_llama8b_awq.py /tmp/b1ab-awq >"$LOGS/make-awq.txt" 2>&1) &
AWQ=$!
BF=
if [ "${BF16:-0}" = 1 ]; then
    (python3 scripts/make_llama8b.py /tmp/b1ab-bf16 >"$LOGS/make-bf16.txt" 2>&1) &
    BF=$!
fi

python3 scripts/gpu/copy_bandwidth.py >"$LOGS/bandwidth.txt" 2>&1
cat "$LOGS/bandwidth.txt" >>"$LOGS/summary.txt"

for v in $VARIANTS; do
    mkdir -p "/tmp/b1ab-k-$v"
    cp "$BUNDLE"/kernels/* "/tmp/b1ab-k-$v/"
    if [ -f "target/variants/kernels-$v/tm-cli" ]; then
        cp "target/variants/kernels-$v"/* "/tmp/b1ab-k-$v/"
        [ -f "/tmp/b1ab-k-$v/manifest.txt" ] || {
            echo "gpu_b1_ab: kernels-$v has a tm-cli but no manifest.txt" | tee -a "$LOGS/summary.txt" >&2
            exit 1
        }
    elif [ -d "target/variants/kernels-$v" ]; then
        cp "target/variants/kernels-$v"/*.cubin "/tmp/b1ab-k-$v/" 2>/dev/null
        if [ -f "target/variants/kernels-$v/env" ]; then cp "target/variants/kernels-$v/env" "/tmp/b1ab-k-$v/"; fi
    elif [ "$v" != base ]; then
        echo "gpu_b1_ab: no target/variants/kernels-$v" | tee -a "$LOGS/summary.txt" >&2
        exit 1
    fi
    if [ -n "${GEMV_BENCH:-}" ]; then
        # shellcheck disable=SC2086 # GEMV_ARGS is a list of arguments
        TM_KERNELS_DIR="/tmp/b1ab-k-$v" timeout 90 "$GEMV_BENCH" --dtype f16 ${GEMV_ARGS:-} >"$LOGS/gemv-$v.txt" 2>&1
        echo "q4_gemv_bench $v: exit $?" >>"$LOGS/summary.txt"
    fi
done
if [ -n "${GEMM_BENCH:-}" ]; then
    TM_KERNELS_DIR=/tmp/b1ab-k-base timeout 150 "$GEMM_BENCH" --dtype both --m 512,2048,8192 >"$LOGS/gemm.txt" 2>&1
    echo "q4_gemm_bench: exit $? (t=${SECONDS}s)" >>"$LOGS/summary.txt"
fi

export RUST_LOG=info
SHAPE_B1="--num-prompts 3 --concurrency 1 --input-len 512 --output-len ${OUTPUT_LEN:-128}"
SHAPE_C64="--num-prompts 64 --concurrency 64 --input-len 512 --output-len 256"
# bench NAME KERNELS MODEL DTYPE [SHAPE]: batch-1 decode of 3 prompts of 512 tokens, or SHAPE.
bench() {
    local log="$LOGS/$1.txt" vars=()
    if [ -f "$2/env" ]; then mapfile -t vars <"$2/env"; fi
    # shellcheck disable=SC2086 # the shape is a list of arguments
    local cli="$CLI"
    if [ -x "$2/tm-cli" ]; then cli="$2/tm-cli"; fi
    env "${vars[@]}" TM_KERNELS_DIR="$2" timeout 150 "$cli" bench --model "$3" --backend cuda --dtype "$4" ${5:-$SHAPE_B1} >"$log" 2>&1
    local rc=$?
    echo "$1 (t=${SECONDS}s) exit $rc: $(grep -o 'a replay took [0-9.]* us' "$log" | tail -1)," \
        "$(grep -o 'output throughput *[0-9.]* tok/s' "$log"), $(grep -o 'TPOT (ms) *p50 [0-9.]*' "$log")" |
        tee -a "$LOGS/summary.txt"
}
wait $AWQ
echo "awq checkpoint made at t=${SECONDS}s" >>"$LOGS/summary.txt"
for r in $(seq 1 "${ROUNDS:-2}"); do
    if [ "$r" -gt 1 ] && [ "$SECONDS" -gt "${ROUND_DEADLINE_S:-420}" ]; then
        echo "round $r skipped: t=${SECONDS}s is past ROUND_DEADLINE_S" >>"$LOGS/summary.txt"
        break
    fi
    for v in $VARIANTS; do bench "awq-b1-$v-$r" "/tmp/b1ab-k-$v" /tmp/b1ab-awq f16; done
done
if [ -n "$BF" ]; then
    wait "$BF"
    for r in 1 2; do bench "bf16-b1-$r" /tmp/b1ab-k-base /tmp/b1ab-bf16 bf16; done
fi
if [ "${C64:-0}" = 1 ]; then
    bench awq-c64 /tmp/b1ab-k-base /tmp/b1ab-awq f16 "$SHAPE_C64"
    if [ -n "$BF" ]; then bench bf16-c64 /tmp/b1ab-k-base /tmp/b1ab-bf16 bf16 "$SHAPE_C64"; fi
fi
