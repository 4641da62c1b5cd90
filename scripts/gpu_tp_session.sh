#!/usr/bin/env bash
# One device call on a machine with 2+ GPUs (nvidia-h200-x2): tensor parallelism end to end.
# Run from the repository root after scripts/gpu_tp_bundle.sh, carrying target/gpu-tp:
#
#   OUT=/some/dir bash scripts/gpu_tp_session.sh [tests|cli|bench|all|peer-tests|peer-bench]
#
# peer-tests / peer-bench: the short list for the one-shot peer collectives and CUDA graphs under
# --tp (about 4 minutes each): the peer tests (the fused all-reduce + add + norm included), the
# stall tests on both paths, the fixtures and the engine with graphs on, the same with
# NCCL_P2P_DISABLE=1; batch-1 decode of the 8B-shaped model at tp=1, tp=2, tp=2 with
# TM_FUSED_ALLREDUCE_NORM=0 (separate all-reduce and add_rms_norm kernels), and tp=2 with
# NCCL_P2P_DISABLE=1 (NCCL only, no graphs).
#
# Writes at most 8 files to $OUT: env.txt (nvidia-smi, topology, check-env with the NCCL
# self-test), tests.txt and tests-nop2p.txt (crates/tm-cuda/tests/tensor_parallel.rs, the second
# with NCCL_P2P_DISABLE=1), cli.txt (tp=1 vs tp=2 text, the stall hook through the CLI),
# bench.txt (Llama-3-8B-shaped bf16 from scripts/make_llama8b.py: batch-1 decode at tp=1 and tp=2,
# 256 concurrent requests) and summary.txt.
set -uo pipefail
OUT="${OUT:-target/gpu-logs}"
mkdir -p "$OUT"
WHAT="${1:-all}"
B=/tmp/tm-tp
mkdir -p "$B"
tar -C "$B" -xJf target/gpu-tp/bin.tar.xz || { echo "no bundle: run scripts/gpu_tp_bundle.sh and carry target/gpu-tp"; exit 2; }
CLI="$B/tm-cli"
TP="$B/tensor_parallel"
export RUST_BACKTRACE=1 TM_FIXTURES="$PWD/fixtures"
S="$OUT/summary.txt"
say() { echo "$*" | tee -a "$S"; }
secs() { python3 -c 'import time; print(f"{time.time():.3f}")'; }

export NCCL_NVLS_ENABLE=0

if [ "$WHAT" = peer-tests ]; then
    { nvidia-smi topo -m; timeout 60 "$CLI" check-env; } >"$OUT/env.txt" 2>&1
    say "check-env rc=$?"
    grep -E "custom all-reduce|NCCL self-test|NCCL transport" "$OUT/env.txt" | tee -a "$S"
    timeout 420 "$TP" --test-threads=1 --nocapture peer_ fused_ small_all a_rank_that a_stalled fixtures_tp2 engine_over \
        >"$OUT/tests.txt" 2>&1
    say "tensor_parallel (peer path, graphs) rc=$?"
    grep -E "^test |test result|: ok |FAIL|skipped|collectives: peer|stall at|failed after|stopped in|after the fault|greedy differs|per all-reduce|checked|graph rounds|panicked" \
        "$OUT/tests.txt" | head -80 | tee -a "$S"
    NCCL_P2P_DISABLE=1 timeout 150 "$TP" --test-threads=1 --nocapture a_stalled engine_over >"$OUT/tests-nop2p.txt" 2>&1
    say "tensor_parallel NCCL_P2P_DISABLE=1 rc=$?"
    grep -E "^test |test result|collectives: peer|stall at|failed after|panicked" "$OUT/tests-nop2p.txt" | head -20 | tee -a "$S"
fi

if [ "$WHAT" = peer-bench ]; then
    R="$OUT/bench.txt"
    : >"$R"
    [ -f /tmp/l8b/tokenizer_config.json ] || timeout 200 python3 scripts/make_llama8b.py /tmp/l8b >>"$R" 2>&1 || say "make_llama8b failed"
    pb() {
        local name=$1
        shift
        echo "== bench $name: $*" >>"$R"
        RUST_LOG=info timeout 150 "$CLI" bench --model /tmp/l8b --backend cuda --num-prompts 3 --concurrency 1 \
            --input-len 512 --output-len 128 "$@" >/tmp/bench.txt 2>&1
        local rc=$?
        cat /tmp/bench.txt >>"$R"
        say "bench $name (exit $rc): $(grep -E 'output throughput' /tmp/bench.txt | sed 's/  */ /g'); $(grep -E '^TPOT' /tmp/bench.txt | sed 's/  */ /g')"
        grep -E "engine ms/step|cuda graphs:|CUDA graphs|first collective|one-shot|every collective goes" /tmp/bench.txt | cut -c1-300 | head -8 | tee -a "$S"
    }
    pb tp1-b1 --tp 1
    pb tp2-b1 --tp 2
    TM_FUSED_ALLREDUCE_NORM=0 pb tp2-b1-unfused --tp 2
    NCCL_P2P_DISABLE=1 pb tp2-b1-nop2p --tp 2
