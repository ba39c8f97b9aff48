"""How tl.dot lowers on sm_90 for fp32 at "high", on operands pre-rounded to TF32
(DOT_PRECISION "tf32", W_CHUNK) and rounded in the kernel ("tf32-round"): an AOT compile
on the CPU (Triton's bundled ptxas, no GPU), per kernel and tiles, of the MMA instruction
in the PTX and where the dot's A operand comes from (registers or shared memory).

    PYTHONPATH=src python benchmarks/check_tf32_lowering.py

Why it matters: the bitwise tests of tests/test_tf32_prerounded.py compare the two paths
on a GPU at the interpreter's tiles (16, 32, 16, 4 warps, 1 stage). There both lower to
the same mma.sync.m16n8k8 tf32 with register operands, on identical (TF32-exact)
values: bitwise equal results follow. At the shipped H100 tiles (128 x 128 x 32) both use
wgmma m64n128k8, A from shared memory (pre-rounded, TMA) or from registers (rounded in
the kernel): same instruction and K order, not asserted bitwise by the tests. Exits 1
when the two paths differ at the interpreter's tiles.
"""

from __future__ import annotations

import os
import re
import sys

os.environ.pop("TRITON_INTERPRET", None)
os.environ.setdefault("TRITON_DISABLE_LINE_INFO", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

TILES = {"interpreter": (16, 32, 16, 4, 1), "h100-keep": (128, 128, 32, 8, 4)}


def lowering(fn, tiles, prec):
    import triton
    from check_kernel_asm import signature
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    bn, bv, bh, warps, stages = tiles
    c = dict(HAS_BIAS=True, HAS_SOFTCAP=True, HAS_CW=True, NEED_SMOOTH=True, NEED_ARGMAX=False, KEEP=False,
             ENTROPY=True, DOT_PRECISION=prec, USE_TMA=True, DZ_TMA=False, FLATTEN=True, W_CHUNK=prec == "tf32",
             BLOCK_N=bn, BLOCK_V=bv, BLOCK_H=bh)
    sig, consts = signature(fn, "fp32", c)
    k = triton.compile(ASTSource(fn, sig, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=warps, num_stages=stages))
    mma = sorted(set(re.findall(r"(wgmma\.mma_async\S*|mma\.sync\S*)", k.asm["ptx"])))
    dots = [line for line in k.asm["ttgir"].splitlines() if "tt.dot " in line or "warp_group_dot " in line]
    # The operand types follow the first " : " that names a type (attributes hold ": i32").
    a_src = sorted({"shared" if re.search(r" : (!ttg\.memdesc|tensor<)", d).group(1) == "!ttg.memdesc"
                    else "registers" for d in dots})
    return mma, a_src


def main() -> int:
    from logitless.triton_lib import lce_kernels, log_probs_kernels

    bad = 0
    print(f"{'kernel':24} {'tiles':12} {'path':11} {'A operand':10} MMA")
    for fn in (lce_kernels.forward_stats_kernel, lce_kernels.dlogits_kernel,
               log_probs_kernels.logp_forward_kernel, log_probs_kernels.logp_dlogits_kernel):
        for tname, tiles in TILES.items():
            got = {}
            for prec in ("tf32", "tf32-round"):
                try:
                    got[prec] = lowering(fn, tiles, prec)
                except Exception as e:  # noqa: BLE001 (reported, the others still run)
                    got[prec] = (f"error: {type(e).__name__}: {str(e)[:120]}", [])
                mma, a_src = got[prec]
                print(f"{fn.fn.__name__:24} {tname:12} {prec:11} {','.join(a_src):10} {mma}")
            if tname == "interpreter" and got["tf32"] != got["tf32-round"]:
                bad += 1
                print(f"  !! {fn.fn.__name__}: the two paths lower differently at the interpreter's tiles")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
