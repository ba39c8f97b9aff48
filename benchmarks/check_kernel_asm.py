"""Are two trees' Triton kernels the same machine code? An AOT compile for sm_90 (no GPU
needed: Triton's bundled ptxas) of the fused linear ops' kernels under a few constexpr
configurations, and the PTX (line info stripped) compared.

    python benchmarks/check_kernel_asm.py save FILE     # compile this tree's kernels
    python benchmarks/check_kernel_asm.py compare A B   # same PTX, kernel by kernel

Run with PYTHONPATH pointing at the tree (src/). Kernels: linear_cross_entropy's
(``triton_lib.lce_kernels``), linear_log_probs' (``triton_lib.log_probs_kernels`` or,
before that move, ``ops.linear_log_probs.triton_kernels``), the truncation's threshold
pass (``triton_lib.log_probs_candidates``), log_probs' on logits
(``triton_lib.log_probs_logits_kernels``) and the log-prob epilogues
(``triton_lib.log_probs_epilogue``, ``triton_lib.log_probs_fields``). A pure refactor of kernel
code (helpers that Triton inlines) must leave the PTX unchanged: then every result on
the GPU is bitwise the same. TRITON_INTERPRET must not be set (this compiles). The PTX is
also the compiler's: files saved under different Triton versions are not compared (triton
3.6.0 and 3.9.0 give other PTX for all 30 configs, with the same shared memory).
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import re
import sys

os.environ.pop("TRITON_INTERPRET", None)
os.environ.setdefault("TRITON_DISABLE_LINE_INFO", "1")

CONFIGS = {
    # name: (dtype, constexprs, num_warps, num_stages)
    # ALL_PTRS: the optional (None-default) pointers are given, as a launch with their flags on.
    "bf16-ptrs-all-flags": ("bf16", dict(
        HAS_BIAS=True, HAS_SOFTCAP=True, HAS_CW=True, NEED_SMOOTH=True, NEED_ARGMAX=True, KEEP=True,
        ENTROPY=True, DOT_PRECISION="tf32", USE_TMA=False, DZ_TMA=False, FLATTEN=False,
        FIELDS=True, HAS_THRESHOLD=True, ALL_PTRS=True, HAS_UPPER=True,
        BLOCK_N=64, BLOCK_V=64, BLOCK_H=32), 4, 3),
    "bf16-tma-flatten": ("bf16", dict(
        HAS_BIAS=False, HAS_SOFTCAP=False, HAS_CW=False, NEED_SMOOTH=False, NEED_ARGMAX=False, KEEP=True,
        ENTROPY=False, DOT_PRECISION="tf32", USE_TMA=True, DZ_TMA=True, FLATTEN=True,
        IDX=True, HAS_G_H=False, BLOCK_N=128, BLOCK_V=128, BLOCK_H=64), 8, 3),
    "fp32-tf32x3-softcap": ("fp32", dict(
        HAS_BIAS=True, HAS_SOFTCAP=True, HAS_CW=False, NEED_SMOOTH=True, NEED_ARGMAX=False, KEEP=False,
        ENTROPY=True, DOT_PRECISION="tf32x3", USE_TMA=False, DZ_TMA=False, FLATTEN=True,
        IDX=True, HAS_UPPER=True, C=64, HAS_G_LP=False, BLOCK_N=64, BLOCK_V=64, BLOCK_H=32), 4, 2),
    # fp32 at "high" on operands pre-rounded to TF32, W in chunks (tiles.CUDA_TILES_TF32).
    "fp32-tf32-wchunk-tma": ("fp32", dict(
        HAS_BIAS=True, HAS_SOFTCAP=False, HAS_CW=False, NEED_SMOOTH=False, NEED_ARGMAX=False, KEEP=False,
        ENTROPY=False, DOT_PRECISION="tf32", USE_TMA=True, DZ_TMA=False, FLATTEN=True, W_CHUNK=True,
        BLOCK_N=128, BLOCK_V=256, BLOCK_H=32), 8, 4),
    "fp32-tf32-wchunk-tma-keep": ("fp32", dict(
        HAS_BIAS=False, HAS_SOFTCAP=True, HAS_CW=True, NEED_SMOOTH=True, NEED_ARGMAX=True, KEEP=True,
        ENTROPY=True, DOT_PRECISION="tf32", USE_TMA=True, DZ_TMA=False, FLATTEN=True, W_CHUNK=True,
        BLOCK_N=128, BLOCK_V=128, BLOCK_H=32), 8, 4),
}

KERNELS = {
    # op: (modules tried in turn, kernels[, constexprs a config may override, compile options])
    "lce": (["logitless.triton_lib.lce_kernels"],
            ["forward_stats_kernel", "dlogits_kernel", "kept_dlogits_kernel"]),
    "llp": (["logitless.triton_lib.log_probs_kernels", "logitless.ops.linear_log_probs.triton_kernels"],
            ["logp_forward_kernel", "logp_dlogits_kernel", "logp_kept_dlogits_kernel"]),
    "cand": (["logitless.triton_lib.log_probs_candidates"], ["candidates_kernel", "mass_kernel"],
             dict(C=16, T=4, IDX=False, HAS_UPPER=False)),
    "lpl": (["logitless.triton_lib.log_probs_logits_kernels"], ["lp_forward_kernel", "lp_backward_kernel"]),
    # (the epilogues' launches: BLOCK 1024, 4 warps, contraction off; the dtype is unused)
    "lpe": (["logitless.triton_lib.log_probs_epilogue"],
            ["logp_forward_epilogue_kernel", "logp_grad_coefficients_kernel"],
            dict(BLOCK=1024, HAS_G_LP=True, HAS_G_H=True), dict(num_warps=4, enable_fp_fusion=False)),
    "lpf": (["logitless.triton_lib.log_probs_fields"], ["fields_epilogue_kernel"],
            dict(BLOCK=1024), dict(num_warps=4, enable_fp_fusion=False)),
}

#: Pointer arguments in the input dtype (or descriptors with TMA); other pointers are fp32
#: unless named here.
IN_DTYPE = {"x_ptr", "w_ptr", "b_ptr", "keep_ptr", "dz_ptr", "z_ptr"}
OTHER_PTR = {"target_ptr": "*i64", "token_ptr": "*i64", "tokens_ptr": "*i64", "part_arg_ptr": "*i32",
             "part_arg": "*i32", "idx_ptr": "*i32", "cnt_ptr": "*i32", "top1_ptr": "*i8"}
FLOATS = {"softcap", "inv_temp", "temperature", "inv_t"}


def _desc(dtype, block):
    return f"tensordesc<{dtype}[{block[0]}, {block[1]}]>"


def signature(fn, dtype, c):
    tma = c["USE_TMA"]
    desc_blocks = {"x_ptr": (c["BLOCK_N"], c["BLOCK_H"]), "w_ptr": (c["BLOCK_V"], c["BLOCK_H"]),
                   "keep_ptr": (c["BLOCK_N"], c["BLOCK_V"])}
    sig, consts = {}, {}
    kept_kernel = "H" not in fn.arg_names  # kernels without a GEMM (kept dlogits, on logits) take plain pointers
    # Constexprs a config does not name take their defaults (as at a launch that omits them).
    defaults = {p.name: p.default for p in fn.params if p.is_constexpr and p.has_default}
    # Pointers that default to None (optional inputs of a constexpr-gated feature) are
    # None, as at a launch that omits them (pointers under the config's ALL_PTRS).
    absent = {p.name for p in fn.params if not p.is_constexpr and p.has_default and p.default is None}
    for a in fn.arg_names:
        if a in absent and a not in c and not c.get("ALL_PTRS"):
            sig[a], consts[a] = "constexpr", None
        elif a in c or a in defaults:
            sig[a], consts[a] = "constexpr", c.get(a, defaults.get(a))
        elif a.endswith("_ptr") or a.startswith("part_"):
            if a in IN_DTYPE:
                use_desc = not kept_kernel and ((tma and a in desc_blocks) or (a == "dz_ptr" and c["DZ_TMA"]))
                block = desc_blocks.get(a, (c["BLOCK_N"], c["BLOCK_V"]))
                sig[a] = _desc(dtype, block) if use_desc else f"*{dtype}"
            else:
                sig[a] = OTHER_PTR.get(a, "*fp32")
        else:
            sig[a] = "fp32" if a in FLOATS else "i32"
    return sig, consts


def strip(ptx: str) -> str:
    ptx = re.sub(r"^\s*\.(loc|file)\b.*$", "", ptx, flags=re.M)
    ptx = re.sub(r"\.section\s+\.debug_\w+\s*\{.*?\}", "", ptx, flags=re.S)
    return "\n".join(line.rstrip() for line in ptx.splitlines() if line.strip())


def compile_all():
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    out = {}
    for op, (modules, names, *extra) in KERNELS.items():
        base, opts = (list(extra) + [{}, {}])[:2]
        mod = None
        for m in modules:
            try:
                mod = importlib.import_module(m)
                break
            except ImportError:
                continue
        if mod is None:
            print(f"{op}: no module among {modules}", file=sys.stderr)
            continue
        for name in names:
            fn = getattr(mod, name)
            for cname, (dtype, c, warps, stages) in CONFIGS.items():
                key = f"{op}/{name}/{cname}"
                sig, consts = signature(fn, dtype, {**base, **c})
                try:
                    k = triton.compile(ASTSource(fn, sig, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                                       options={**dict(num_warps=warps, num_stages=stages), **opts})
                    ptx = strip(k.asm["ptx"])
                    out[key] = dict(sha=hashlib.sha256(ptx.encode()).hexdigest(), lines=ptx.count("\n") + 1,
                                    shared=getattr(k.metadata, "shared", None))
                except Exception as e:  # noqa: BLE001 (a config a kernel cannot take is reported, not fatal)
                    out[key] = dict(error=f"{type(e).__name__}: {str(e)[:300]}")
                print(key, out[key], flush=True)
    return out


_TRITON = "_triton_version"  # the saved file's key for the Triton that compiled it


def main(argv):
    if argv[:1] == ["save"] and len(argv) == 2:
        import triton

        res = compile_all()
        res[_TRITON] = triton.__version__
        with open(argv[1], "w") as f:
            json.dump(res, f, indent=1, sort_keys=True)
        return 0
    if argv[:1] == ["compare"] and len(argv) == 3:
        a, b = (json.load(open(p)) for p in argv[1:])
        va, vb = a.pop(_TRITON, None), b.pop(_TRITON, None)
        if va and vb and va != vb:
            print(f"saved under triton {va} and {vb}: the PTX differs by the compiler; save both trees "
                  f"under one Triton")
            return 2
        keys = sorted(set(a) & set(b))
        same = [k for k in keys if "sha" in a[k] and a[k] == b[k]]
        bad = [k for k in keys if k not in same]
        print(f"{len(same)}/{len(keys)} kernel configs compile to the same PTX"
              + (f"; differ or fail: {bad}" if bad else "")
              + (f"; only in one: {sorted(set(a) ^ set(b))}" if set(a) ^ set(b) else ""))
        return 1 if bad or not keys else 0
    print(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
