#!/usr/bin/env python3
"""Checks built CUDA kernels for loads hoisted above their programmatic-dependent-launch wait.

A non-coherent load (`__ldg`, or a `const __restrict__` pointer: PTX `ld.global.nc`, SASS
`LDG ... .CONSTANT`) promises that nothing writes the data while the kernel runs, so ptxas may move
it above `griddepcontrol.wait` (SASS `ACQBULK`,
tm-kernels' `tmk::pdl_wait`). A kernel launched with programmatic dependent launch then reads the
previous kernel's output before that kernel has written it: a silent race. Kernels load what an
earlier kernel wrote with `__ldca` (common.cuh), which stays below the wait; weights, which no
kernel writes, may use any load.

Usage: check_pdl_order.py CUBIN_OR_DIR... (needs `cuobjdump` and `nvdisasm` on PATH or in the
directory of $CUOBJDUMP), or `check_pdl_order.py --self-test` (the SASS scan on a built-in sample). Exits 1, naming the kernels, when any function that waits has a
non-coherent load before its first wait.
"""
import os
import re
import shutil
import subprocess
import sys


def cubins(paths):
    for p in paths:
        if os.path.isdir(p):
            for root, _, files in os.walk(p):
                yield from (os.path.join(root, f) for f in sorted(files) if f.endswith(".cubin"))
        else:
            yield p


def hoisted(sass):
    """(function, [load lines]) for each function with non-coherent loads above its first wait."""
    out, fn, waited, pre, has_wait = [], None, False, [], False

    def flush():
        if fn and has_wait and pre:
            out.append((fn, pre))

    for line in sass.splitlines():
        m = re.search(r"Function : (\S+)", line)
        if m:
            flush()
            fn, waited, pre, has_wait = m.group(1), False, [], False
            continue
        if "ACQBULK" in line:
            waited = has_wait = True
        elif not waited and re.search(r"\bLDG\.[A-Z0-9.]*CONSTANT\b", line):
            pre.append(re.sub(r"\s+", " ", line.split(";")[0].split("*/")[-1]).strip())
    flush()
    return out


# Two functions as cuobjdump prints them: `late` waits before its activation load, `early` has a
# non-coherent load above its wait (the q4_gemv hoisting), `nowait` never waits (not checked).
SELF_TEST_SASS = """
        Function : late
        /*0000*/                   LDG.E.EF.128 R4, desc[UR6][R2.64] ;
        /*0010*/                   ACQBULK ;
        /*0020*/                   LDG.E.128.CONSTANT R8, desc[UR6][R6.64] ;
        Function : early
        /*0000*/               @P0 LDG.E.128.CONSTANT R28, desc[UR6][R4.64] ;
        /*0010*/                   ACQBULK ;
        Function : nowait
        /*0000*/                   LDG.E.64.CONSTANT R2, desc[UR4][R2.64] ;
"""


def self_test():
    """Checks `hoisted` on SELF_TEST_SASS: only `early` is flagged, with its load."""
    got = hoisted(SELF_TEST_SASS)
    want = [("early", ["@P0 LDG.E.128.CONSTANT R28, desc[UR6][R4.64]"])]
    if got != want:
        print(f"check_pdl_order: self-test failed: {got} != {want}", file=sys.stderr)
        return 1
    print("check_pdl_order: self-test passed")
    return 0


def main():
    if len(sys.argv) < 2:
        print(__doc__)
        return 2
    if sys.argv[1] == "--self-test":
        return self_test()
    tool = os.environ.get("CUOBJDUMP") or shutil.which("cuobjdump")
    if not tool:
        print("check_pdl_order: cuobjdump not found (set CUOBJDUMP)", file=sys.stderr)
        return 2
    env = dict(os.environ, PATH=os.path.dirname(os.path.abspath(tool)) + os.pathsep + os.environ.get("PATH", ""))
    bad, checked = [], 0
    for c in cubins(sys.argv[1:]):
        r = subprocess.run([tool, "-sass", c], capture_output=True, text=True, env=env)
        if r.returncode != 0:
            print(f"check_pdl_order: cuobjdump failed on {c}: {r.stderr.strip()}", file=sys.stderr)
            return 2
        checked += 1
        bad += [(c, fn, pre) for fn, pre in hoisted(r.stdout)]
    for c, fn, pre in bad:
        print(f"{os.path.basename(c)}: {fn}: {len(pre)} non-coherent load(s) above griddepcontrol.wait, e.g. {pre[0]}")
    if bad:
        print("check_pdl_order: loads of a previous kernel's output may run before it is written; "
              "load them with __ldca (or another coherent load), never __ldg", file=sys.stderr)
        return 1
    print(f"check_pdl_order: {checked} cubins, no non-coherent load above a PDL wait")
    return 0


if __name__ == "__main__":
    sys.exit(main())
