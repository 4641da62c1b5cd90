"""Writes q4_gemv.cu with its inline PTX (lop3, mma.sync) replaced by host code, for the host
emulation (see README.md): python3 gen.py IN.cu OUT.inc"""
import re, sys
s = open(sys.argv[1]).read()
# and_or: plain C
i = s.index("__device__ __forceinline__ unsigned and_or(")
j = s.index("}\n", i) + 2
s = s[:i] + "__device__ __forceinline__ unsigned and_or(unsigned a, unsigned mask, unsigned bits) { return (a & mask) | bits; }\n" + s[j:]
# mma: two overloads
for ty, flag in [("__half)", "false"), ("__nv_bfloat16)", "true")]:
    sig = "__device__ __forceinline__ void mma(float c[4], const unsigned a[4], unsigned b0, unsigned b1, " + ty + " {"
    i = s.index(sig)
    j = s.index("}\n", i) + 2
    s = s[:i] + sig + " emu_mma(c, a, b0, b1, " + flag + "); }\n" + s[j:]
s = s.replace('#include "common.cuh"', '#include "common.cuh"\nvoid emu_mma(float c[4], const unsigned a[4], unsigned b0, unsigned b1, bool bf16);')
open(sys.argv[2], "w").write(s)
