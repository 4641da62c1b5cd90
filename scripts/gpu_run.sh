#!/usr/bin/env bash
# Runs tm's GPU test suite from a bundle built by scripts/gpu_bundle.sh, on a machine with an
# NVIDIA GPU and no Rust toolchain (needs xz or python3 to unpack the tests). Run it from the
# repository root (the end-to-end tests read fixtures/ from there); the bundle copies this script
# to target/gpu-bundle/run.sh:
#
#   bash target/gpu-bundle/run.sh                      # every test binary
#   bash target/gpu-bundle/run.sh matmul               # only tests whose name contains "matmul"
#   SANITIZE=1 bash target/gpu-bundle/run.sh           # plus compute-sanitizer memcheck + racecheck
#   SANITIZE=only bash target/gpu-bundle/run.sh        # only the sanitizer runs
#
# Each test binary runs with --test-threads=1 --nocapture (every case prints an ok/FAIL line with
# its measured error), its log written to $OUT/<name>.log (OUT defaults to target/gpu-logs), and
# a summary to $OUT/summary.txt. The exit code is non-zero when anything failed.
#
# Environment:
#   OUT                 where logs go (default target/gpu-logs)
#   SANITIZE            1: also run the sanitizers; only: run just them
#   SANITIZE_FILTER     the conformance test(s) run under the sanitizers (default sanitizer_subset,
#                       a small case of every op, bf16)
#   TM_TEST_TIMEOUT     seconds per test binary (default 300; sanitizer runs get 3 times that)
#   TM_DEFAULT_MODEL    the default model's GGUF for the end-to-end tests (skipped without it)
#   TM_KERNELS_DIR      cubins loaded at run time (default: the bundle's kernels/, when it has one)
#   TM_TEST_SEED, TM_CONFORMANCE_DTYPES, TM_CONFORMANCE_CASE, TM_CUDA_DEVICE: see
#                       crates/tm-cuda/tests/conformance.rs
set -uo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
if [ -f "$HERE/tests.tar.xz" ] || [ -d "$HERE/tests" ]; then
    BUNDLE="$HERE"
else
    BUNDLE="${TM_BUNDLE_DIR:-$PWD/target/gpu-bundle}"
fi
LOGS="${OUT:-$PWD/target/gpu-logs}"
mkdir -p "$LOGS"

# The test binaries: unpacked next to the archive (again when the archive is newer), or into a
# temporary folder when the bundle is read-only.
TESTS="$BUNDLE/tests"
if [ ! -x "$TESTS/conformance" ] || [ "$BUNDLE/tests.tar.xz" -nt "$TESTS/conformance" ]; then
    [ -f "$BUNDLE/tests.tar.xz" ] || { echo "gpu_run: no bundle at $BUNDLE (build it with scripts/gpu_bundle.sh)" >&2; exit 2; }
    DEST="$BUNDLE"
    if ! { mkdir -p "$DEST/tests" && [ -w "$DEST/tests" ]; } 2>/dev/null; then
        DEST="$(mktemp -d)"
    fi
    if command -v xz >/dev/null; then
        tar -C "$DEST" -xJf "$BUNDLE/tests.tar.xz"
    else
        python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])' "$BUNDLE/tests.tar.xz" "$DEST"
    fi || { echo "gpu_run: unpacking $BUNDLE/tests.tar.xz failed" >&2; exit 2; }
    TESTS="$DEST/tests"
fi
TIMEOUT="${TM_TEST_TIMEOUT:-300}"
SANITIZE="${SANITIZE:-0}"
export RUST_BACKTRACE="${RUST_BACKTRACE:-1}"
export TM_FIXTURES="${TM_FIXTURES:-$PWD/fixtures}"
# A bundle built with TM_BUNDLE_KERNELS=separate ships its cubins in kernels/.
if [ -d "$BUNDLE/kernels" ] && [ -z "${TM_KERNELS_DIR:-}" ]; then
    export TM_KERNELS_DIR="$BUNDLE/kernels"
fi
[ -d "$TM_FIXTURES" ] || echo "gpu_run: warning: no fixtures at $TM_FIXTURES (run from the repository root)" >&2

SUMMARY="$LOGS/summary.txt"
: >"$SUMMARY"
FAILED=0

# run_one NAME COMMAND...: runs with a timeout, logs to $LOGS/NAME.log, records the outcome.
run_one() {
    local name="$1" limit="$2"
    shift 2
    local start end status
    echo "== $name: $*" | tee "$LOGS/$name.log"
    start=$(date +%s)
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee -a "$LOGS/$name.log"
    status=${PIPESTATUS[0]}
    end=$(date +%s)
    local verdict=ok
    if [ "$status" = 124 ] || [ "$status" = 137 ]; then
        verdict="TIMEOUT after ${limit}s"
    elif [ "$status" != 0 ]; then
        verdict="FAILED (exit $status)"
    fi
    [ "$verdict" = ok ] || FAILED=1
    printf '%-28s %-22s %4ss\n' "$name" "$verdict" "$((end - start))" | tee -a "$SUMMARY"
}

{
    echo "bundle: $BUNDLE"
    head -n 5 "$BUNDLE/MANIFEST" 2>/dev/null
    nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv 2>&1 || echo "nvidia-smi failed"
} >"$LOGS/environment.txt"
cat "$LOGS/environment.txt"
"$BUNDLE/bin/tm-cli" check-env >"$LOGS/check-env.log" 2>&1 || echo "tm-cli check-env failed (see $LOGS/check-env.log)"

if [ "$SANITIZE" != only ]; then
    for name in tm_cuda_unit conformance end_to_end; do
        exe="$TESTS/$name"
        [ -x "$exe" ] || { echo "gpu_run: missing $exe" >&2; FAILED=1; continue; }
        run_one "$name" "$TIMEOUT" "$exe" --test-threads=1 --nocapture "$@"
    done
fi

if [ "$SANITIZE" != 0 ]; then
    SAN="$(command -v compute-sanitizer || true)"
    for candidate in /usr/local/cuda/bin/compute-sanitizer /usr/local/cuda-*/bin/compute-sanitizer /opt/nvidia/*/compute-sanitizer/compute-sanitizer; do
        [ -n "$SAN" ] && break
        [ -x "$candidate" ] && SAN="$candidate"
    done
    if [ -z "$SAN" ]; then
        echo "gpu_run: SANITIZE is set but compute-sanitizer was not found" | tee -a "$SUMMARY"
        FAILED=1
    else
        filter="${SANITIZE_FILTER:-sanitizer_subset}"
        for tool in memcheck racecheck; do
            run_one "sanitize-$tool" "$((TIMEOUT * 3))" "$SAN" --tool "$tool" --error-exitcode 86 \
                "$TESTS/conformance" --test-threads=1 --nocapture "$filter"
        done
    fi
fi

echo
echo "== summary (logs in $LOGS)"
cat "$SUMMARY"
grep -h '^FAIL' "$LOGS"/*.log 2>/dev/null | head -n 40
exit "$FAILED"
