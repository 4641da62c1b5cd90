"""Prints the GPU's copy bandwidth (read + write bytes per second of a device-to-device copy), the
ceiling tm's decode figures are given against (roofline = weight bytes / this). Run on the GPU
machine, where torch is installed:

    python3 scripts/gpu/copy_bandwidth.py [--gib 4] [--runs 20]

The median of `--runs` timed copies (CUDA events) of a `--gib` GiB buffer, after three warm-ups.
"""
import argparse

import torch

ap = argparse.ArgumentParser()
ap.add_argument("--gib", type=int, default=4)
ap.add_argument("--runs", type=int, default=20)
args = ap.parse_args()
n = args.gib << 30
a = torch.empty(n, dtype=torch.uint8, device="cuda")
b = torch.empty_like(a)
a.random_(0, 255)
for _ in range(3):
    b.copy_(a)
start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
times = []
for _ in range(args.runs):
    start.record()
    b.copy_(a)
    end.record()
    torch.cuda.synchronize()
    times.append(start.elapsed_time(end) / 1e3)
times.sort()
t = times[len(times) // 2]
print(f"copy bandwidth (read+write, {args.gib} GiB, median of {args.runs}): {2 * n / t / 1e12:.3f} TB/s")
