"""AOT-compile linear_jsd's fused kernels (``triton_lib/linear_jsd_kernels.py``:
``jsd_dlogits_kernel``, ``jsd_kl_forward_kernel``) and the fused epilogues (``triton_lib/jsd_epilogue.py``) for
sm_90 on the CPU (no GPU needed): compile errors, shared memory, spills, and the PTX to
compare two trees (a change that must leave a configuration's code alone):

    PYTHONPATH=<tree>/src python benchmarks/check_jsd_dlogits_asm.py save FILE
    python benchmarks/check_jsd_dlogits_asm.py compare A B

Configurations: bf16 at the H100 tiles with TMA and with pointers (every flag), fp32 at
"highest" (3xTF32), fp32 at "high" rounding in registers ("tf32-round") and on
pre-rounded W chunks ("tf32", W_CHUNK: new, absent from older trees); the KL limits' fused
forward (``jsd_kl_forward_kernel``) at bf16, both modes, TMA and pointers.
"""

import hashlib
import json
import os
import re
import sys

os.environ.pop("TRITON_INTERPRET", None)
os.environ.setdefault("TRITON_DISABLE_LINE_INFO", "1")

FLOATS = {"inv_t", "wp", "hlw", "log_beta", "log_1mbeta", "cap_s", "cap_t"}
BASE = dict(MODE=0, HAS_HARD=False, HAS_CAP_S=False, HAS_CAP_T=False, HAS_BIAS_S=False, HAS_BIAS_T=False)
ALL = dict(MODE=0, HAS_HARD=True, HAS_CAP_S=True, HAS_CAP_T=True, HAS_BIAS_S=True, HAS_BIAS_T=True)
CONFIGS = {
    "bf16-tma": ("bf16", dict(BASE, DOT_PRECISION="tf32", USE_TMA=True, BLOCK_N=128, BLOCK_V=128, BLOCK_H=64), 8, 3),
    "bf16-ptrs-all": ("bf16", dict(ALL, DOT_PRECISION="tf32", USE_TMA=False, BLOCK_N=128, BLOCK_V=128, BLOCK_H=64),
                      8, 3),
    "fp32-tf32x3-tma": ("fp32", dict(BASE, DOT_PRECISION="tf32x3", USE_TMA=True, BLOCK_N=64, BLOCK_V=128,
                                     BLOCK_H=32), 8, 2),
    "fp32-tf32round-tma": ("fp32", dict(BASE, DOT_PRECISION="tf32-round", USE_TMA=True, BLOCK_N=64, BLOCK_V=128,
                                        BLOCK_H=32), 8, 2),
    "fp32-prerounded-wchunk-tma": ("fp32", dict(BASE, DOT_PRECISION="tf32", USE_TMA=True, W_CHUNK=True,
                                                BLOCK_N=64, BLOCK_V=128, BLOCK_H=32), 8, 2),
    "fp32-prerounded-wchunk-ptrs-all": ("fp32", dict(ALL, DOT_PRECISION="tf32", USE_TMA=False, W_CHUNK=True,
                                                     BLOCK_N=64, BLOCK_V=128, BLOCK_H=32), 8, 2),
}


def _strip(ptx: str) -> str:
    ptx = re.sub(r"^\s*\.(loc|file)\b.*$", "", ptx, flags=re.M)
    ptx = re.sub(r"\.section\s+\.debug_\w+\s*\{.*?\}", "", ptx, flags=re.S)
    return "\n".join(line.rstrip() for line in ptx.splitlines() if line.strip())


def _compile(fn, sig, consts, warps, stages):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    k = triton.compile(ASTSource(fn, sig, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=warps, num_stages=stages))
    ptx = _strip(k.asm["ptx"])
    return dict(sha=hashlib.sha256(ptx.encode()).hexdigest(), lines=ptx.count("\n") + 1,
                shared=getattr(k.metadata, "shared", None), spills=".local" in ptx)


#: The KL limits' fused forward (``jsd_kl_forward_kernel``; absent from older trees): bf16 at
#: the H100 tiles (4 stages, shipped), both modes, TMA and pointers (every flag).
KL_CONFIGS = {
    f"kl-forward-mode{m}-{kind}": ("bf16", dict(flags, MODE=m, DOT_PRECISION="tf32", USE_TMA=kind == "tma",
                                                BLOCK_N=128, BLOCK_V=128, BLOCK_H=64), 8, 4)
    for m in (1, 2) for kind, flags in (("tma", BASE), ("ptrs-all", ALL))
}


