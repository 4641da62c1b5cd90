#!/usr/bin/env bash
# Per-kernel GPU time of tm's decode steps on the 8B-shaped checkpoint, with Nsight Compute
# (kernel durations only; clocks left alone). Run on the GPU machine from the repo root after
# scripts/gpu_bundle.sh:  OUT=dir bash scripts/gpu_profile.sh
set -uo pipefail
OUT="${OUT:-target/gpu-logs}"; mkdir -p "$OUT"
export TM_KERNELS_DIR="${TM_KERNELS_DIR:-$PWD/target/gpu-bundle/kernels}"
CLI=target/gpu-bundle/bin/tm-cli
[ -d /tmp/l8b ] || python3 scripts/make_llama8b.py /tmp/l8b > "$OUT/make8b.txt" 2>&1
prof() {
    local name=$1 skip=$2 count=$3; shift 3
    timeout 200 ncu --clock-control none --csv --metrics gpu__time_duration.sum --launch-skip "$skip" \
        --launch-count "$count" $CLI bench --model /tmp/l8b --backend cuda "$@" > "$OUT/ncu-$name.csv" 2> "$OUT/ncu-$name.err"
    python3 - "$OUT/ncu-$name.csv" "$name" <<'PY'
import csv, sys, collections
rows = [r for r in csv.reader(l for l in open(sys.argv[1]) if l.startswith('"'))]
head, body = rows[0], rows[1:]
ki, vi, ui = head.index("Kernel Name"), head.index("Metric Value"), head.index("Metric Unit")
tot = collections.defaultdict(float); cnt = collections.Counter()
for r in body:
    v = float(r[vi].replace(",", "")); u = r[ui]
    v = v / 1e3 if u in ("nsecond", "ns") else v if u in ("usecond", "us") else v * 1e3
    name = r[ki].split("(")[0][:60]; tot[name] += v; cnt[name] += 1
n = sum(cnt.values()); s = sum(tot.values())
print(f"== {sys.argv[2]}: {n} kernels, {s/1e3:.2f} ms total")
for k, v in sorted(tot.items(), key=lambda x: -x[1])[:25]:
    print(f"{v/1e3:8.3f} ms {cnt[k]:6d} x {v/cnt[k]:8.2f} us  {k}")
PY
}
prof b1 3000 1476 --num-prompts 1 --concurrency 1 --input-len 512 --output-len 16
prof b256 6000 1476 --num-prompts 256 --concurrency 256 --input-len 64 --output-len 24 --num-blocks 2048
