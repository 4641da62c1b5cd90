#!/usr/bin/env bash
# The wgpu backend on the GPU machine through Vulkan: the wgpu conformance and end-to-end suites,
# then batch-1 decode on the Llama-3-8B-shaped checkpoint (f16 weights; f32 too when time is
# left), logs under $OUT. About 4 minutes.
#
# Run from the repository root on the GPU machine, with `.gl` carried (the Vulkan loader .debs:
# see /work/.library/device/README.md, "headless rendering") and the bundle in target/gpu-bundle:
#   target/gpu-bundle/tests/wgpu_conformance   the tm-wgpu conformance test binary
#   target/gpu-bundle/tests/wgpu_end_to_end    the tm-wgpu end-to-end test binary
#   target/gpu-bundle/bin/tm-cli
# e.g.  OUT=/some/dir bash scripts/gpu_vulkan.sh
# The two test binaries, from this checkout (tm-cuda has test targets of the same names):
#   cargo test --release -p tm-wgpu --no-run --message-format=json | python3 -c 'import json, sys
#   for m in map(json.loads, sys.stdin):
#       t = m.get("target", {})
#       if m.get("executable") and t.get("kind") == ["test"] and "tm-wgpu" in m["manifest_path"]:
#           print(t["name"], m["executable"])' | while read -r name exe; do
#       install -D -m755 "$exe" "target/gpu-bundle/tests/wgpu_$name"; strip "target/gpu-bundle/tests/wgpu_$name"; done
#
# Environment: OUT (default target/gpu-logs/vulkan), TM_WGPU_ADAPTER (default: the first adapter
# check-env lists as NVIDIA), TM_WGPU_MEMORY_CAP (default 100G; wgpu cannot read the VRAM size),
# TM_DEFAULT_MODEL (the default GGUF for the conformance test; skipped without it), TM_BUNDLE_DIR
# (default target/gpu-bundle).
set -uo pipefail
START=$SECONDS
OUT="${OUT:-target/gpu-logs/vulkan}"
mkdir -p "$OUT"
BUNDLE="${TM_BUNDLE_DIR:-target/gpu-bundle}"
CLI=$BUNDLE/bin/tm-cli
log() { echo "[$((SECONDS - START))s] $*" | tee -a "$OUT/summary.txt"; }
: >"$OUT/summary.txt"

# 1. Vulkan: the loader, NVIDIA's ICD and the adapter (scripts/vulkan_env.sh).
. scripts/vulkan_env.sh || exit 1
export TM_WGPU_MEMORY_CAP="${TM_WGPU_MEMORY_CAP:-100G}"
export TM_FIXTURES="$PWD/fixtures" RUST_BACKTRACE=1
# The conformance suite's default-model test downloads nothing: without the file it skips.
export TM_DEFAULT_MODEL="${TM_DEFAULT_MODEL:-/nonexistent/default-model.gguf}"

# 2. The suites.
FAILED=0
for t in wgpu_conformance wgpu_end_to_end; do
    timeout 90 "$BUNDLE/tests/$t" --test-threads=1 --nocapture >"$OUT/$t.log" 2>&1
    status=$?
    [ "$status" = 0 ] || FAILED=1
    log "$t: exit $status; $(grep -E '^test result' "$OUT/$t.log" | tail -1)"
    grep -E '^test .*FAILED|panicked' "$OUT/$t.log" | head -5 | tee -a "$OUT/summary.txt"
done

# 3. Batch-1 decode on the 8B-shaped checkpoint. Weights: 8.03e9 parameters, 16.1 GB in f16 and
# 32.1 GB in f32 (the largest tensors, embed_tokens and lm_head [128256, 4096], are 1.05 GB and
# 2.10 GB: under the 2 GiB storage binding limit wgpu reports on NVIDIA, and bound in windows
# otherwise). Both fit the 141 GB H200 next to the small KV cache bench asks for.
if [ ! -f /tmp/l8b/config.json ]; then
    if timeout 170 python3 scripts/make_llama8b.py /tmp/l8b >"$OUT/make8b.txt" 2>&1; then
        log "checkpoint written"
    else
        log "make_llama8b failed: $(tail -2 "$OUT/make8b.txt")"
        FAILED=1
    fi
fi
bench() {
    local name=$1
    shift
    RUST_LOG=info timeout "$1" $CLI bench --model /tmp/l8b --backend wgpu --num-prompts 1 --concurrency 1 \
        --input-len 128 --output-len 32 "${@:2}" >"$OUT/bench-$name.txt" 2>&1
    local status=$?
    [ "$status" = 0 ] || FAILED=1
    log "bench wgpu $name: exit $status"
    grep -E 'tok/s|TTFT|TPOT|backend|Error|error' "$OUT/bench-$name.txt" | grep -v XDG_RUNTIME | head -8 | tee -a "$OUT/summary.txt"
}
if [ -f /tmp/l8b/config.json ]; then
    bench f16 150 --dtype bf16
    if [ $((SECONDS - START)) -lt 170 ]; then
        bench f32 $((230 - (SECONDS - START))) --dtype f32
    else
        log "bench wgpu f32: skipped (time)"
    fi
fi
log "done (failed=$FAILED)"
exit $FAILED