def _configure(fn, dtype, c):
    """(signature, constexprs) of ``fn`` for configuration ``c``: constexprs a configuration
    does not name take their defaults (as a launch omitting them)."""
    defaults = {p.name: p.default for p in fn.params if p.is_constexpr and p.has_default}
    sig, consts = {}, {}
    for a in fn.arg_names:
        if a in c or a in defaults:
            sig[a], consts[a] = "constexpr", c.get(a, defaults.get(a))
        elif a in ("xs_ptr", "xt_ptr", "ws_ptr", "wt_ptr"):
            block = (c["BLOCK_N"] if a[0] == "x" else c["BLOCK_V"], c["BLOCK_H"])
            sig[a] = f"tensordesc<{dtype}[{block[0]}, {block[1]}]>" if c["USE_TMA"] else f"*{dtype}"
        elif a in ("bs_ptr", "bt_ptr", "dz_ptr"):
            sig[a] = f"*{dtype}"
        elif a.endswith("_ptr"):
            sig[a] = "*i64" if a == "target_ptr" else "*fp32"
        else:
            sig[a] = "fp32" if a in FLOATS else "i32"
    return sig, consts


def save(path):
    from logitless.triton_lib import linear_jsd_kernels as K

    out = {}
    jobs = [(K.jsd_dlogits_kernel, CONFIGS)]
    if hasattr(K, "jsd_kl_forward_kernel"):
        jobs.append((K.jsd_kl_forward_kernel, KL_CONFIGS))
    for fn, configs in jobs:
        for cname, (dtype, c, warps, stages) in configs.items():
            if "W_CHUNK" in c and "W_CHUNK" not in fn.arg_names:
                out[cname] = dict(error="no W_CHUNK in this tree")
                continue
            try:
                out[cname] = _compile(fn, *_configure(fn, dtype, c), warps, stages)
            except Exception as e:  # noqa: BLE001 (report every configuration)
                out[cname] = dict(error=f"{type(e).__name__}: {str(e)[:300]}")
            print(cname, out[cname], flush=True)
    try:
        from logitless.triton_lib import jsd_epilogue as E
    except ImportError:
        E = None
    if E is not None:
        for red in (0, 1, 2):
            for hard in (False, True):
                sig = dict(stats_ptr="*fp32", stride_stat="i32", target_ptr="*i64", loss_ptr="*fp32", N="i32",
                           V="i32", ignore_index="i32", wq="fp32", wp="fp32", hlw="fp32")
                consts = dict(K_ROW=3, S_ROW=2, LSE1=4, ZTGT=5, HAS_HARD=hard, REDUCTION=red, BLOCK=E.BLOCK)
                key = f"loss-epilogue red={red} hard={hard}"
                out[key] = _compile(E.jsd_loss_epilogue_kernel, dict(sig, **{k: "constexpr" for k in consts}),
                                    consts, 4, 1)
                print(key, out[key], flush=True)
            sig = dict(grad_ptr="*fp32", grad_stride="i32", target_ptr="*i64", g_ptr="*fp32", N="i32",
                       ignore_index="i32")
            consts = dict(HAS_GRAD=True, REDUCTION=red, BLOCK=E.BLOCK)
            key = f"upstream red={red}"
            out[key] = _compile(E.jsd_upstream_kernel, dict(sig, **{k: "constexpr" for k in consts}), consts, 4, 1)
            print(key, out[key], flush=True)
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    bad = [k for k, v in out.items() if "error" in v and "no W_CHUNK" not in v["error"] or v.get("spills")]
    print(f"{len(out)} configurations, {len(bad)} failed or spilled: {bad}")
    return 1 if bad else 0


def compare(a_path, b_path):
    with open(a_path) as f:
        a = json.load(f)
    with open(b_path) as f:
        b = json.load(f)
    same = 0
    for k in a:
        if k not in b:
            continue
        if "sha" in a[k] and a[k].get("sha") == b[k].get("sha"):
            same += 1
            print(f"same       {k}")
        else:
            print(f"DIFFERENT  {k}: {a[k]} vs {b[k]}")
    print(f"{same} configurations with identical PTX")
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["save"] and len(sys.argv) == 3:
        sys.exit(save(sys.argv[2]))
    if sys.argv[1:2] == ["compare"] and len(sys.argv) == 4:
        sys.exit(compare(sys.argv[2], sys.argv[3]))
    sys.exit(__doc__)
