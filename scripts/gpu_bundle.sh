#!/usr/bin/env bash
# Builds everything the GPU test suite needs into one self-contained folder (default
# target/gpu-bundle/, inside the repository's ignored target/), for a GPU machine without Rust:
#
#   tests.tar.xz  the release test binaries of tm-cuda, stripped, kernels embedded:
#                 tests/tm_cuda_unit (driver probe, device), tests/conformance (op-by-op CUDA vs
#                 CPU), tests/end_to_end (fixtures, default model, engine on CUDA). Compressed:
#                 every binary embeds the same kernel images, which xz stores once.
#   bin/tm-cli    the release CLI (check-env, generate, bench, ...), stripped, uncompressed
#   kernels/      with TM_BUNDLE_KERNELS=separate only: the cubins, loaded at run time through
#                 TM_KERNELS_DIR (run.sh sets it), and the binaries embed none (smaller)
#   run.sh        scripts/gpu_run.sh: unpacks the tests, runs the suite, logs into $OUT
#   MANIFEST      git revision, kernel arch, file sizes
#
# Usage (from anywhere in the repository):
#   bash scripts/gpu_bundle.sh
# then on the GPU machine, from the repository root (the fixtures travel with the working tree):
#   bash target/gpu-bundle/run.sh            # SANITIZE=1 adds compute-sanitizer memcheck/racecheck
#
# Environment:
#   TM_KERNEL_ARCH     kernel arch(es) for `cargo xtask build-kernels --arch` (default sm_90, H200)
#   TM_SKIP_KERNELS=1  do not build the kernels (use those already in target/kernels, or NVRTC)
#   TM_BUNDLE_KERNELS  embedded (default: the binaries exactly as `cargo build --release` makes
#                      them) or separate (build with no kernels embedded, ship the cubins once in
#                      kernels/; changing this rebuilds tm-kernels and what depends on it)
#   TM_BUNDLE_DIR      output folder (default <repo>/target/gpu-bundle)
#   TM_BUNDLE_MAX_MIB  size limit, checked at the end (default 60)
#   TM_CARGO_FLAGS     extra cargo flags, e.g. "--no-default-features --features cuda-12"
#   TM_STRIP_FLAGS     flags for strip (default --strip-debug: keeps symbol names for backtraces;
#                      falls back to a full strip when the bundle would exceed the limit)
# Needs cargo, strip (binutils) and xz.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
ARCH="${TM_KERNEL_ARCH:-sm_90}"
BUNDLE="${TM_BUNDLE_DIR:-$ROOT/target/gpu-bundle}"
MAX_MIB="${TM_BUNDLE_MAX_MIB:-60}"
STRIP_FLAGS="${TM_STRIP_FLAGS:---strip-debug}"
# shellcheck disable=SC2206 # word splitting of the flags is intended
CARGO_FLAGS=(${TM_CARGO_FLAGS:-})

say() { printf '\n== %s\n' "$*" >&2; }
die() { printf 'gpu_bundle: %s\n' "$*" >&2; exit 1; }

command -v cargo >/dev/null || die "cargo not found"
command -v strip >/dev/null || die "strip not found (binutils)"
command -v xz >/dev/null || die "xz not found (xz-utils)"

if [ "${TM_SKIP_KERNELS:-0}" = 1 ]; then
    say "kernels: skipped (TM_SKIP_KERNELS=1)"
else
    # xtask finds nvcc on PATH, CUDA_HOME, pip site-packages, .venv-nvcc; add CI's pip install.
    if [ -z "${NVCC:-}" ]; then
        for f in "${TM_NVCC_HOME:-$HOME/.cache/tm/nvcc-13.0.88}"/lib/python3*/site-packages/nvidia/cu13/bin/nvcc \
            "${TM_NVCC_HOME:-$HOME/.cache/tm/nvcc-13.0.88}"/site/nvidia/cu13/bin/nvcc; do
            if [ -x "$f" ] && ! command -v nvcc >/dev/null; then export NVCC="$f"; break; fi
        done
    fi
    say "kernels: cargo xtask build-kernels --arch $ARCH"
    cargo xtask build-kernels --arch "$ARCH" ||
        die "building the kernels failed (nvcc missing? TM_SKIP_KERNELS=1 bundles without them: NVRTC then compiles at run time)"
fi

KERNELS_FROM="${TM_KERNELS_DIR:-$ROOT/target/kernels}"
case "${TM_BUNDLE_KERNELS:-embedded}" in
embedded) ;;
separate)
    # An empty artefact folder at build time: tm-kernels embeds no cubins or PTX (sources only).
    export TM_KERNELS_DIR="$ROOT/target/gpu-bundle-no-kernels"
    mkdir -p "$TM_KERNELS_DIR"
    ;;
*) die "TM_BUNDLE_KERNELS must be embedded or separate" ;;
esac

