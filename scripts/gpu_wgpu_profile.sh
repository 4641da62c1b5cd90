#!/usr/bin/env bash
# The wgpu backend on the GPU machine's Vulkan driver: where a batch-1 decode step's time goes
# (TM_WGPU_PROFILE=1: GPU time per kernel, time between passes, host recording), TPOT per
# variant, and CUDA on the same checkpoint for scale. About 3-4 minutes.
#
# Here: build tm-cli (it embeds the sm_90 kernels of target/kernels when they match), then
#   mkdir -p target/wgpu-ab && cp target/release/tm-cli target/wgpu-ab/ && strip target/wgpu-ab/tm-cli \
#     && xz -T2 -6 -f target/wgpu-ab/tm-cli
# and on the GPU machine (carry [".gl", "target/wgpu-ab"]), from the repository root:
#   OUT=$OUT bash scripts/gpu_wgpu_profile.sh
# The profiled run's prompt is 8 tokens (PROFILE_INPUT), which the decode kernels take as well,
# so its profile is that of decode steps; the timed run's is 128 tokens (INPUT).
# Environment: VARIANTS (space-separated; `base` or NAME=VALUE[,NAME=VALUE] environment for
# tm-cli, where bin=FILE runs target/wgpu-ab/FILE instead (other builds, carried as FILE.xz);
# default `base`), LAYERS (of the Llama-3-8B-shaped random checkpoint, default 8: each
# layer's products are those of the 8B model, lm_head and embeddings whole), CUDA=0 skips the
# CUDA run, LONG (default 2048; 0: none) the prompt length of a profiled run at long context (first variant only), SUITES=0 the wgpu test suites (run when target/wgpu-ab holds wgpu_conformance and
# wgpu_end_to_end, the tm-wgpu test binaries, as in gpu_vulkan.sh), MODEL=path replaces the checkpoint. Results: $OUT/summary.txt, and $OUT/logs.tgz (profile-*.txt, bench-*.txt, ...).
set -uo pipefail
START=$SECONDS
OUT="${OUT:-target/gpu-logs/wgpu}"
mkdir -p "$OUT"
: >"$OUT/summary.txt"
log() { echo "[$((SECONDS - START))s] $*" | tee -a "$OUT/summary.txt"; }
for z in target/wgpu-ab/*.xz; do
    [ -f "$z" ] && [ ! -x "${z%.xz}" ] || continue
    python3 -c "import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], 'wb'))" "$z" "${z%.xz}" &&
        chmod +x "${z%.xz}"
done
CLI=target/wgpu-ab/tm-cli
. scripts/vulkan_env.sh || exit 1
export TM_WGPU_MEMORY_CAP="${TM_WGPU_MEMORY_CAP:-60G}"
MODEL="${MODEL:-/tmp/l8b-${LAYERS:-8}}"
if [ ! -e "$MODEL" ]; then
    timeout 200 python3 scripts/make_llama8b.py "$MODEL" --layers "${LAYERS:-8}" >"$OUT/make.txt" 2>&1 ||
        { log "make_llama8b failed: $(tail -2 "$OUT/make.txt")"; exit 1; }
    log "checkpoint: $(tail -1 "$OUT/make.txt"), $(du -sh "$MODEL" | cut -f1)"
fi
run() { # name, timeout, extra arguments; INPUT: the prompt length (default 128)
    local name=$1 t=$2
    shift 2
    timeout "$t" "${VCLI:-$CLI}" bench --model "$MODEL" --num-prompts 1 --concurrency 1 --input-len "${INPUT:-128}" "$@" \
        >"$OUT/$name.txt" 2>&1
    log "$name: exit $? $(grep -E 'TPOT' "$OUT/$name.txt" | head -1)"
}
VARIANTS="${VARIANTS:-base}"
for v in $VARIANTS; do
    envs=()
    [ "$v" = base ] || IFS=, read -r -a envs <<<"$v"
    tag=$(echo "$v" | tr -c 'A-Za-z0-9_.\n-' '_')
    (
        for e in "${envs[@]}"; do
            case "$e" in
            bin=*) VCLI="target/wgpu-ab/${e#bin=}" ;;
            *) export "${e?}" ;;
            esac
        done
        # A prompt of 8 tokens takes the decode kernels too, so the profile is of decode steps.
        TM_WGPU_PROFILE=1 INPUT="${PROFILE_INPUT:-8}" run "profile-$tag" 120 --backend wgpu --output-len 16
        grep -A14 '^wgpu profile' "$OUT/profile-$tag.txt" | tee -a "$OUT/summary.txt"
        run "bench-$tag" 120 --backend wgpu --output-len 32
        if [ "${LONG:-2048}" != 0 ] && [ "$v" = "${VARIANTS%% *}" ]; then
            TM_WGPU_PROFILE=1 INPUT="${LONG:-2048}" run "long-$tag" 150 --backend wgpu --output-len 16
            grep -A14 '^wgpu profile' "$OUT/long-$tag.txt" | tee -a "$OUT/summary.txt"
        fi
    )
done
[ "${CUDA:-1}" = 0 ] || run bench-cuda 120 --backend cuda --output-len 32
# The wgpu suites on this GPU, when their binaries were carried (as gpu_vulkan.sh runs them).
for t in wgpu_conformance wgpu_end_to_end; do
    [ "${SUITES:-1}" != 0 ] && [ -x "target/wgpu-ab/$t" ] || continue
    TM_FIXTURES="$PWD/fixtures" TM_DEFAULT_MODEL=/nonexistent/default-model.gguf \
        timeout 90 "target/wgpu-ab/$t" --test-threads=1 --nocapture >"$OUT/$t.txt" 2>&1
    log "$t: exit $? $(grep -E '^test result' "$OUT/$t.txt" | tail -1)"
    grep -E '^test .*FAILED|panicked' "$OUT/$t.txt" | head -5 | tee -a "$OUT/summary.txt"
done
log "done"
(cd "$OUT" && tar czf logs.tgz --exclude=summary.txt --exclude=logs.tgz ./*.txt && find . -name '*.txt' ! -name summary.txt -delete)
