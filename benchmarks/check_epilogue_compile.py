"""AOT compile (sm_90, no GPU needed) of the fused cross-entropy epilogue kernels
(``triton_lib.ce_epilogue``, ``triton_lib.log_probs_epilogue``) for every constexpr combination, without fp contraction
(as they are launched); fails on a Triton compile error, and checks the PTX has no
fused multiply-add (the per-token values must be bitwise the torch formulas').

    PYTHONPATH=src python benchmarks/check_epilogue_compile.py
"""

from __future__ import annotations

import itertools
import os

os.environ.pop("TRITON_INTERPRET", None)  # this compiles

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

from logitless.triton_lib import ce_epilogue, log_probs_epilogue  # noqa: E402

FLOAT_ARGS = {"one_minus_eps", "eps_over_v", "w_sum", "z_loss", "smooth_a", "two_z_loss", "inv_t"}
FP32_PTRS = {"part_max", "part_sum", "part_tgt", "part_smooth", "part_u"}


def signature(kernel, constexprs):
    sig = {}
    for a in kernel.arg_names:
        if a in constexprs:
            sig[a] = "constexpr"
        elif a in ("target_ptr", "tokens_ptr"):
            sig[a] = "*i64"
        elif a.endswith("_ptr") or a in FP32_PTRS:
            sig[a] = "*fp32"
        elif a in FLOAT_ARGS:
            sig[a] = "fp32"
        elif a == "ignore_index":
            sig[a] = "i64"
        else:
            sig[a] = "i32"
    return sig


def main() -> int:
    target = GPUTarget("cuda", 90, 32)
    for kernel in (ce_epilogue.ce_forward_epilogue_kernel, ce_epilogue.ce_grad_coefficients_kernel,
                   log_probs_epilogue.logp_forward_epilogue_kernel, log_probs_epilogue.logp_grad_coefficients_kernel):
        flags = [kernel.arg_names[i] for i in kernel.constexprs if kernel.arg_names[i] != "BLOCK"]
        choices = [[0, 1, 2] if f == "REDUCTION" else [False, True] for f in flags]
        count = fma = 0
        for values in itertools.product(*choices):
            c = dict(zip(flags, values), BLOCK=ce_epilogue.BLOCK)
            compiled = triton.compile(
                triton.compiler.ASTSource(fn=kernel, signature=signature(kernel, c), constexprs=c),
                target=target, options=dict(num_warps=4, enable_fp_fusion=False))
            count += 1
            fma += "fma.rn.f32" in compiled.asm["ptx"]
        print(f"{kernel.fn.__name__}: {count} configurations compiled for sm_90, {fma} with fma")
        if fma:
            return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
