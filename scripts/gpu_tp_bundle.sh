#!/usr/bin/env bash
# Builds what the tensor-parallel GPU session (scripts/gpu_tp_session.sh) needs into
# target/gpu-tp/bin.tar.xz: the release tm-cli and the tm-cuda `tensor_parallel` test binary,
# kernels embedded, debug info stripped (about 25 MiB). Carry target/gpu-tp to the GPU machine.
#
#   bash scripts/gpu_tp_bundle.sh
#
# Uses the kernels cargo embeds (build them first with `cargo xtask build-kernels --arch sm_90`,
# or they are compiled with NVRTC at run time).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
OUTDIR="${TM_TP_BUNDLE_DIR:-$ROOT/target/gpu-tp}"
JSON="$(mktemp)"
trap 'rm -f "$JSON"' EXIT
cargo test --release -p tm-cuda --test tensor_parallel --no-run --message-format=json-render-diagnostics >"$JSON"
TEST="$(python3 -c '
import json, sys
for line in open(sys.argv[1]):
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "tensor_parallel":
        print(m["executable"])' "$JSON" | tail -1)"
[ -x "$TEST" ] || { echo "no tensor_parallel test binary" >&2; exit 1; }
cargo build --release -p tm-cli
STAGE="$(mktemp -d)"
cp "$TEST" "$STAGE/tensor_parallel"
cp target/release/tm-cli "$STAGE/tm-cli"
strip --strip-debug "$STAGE"/*
rm -rf "$OUTDIR"
mkdir -p "$OUTDIR"
tar -C "$STAGE" -cf - . | xz -T0 -6 >"$OUTDIR/bin.tar.xz"
rm -rf "$STAGE"
{
    echo "revision: $(git rev-parse --short HEAD)$(git diff --quiet || echo ' (with uncommitted changes)')"
    echo "built: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    ls -l "$OUTDIR/bin.tar.xz"
} | tee "$OUTDIR/MANIFEST"
