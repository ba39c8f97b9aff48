"""AOT-compile the distillation row-statistics kernels (triton_lib/jsd_rows.py) for sm_90
on the CPU, with the specialisations Triton applies at run time (unit column strides,
16-divisible pointers, V and row strides): catches compile errors and shows that the
sweeps use 16-byte vector loads and do not spill. No GPU needed:

    PYTHONPATH=src python benchmarks/check_jsd_rows_asm.py
"""

import re
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from logitless.triton_lib import jsd_rows as R

FLOATS = {"inv_t", "log_beta", "log_1mbeta", "cap_s", "cap_t"}
DIVISIBLE = {"zs_ptr", "zt_ptr", "part_ptr", "sk_ptr", "stats_ptr", "N", "V", "stride_sn", "stride_tn"}


def compile_one(fn, consts, warps):
    consts = dict(consts, **{a: 1 for a in ("stride_sv", "stride_tv") if a in fn.arg_names})
    sig = {}
    for a in fn.arg_names:
        if a in consts:
            sig[a] = "constexpr"
        elif a.endswith("_ptr"):
            sig[a] = "*i64" if a == "target_ptr" else "*fp32"
        else:
            sig[a] = "fp32" if a in FLOATS else "i32"
    attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(fn.arg_names) if a in DIVISIBLE}
    return triton.compile(ASTSource(fn, sig, constexprs=consts, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=warps, num_stages=3))


def main() -> int:
    ok = True
    for mode in (0, 1, 2):
        for hard in (False, True):
            base = dict(MODE=mode, HAS_CAP_S=hard, HAS_CAP_T=hard)
            jobs = [(R.jsd_partial_kernel, dict(base, HAS_HARD=hard, BLOCK_N=1, BLOCK_V=4096, BLOCKS_PER_SPLIT=4), 8),
                    (R.jsd_finish_kernel, dict(MODE=mode, HAS_HARD=hard, HAS_CAP_S=hard, BLOCK_N=128), 4),
                    (R.jsd_forward_kernel, dict(base, HAS_HARD=hard, BLOCK_N=1, BLOCK_V=4096), 8)]
            if mode == 0:
                jobs.append((R.jsd_divergence_kernel, dict(base, BLOCK_N=1, BLOCK_V=4096, BLOCKS_PER_SPLIT=4), 8))
            for fn, c, w in jobs:
                try:
                    ptx = compile_one(fn, c, w).asm["ptx"]
                    loads = sorted(set(re.findall(r"ld\.global[.\w]*", ptx)))
                    print(f"{fn.__name__:24s} mode={mode} caps/hard={hard!s:5s} ok: ptx {ptx.count(chr(10))} lines, "
                          f"loads {loads}, local memory (spills) {'yes' if '.local' in ptx else 'no'}")
                except Exception as e:  # noqa: BLE001 (report every configuration)
                    ok = False
                    print(f"{fn.__name__} mode={mode} hard={hard}: FAILED {type(e).__name__}: {str(e)[:400]}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