fi

if [ "$WHAT" = all ] || [ "$WHAT" = tests ]; then
    { nvidia-smi; nvidia-smi topo -m; env | grep -E '^NCCL|^CUDA' ; } >"$OUT/env.txt" 2>&1
    timeout 120 "$CLI" check-env >>"$OUT/env.txt" 2>&1
    say "check-env rc=$?"
    grep -E "NCCL|GPU[0-9]|device\(s\)" "$OUT/env.txt" | grep -v "^GPU[0-9]" | head -12 | tee -a "$S"
    timeout 400 "$TP" --test-threads=1 --nocapture >"$OUT/tests.txt" 2>&1
    say "tensor_parallel tests rc=$?"
    grep -E "^test |test result|: ok |FAIL|skipped|ranks: init|transport|stall at|stopped in|after the faults|greedy differs|per all-reduce|panicked" "$OUT/tests.txt" | head -60 | tee -a "$S"
    NCCL_P2P_DISABLE=1 timeout 200 "$TP" --test-threads=1 --nocapture nccl_self engine_over a_stalled small_all >"$OUT/tests-nop2p.txt" 2>&1
    say "tensor_parallel NCCL_P2P_DISABLE=1 rc=$?"
    grep -E "^test |test result|transport|ranks: init|stall at|per all-reduce|panicked" "$OUT/tests-nop2p.txt" | head -20 | tee -a "$S"
fi

if [ "$WHAT" = all ] || [ "$WHAT" = cli ]; then
    C="$OUT/cli.txt"
    : >"$C"
    gen() { timeout 120 "$CLI" generate --backend cuda --prompt "Hello there" --temperature 0 --max-tokens 24 "$@" 2>>"$C"; }
    for m in llama qwen3 mistral; do
        for d in f32 bf16; do
            one="$(gen --model fixtures/$m --dtype $d --tp 1)"
            two="$(gen --model fixtures/$m --dtype $d --tp 2)"
            nop2p="$(NCCL_P2P_DISABLE=1 gen --model fixtures/$m --dtype $d --tp 2)"
            printf '%s %s\n tp1:   %q\n tp2:   %q\n nop2p: %q\n' "$m" "$d" "$one" "$two" "$nop2p" >>"$C"
            if [ -n "$one" ] && [ "$one" = "$two" ] && [ "$one" = "$nop2p" ]; then say "cli $m $d: tp=2 text == tp=1 text (P2P and NCCL_P2P_DISABLE=1)"; else say "cli $m $d: DIFFERENT (see cli.txt)"; fi
        done
    done
    for hook in 1:4 0:1; do
        t0=$(secs)
        TM_TP_STALL=$hook timeout 60 "$CLI" generate --backend cuda --model fixtures/llama --tp 2 --comm-timeout 2 \
            --prompt "Hello" --max-tokens 8 >>"$C" 2>"$OUT/stall.err"
        rc=$?
        t1=$(secs)
        cat "$OUT/stall.err" >>"$C"
        say "cli stall $hook (--comm-timeout 2): exit $rc after $(python3 -c "print(f'{$t1-$t0:.2f}')") s: $(grep -o 'error: .*' "$OUT/stall.err" | cut -c1-400)"
    done
    rm -f "$OUT/stall.err"
fi

if [ "$WHAT" = all ] || [ "$WHAT" = bench ]; then
    R="$OUT/bench.txt"
    : >"$R"
    t0=$(secs)
    python3 scripts/make_llama8b.py /tmp/l8b >>"$R" 2>&1 || say "make_llama8b failed"
    say "make_llama8b: $(python3 -c "print(f'{$(secs)-$t0:.0f}')") s"
    b() {
        local name=$1
        shift
        echo "== bench $name: $*" >>"$R"
        RUST_LOG=info timeout 240 "$CLI" bench --model /tmp/l8b --backend cuda "$@" >/tmp/bench.txt 2>&1
        local rc=$?
        cat /tmp/bench.txt >>"$R"
        say "bench $name (exit $rc): $(grep -E 'output throughput' /tmp/bench.txt | sed 's/  */ /g'); $(grep -E '^TPOT' /tmp/bench.txt | sed 's/  */ /g')"
    }
    b tp1-b1 --tp 1 --num-prompts 3 --concurrency 1 --input-len 512 --output-len 128
    b tp2-b1 --tp 2 --num-prompts 3 --concurrency 1 --input-len 512 --output-len 128
    b tp2-c256 --tp 2 --num-prompts 256 --concurrency 256 --input-len 512 --output-len 256
    b tp1-c256 --tp 1 --num-prompts 256 --concurrency 256 --input-len 512 --output-len 256
    grep -E "NCCL|peer access|memory plan" "$R" | sort | uniq | head -12 | tee -a "$S"
fi