say "test binaries: cargo test --release -p tm-cuda --no-run"
JSON="$(mktemp)"
trap 'rm -f "$JSON"' EXIT
cargo test --release -p tm-cuda "${CARGO_FLAGS[@]}" --no-run --message-format=json-render-diagnostics >"$JSON"

# "<target name> <executable>" for every test executable (lib unit tests and tests/*.rs).
list_tests() {
    if command -v jq >/dev/null; then
        jq -r 'select(.reason == "compiler-artifact" and .executable != null and .profile.test == true)
               | "\(.target.name) \(.executable)"' "$1"
    else
        python3 -c '
import json, sys
for line in open(sys.argv[1]):
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["profile"]["test"]:
        print(m["target"]["name"], m["executable"])' "$1"
    fi
}
mapfile -t TESTS < <(list_tests "$JSON")
[ "${#TESTS[@]}" -gt 0 ] || die "cargo reported no test executables for tm-cuda"

say "tm-cli: cargo build --release -p tm-cli"
cargo build --release -p tm-cli "${CARGO_FLAGS[@]}"
CLI="$ROOT/target/release/tm-cli"
[ -x "$CLI" ] || die "no $CLI after the build"

say "bundle: $BUNDLE"
rm -rf "$BUNDLE"
STAGE="$BUNDLE/.stage"
mkdir -p "$BUNDLE/bin" "$STAGE/tests"
for entry in "${TESTS[@]}"; do
    name="${entry%% *}"
    exe="${entry#* }"
    [ "$name" = tm_cuda ] && name=tm_cuda_unit
    cp "$exe" "$STAGE/tests/$name"
done
cp "$CLI" "$BUNDLE/bin/tm-cli"
if [ "${TM_BUNDLE_KERNELS:-embedded}" = separate ]; then
    mkdir -p "$BUNDLE/kernels"
    cp "$KERNELS_FROM"/*.sm_*.cubin "$BUNDLE/kernels/" 2>/dev/null ||
        die "no cubins in $KERNELS_FROM to ship (build them, or use TM_BUNDLE_KERNELS=embedded)"
    # The manifest names the sources the cubins were built from: without it the binaries take them
    # for foreign cubins and launch them without programmatic dependent launch.
    cp "$KERNELS_FROM/manifest.txt" "$BUNDLE/kernels/" 2>/dev/null ||
        die "no manifest.txt in $KERNELS_FROM (cargo xtask build-kernels writes it)"
fi
cp "$ROOT/scripts/gpu_run.sh" "$BUNDLE/run.sh"
chmod +x "$BUNDLE/run.sh" "$BUNDLE"/bin/tm-cli "$STAGE"/tests/*

bundle_bytes() { du -sb --exclude=.stage "$BUNDLE" | cut -f1; }
# pack FLAGS...: strips the binaries with FLAGS and compresses the tests.
pack() {
    strip "$@" "$BUNDLE"/bin/tm-cli "$STAGE"/tests/*
    tar -C "$STAGE" -cf - tests | xz -T0 -6 >"$BUNDLE/tests.tar.xz"
}
# shellcheck disable=SC2086 # the flags are words
pack $STRIP_FLAGS
LIMIT=$((MAX_MIB * 1024 * 1024))
if [ "$(bundle_bytes)" -gt "$LIMIT" ] && [ "$STRIP_FLAGS" != "--strip-all" ]; then
    say "over ${MAX_MIB} MiB with $STRIP_FLAGS; stripping everything (backtraces lose function names)"
    pack --strip-all
fi
TEST_LIST="$(cd "$STAGE" && find tests -type f -printf '  %p %s (in tests.tar.xz)\n' | sort)"
rm -rf "$STAGE"

{
    echo "tm GPU test bundle"
    echo "built:    $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(uname -m)"
    echo "revision: $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown)$(git -C "$ROOT" diff --quiet 2>/dev/null || echo ' (with uncommitted changes)')"
    if [ "${TM_SKIP_KERNELS:-0}" = 1 ]; then echo "kernels:  not built here (as found in $KERNELS_FROM)"; else echo "kernels:  $ARCH"; fi
    echo "shipped:  ${TM_BUNDLE_KERNELS:-embedded}"
    echo "cargo:    ${TM_CARGO_FLAGS:-default features}"
    echo "files:"
    (cd "$BUNDLE" && find . -type f ! -name MANIFEST -printf '  %p %s\n' | sort)
    echo "$TEST_LIST"
} >"$BUNDLE/MANIFEST"

BYTES="$(bundle_bytes)"
cat "$BUNDLE/MANIFEST" >&2
printf 'total: %s bytes (%s MiB, limit %s MiB)\n' "$BYTES" "$((BYTES / 1024 / 1024))" "$MAX_MIB" >&2
[ "$BYTES" -le "$LIMIT" ] || die "the bundle is $((BYTES / 1024 / 1024)) MiB, over the ${MAX_MIB} MiB limit"
say "done. On the GPU machine, from the repository root: bash ${BUNDLE#"$ROOT"/}/run.sh"
