"""Extracts the split-K merge of attention.cu (decode_range, combine_splits, decode_merge,
attn_combine) for the host emulation attn_merge_emu.cpp (see README.md), turning each
`__shared__` declaration into per-CTA storage: python3 attn_merge_gen.py IN.cu OUT.inc"""
import re, sys

s = open(sys.argv[1]).read()


def body_end(i):
    """Index just past the closing brace of the first brace block at or after i."""
    j = s.index("{", i)
    depth = 0
    while True:
        if s[j] == "{":
            depth += 1
        elif s[j] == "}":
            depth -= 1
            if depth == 0:
                return j + 1
        j += 1


parts = []
i = s.index("__device__ __forceinline__ float neg_inf()")
parts.append(s[i:s.index("\n", i)])
# DecodeRange .. the end of decode_merge (decode_range, split_keys, TM_ATTN_MAX_SPLITS, combine_splits)
i = s.index("struct DecodeRange {")
j = s.index("__device__ __forceinline__ void decode_merge(")
parts.append(s[i:body_end(j)])
i = s.index("template <typename T>\n__device__ __forceinline__ void attn_combine(")
parts.append(s[i:body_end(i)])
out = "\n\n".join(parts) + "\n"


def shared(m):
    ty, decls = m.group(1), m.group(2)
    res = []
    for d in decls.split(","):
        d = d.strip()
        a = re.fullmatch(r"(\w+)\[(.+)\]", d)
        if a:
            res.append(f'{ty}* {a.group(1)} = emu_shared<{ty}>("{a.group(1)}", {a.group(2)});')
        else:
            res.append(f'{ty}& {d} = *emu_shared<{ty}>("{d}", 1);')
    return " ".join(res)


out = re.sub(r"__shared__ (\w+) ([^;]+);", shared, out)
assert "__shared__" not in out
open(sys.argv[2], "w").write(out)
