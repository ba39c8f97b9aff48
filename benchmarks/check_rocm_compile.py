"""Do the torch ops' Triton kernels compile for AMD GPUs? An ahead-of-time compile on the
CPU (Triton's AMD backend: LLVM AMDGPU codegen and its in-process linker, no GPU, no
ROCm install) for gfx942 (MI300X) and gfx950 (MI355X), of every kernel launch the ops
make, with the tiles and kernel options the planner chooses on those GPUs.

    python benchmarks/check_rocm_compile.py capture SPECS [--full] [--arch gfx942,gfx950]
    python benchmarks/check_rocm_compile.py compile SPECS OUT [--arch gfx942,gfx950]
    python benchmarks/check_rocm_compile.py tiles OUT                 # tile candidates' registers

Run with PYTHONPATH pointing at the tree (src/). ``capture`` runs the ops on the CPU
interpreter (TRITON_INTERPRET=1, small odd shapes, bf16/fp16/fp32 and the main options:
bias, softcap, class weights, label smoothing, z-loss, argmax (return_stats), kept
columns, gradient in the forward, entropy, temperature, TRL's head fields, JSD beta
0.5 / 0 / 1, hard labels; fp32 at matmul precision "highest" and "high") with the plans
an AMD GPU gets (``planning.rocm``: its tile tables, no TMA; the row kernels' tiles as on a GPU) and
records each launch: kernel, argument types, constexprs (the dot precision is
``planning.rocm.dot_precision``'s for the target), launch options. ``compile`` compiles
each unique launch (a separate process: without the interpreter) for its target, and writes
per launch: ok, VGPRs / AGPRs / spills, LDS bytes (checked against the target's LDS),
the MFMA instructions; or the error. Exits 1 when any launch fails to compile or needs
more LDS than the target has. ``tiles`` compiles the fused GEMM kernels at candidate
tiles (how ``planning.rocm.ROCM_TILES`` were chosen). Without ``--full`` the capture
covers a representative subset (CI).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import sys
import time

TORCH_TYPES = {"torch.bfloat16": "bf16", "torch.float16": "fp16", "torch.float32": "fp32", "torch.float64": "fp64",
               "torch.int64": "i64", "torch.int32": "i32", "torch.int16": "i16", "torch.int8": "i8",
               "torch.uint8": "u8", "torch.bool": "i1"}
ARCHS = ("gfx942", "gfx950")


# ----------------------------------------------------------------------------- capture

def _cases(full: bool):
    """(label, dtype name, fp32 precision, op name, kwargs) of the op calls. Without ``full``
    a subset that still launches every kernel (CI): bf16 with most options, fp32 at "high"
    (TF32 rounding, pre-rounded operands) on the fused linear ops."""
    base = [
        ("lce-plain", "lce", dict()),
        ("lce-all", "lce", dict(bias=True, softcap=30.0, label_smoothing=0.1, class_weight=True, z_loss=1e-4,
                                return_stats=True)),
        ("lce-none-keep", "lce", dict(reduction="none", budget="all")),
        ("lce-partial", "lce", dict(budget="partial", bias=True)),
        ("lce-recompute", "lce", dict(budget="none", softcap=30.0, label_smoothing=0.1, class_weight=True)),
        ("lce-gif", "lce", dict(strategy=("grad_in_forward", 16), bias=True, softcap=30.0)),
        ("llp-entropy", "llp", dict(entropy=True, temperature=0.7, softcap=20.0, bias=True)),
        ("llp-recompute", "llp", dict(budget="none", entropy=True)),
        ("llp-topk", "llp", dict(top_k=5, top_p=0.9, entropy=True)),
        ("trl-fields", "trl", dict(bias=True, softcap=20.0, temperature=0.7)),  # FIELDS + its epilogue
        # top-p past the candidates (the mass search, the candidates below a bound), and a top_k
        # too large for the candidates kernel (the chunked threshold pass's scaled_logits_kernel)
        ("llp-topp-search", "llp", dict(top_p=0.99, min_p=0.001, temperature=5.0, entropy=True)),
        ("llp-topk-big", "llp", dict(top_k=300, top_p=0.9, v=521)),
        ("ljsd-0.5", "ljsd", dict(beta=0.5, hard_label_weight=0.3)),
        ("ljsd-kl", "ljsd", dict(beta=0.0, softcap=25.0, bias=True)),
        ("ljsd-split", "ljsd", dict(beta=0.5, v=5003)),
        ("ce", "ce", dict(label_smoothing=0.1, z_loss=1e-4, softcap=10.0, return_stats=True)),
        ("lp", "lp", dict(entropy=True, temperature=0.8)),
        ("jsd", "jsd", dict(beta=0.5, hard_label_weight=0.2)),
        ("jsd-split", "jsd", dict(beta=0.5, v=5003)),
    ]
    extra = [
        ("lce-cw-smooth", "lce", dict(class_weight=True, label_smoothing=0.2)),
        ("llp-plain", "llp", dict()),
        ("ljsd-rkl", "ljsd", dict(beta=1.0, hard_label_weight=0.5)),
        ("ljsd-rkl-bias", "ljsd", dict(beta=1.0, hard_label_weight=0.5, bias=True, softcap=20.0)),
        ("ljsd-gif", "ljsd", dict(beta=0.5, strategy=("grad_in_forward", 16))),
        ("ce-cw", "ce", dict(class_weight=True, reduction="sum")),
        ("jsd-kl", "jsd", dict(beta=1.0, softcap=15.0)),
    ]
    if not full:
        fused = ("lce-all", "lce-recompute", "llp-entropy", "llp-recompute", "ljsd-0.5", "ljsd-kl",
                 "llp-topp-search")  # (the last: the interpreter's bf16 dots give no flat rows)
        return ([(label, "bfloat16", "highest", op, kw) for label, op, kw in base]
                + [(label, "float32", "high", op, kw) for label, op, kw in base if label in fused])
    out = []
    for dt in ("bfloat16", "float16", "float32"):
        for prec in (("highest", "high") if dt == "float32" else ("highest",)):
            out += [(label, dt, prec, op, kw) for label, op, kw in base + extra]
    return out


def capture(full: bool, archs=ARCHS):
    os.environ["TRITON_INTERPRET"] = "1"
    import torch
    from triton.runtime import interpreter

    import logitless as L
    from logitless.ops.cross_entropy import triton_backend as ce_b
    from logitless.ops.jsd import triton_backend as jsd_b
    from logitless.ops.log_probs import triton_backend as lp_b
    from logitless.planning import memo, plans, rocm
    from logitless.planning.overrides import override

    # The row kernels' tiles as on a GPU (ce_triton_plan reads only device.type).
    real_ce_plan = plans.ce_triton_plan

    def gpu_ce_plan(n, v, itemsize, device):
        return real_ce_plan(n, v, itemsize, torch.device("cuda"))

    for mod in (plans, ce_b, jsd_b, lp_b):
        mod.ce_triton_plan = gpu_ce_plan
    # Plans adapted as on an AMD GPU (rocm.adapt_plan: no TMA) although the device is the CPU.
    real_arch = rocm.arch
    # The dot precision as on the AMD GPU (launch.dot_precision's HIP branch). On the
    # interpreter bf16 dots then multiply garbage (its bf16 bug, see gemm.dot): the launches,
    # not the values, are what is recorded.
    from logitless.planning.overrides import current as overrides
    from logitless.triton_lib import launch

    real_precision = launch.dot_precision
    memo.clear()

    records, seen = [], set()
    real_run = interpreter.InterpretedFunction.run
    current = {}

    def run(self, *args, grid, warmup, **kwargs):
        rec = _record(self, args, kwargs, current)
        key = json.dumps({k: rec[k] for k in ("arch", "kernel", "signature", "constexprs", "options")},
                         sort_keys=True, default=str)
        if key not in seen:
            seen.add(key)
            records.append(rec)
        return real_run(self, *args, grid=grid, warmup=warmup, **kwargs)

    interpreter.InterpretedFunction.run = run
    no_tma = lambda p: dataclasses.replace(p, tma=False, dz_tma=False)  # noqa: E731 (what rocm.adapt_plan does)
    g = torch.Generator().manual_seed(0)
    n, h, v, ht = 37, 40, 173, 24  # odd: masks everywhere
    try:
      for arch in archs:
        rocm.arch = lambda device, arch=arch: arch
        launch.dot_precision = lambda dtype, arch=arch: rocm.dot_precision(
            dtype == torch.float32, launch.tf32_allowed(), overrides().tf32_round, arch_name=arch)
        for label, dt, prec, op, kw in _cases(full):
            dtype = getattr(torch, dt)
            itemsize = dtype.itemsize
            tiles = rocm.ROCM_TILES[arch][4 if itemsize == 4 else 2]
            if op == "ljsd":
                tiles = rocm.JSD_ROCM_TILES[arch][4 if itemsize == 4 else 2]
            current.update(arch=arch, case=label, dtype=dt, precision=prec)
            torch.set_float32_matmul_precision(prec)
            memo.clear()
            kw = dict(kw)
            ov = dict(tiles=tiles, plan=no_tma)
            if "strategy" in kw:
                ov["strategy"] = kw.pop("strategy")
            budget = kw.pop("budget", None)
            _call(L, op, dtype, n, h, ht, kw.pop("v", v), kw, budget, g, ov, override)
    finally:
        interpreter.InterpretedFunction.run = real_run
        for mod in (plans, ce_b, jsd_b, lp_b):
            mod.ce_triton_plan = real_ce_plan
        rocm.arch = real_arch
        launch.dot_precision = real_precision
        memo.clear()
    return records


def _call(L, op, dtype, n, h, ht, v, kw, budget, g, ov, override):
    import torch

    def r(*shape, scale=1.0, grad=True):
        return (torch.randn(*shape, generator=g) * scale).to(dtype).requires_grad_(grad)

    target = torch.randint(0, v, (n,), generator=g)
    target[3] = -100
    mem = None
    if budget == "all":
        mem = 1 << 30
    elif budget == "partial":  # about half the columns kept, the others recomputed
        mem = n * v * dtype.itemsize // 2 + 4 * n * h + n * 2 * 32 * dtype.itemsize
    elif budget == "none":  # nothing kept: every column recomputed chunk by chunk
        mem = 1
    if kw.pop("bias", False):
        if op == "ljsd":
            kw.update(student_bias=r(v), teacher_bias=r(v, grad=False))
        else:
            kw["bias"] = r(v)
    if kw.pop("class_weight", False):
        kw["class_weight"] = torch.rand(v, generator=g) + 0.5
    with override(**ov):
        if op == "lce":
            x, w = r(n, h), r(v, h, scale=0.2)
            res = L.linear_cross_entropy(x, w, target, memory_budget=mem, backend="triton", **kw)
        elif op == "llp":
            x, w = r(n, h), r(v, h, scale=0.2)
            res = L.linear_log_probs(x, w, target.clamp(min=0), memory_budget=mem, backend="triton", **kw)
        elif op == "trl":  # TRL's five head fields (integrations.trl_fields): the forward's FIELDS
            from logitless.integrations import trl_fields

            x, w = r(n, h), r(v, h, scale=0.2)
            res = trl_fields.head_fields(x, w, target, outputs=trl_fields.FIELDS, memory_budget=mem,
                                         backend="triton", **kw)
        elif op == "ljsd":
            cap = kw.pop("softcap", None)
            xs, ws, xt, wt = r(n, h), r(v, h, scale=0.2), r(n, ht, grad=False), r(v, ht, scale=0.2, grad=False)
            res = L.linear_jsd(xs, ws, xt, wt, target, student_softcap=cap, teacher_softcap=cap,
                               backend="triton", **kw)
        elif op == "ce":
            res = L.cross_entropy(r(n, v), target, backend="triton", **kw)
        elif op == "lp":
            res = L.log_probs(r(n, v), target.clamp(min=0), backend="triton", **kw)
        elif op == "jsd":
            cap = kw.pop("softcap", None)
            res = L.jsd(r(n, v), r(n, v, grad=False), target, student_softcap=cap, teacher_softcap=cap,
                        backend="triton", **kw)
        out = res[0] if isinstance(res, tuple) else res
        if out.dim():
            out = out.float().sum()
        out.float().backward()


def _record(fn, args, kwargs, current):
    params = list(fn.arg_names)
    import inspect

    sig_params = list(inspect.signature(fn.fn).parameters.values())
    constexpr = {p.name for p in sig_params
                 if "constexpr" in str(p.annotation)}
    defaults = {p.name: p.default for p in sig_params if p.default is not inspect.Parameter.empty}
    bound = dict(zip(params, args))
    options = {}
    for k, a in kwargs.items():
        if k in params:
            bound[k] = a
        else:
            options[k] = a
    signature, consts = {}, {}
    for name in params:
        if name not in bound:
            if name in constexpr:
                consts[name] = defaults.get(name)
                signature[name] = "constexpr"
            elif name in defaults:  # a non-constexpr default: its type
                signature[name], c = _type_of(defaults[name])
                if c is not _NOTHING:
                    consts[name] = c
            continue
        a = bound[name]
        if name in constexpr:
            signature[name], consts[name] = "constexpr", a
        else:
            signature[name], c = _type_of(a)
            if c is not _NOTHING:
                consts[name] = c
    return dict(kernel=f"{fn.fn.__module__}:{fn.fn.__name__}", signature=signature, constexprs=consts,
                options=options, **current)


_NOTHING = object()


def _type_of(a):
    import torch

    if isinstance(a, torch.Tensor):
        return "*" + TORCH_TYPES[str(a.dtype)], _NOTHING
    if a is None:
        return "constexpr", None
    if isinstance(a, bool):
        return "i1", _NOTHING
    if isinstance(a, int):
        return ("i32" if -2**31 <= a < 2**31 else "i64"), _NOTHING
    if isinstance(a, float):
        return "fp32", _NOTHING
    raise TypeError(f"no AOT type for {type(a).__name__} (a TMA descriptor on HIP?)")


# ----------------------------------------------------------------------------- compile

#: Dot precisions Triton's AMD backend accepts, by target (gfx942: xf32 MFMA for "tf32").
HIP_PRECISIONS = {"gfx942": {"ieee", "tf32", "tf32-round"}, "gfx950": {"ieee"}}


def _stats(k) -> dict:
    a = k.asm["amdgcn"]

    def g(name):
        m = re.search(name + r":\s*(\d+)", a)
        return int(m.group(1)) if m else None

    return dict(vgpr=g("vgpr_count"), agpr=g("agpr_count"), vgpr_spill=g("vgpr_spill_count"),
                sgpr_spill=g("sgpr_spill_count"), lds=k.metadata.shared,
                mfma=sorted(set(re.findall(r"v_mfma_\w+", a))), hsaco_bytes=len(k.asm["hsaco"]))


def compile_one(rec, arch):
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from logitless.planning import rocm

    mod, name = rec["kernel"].split(":")
    fn = getattr(importlib.import_module(mod), name)
    consts = dict(rec["constexprs"])
    if "DOT_PRECISION" in consts and consts["DOT_PRECISION"] not in HIP_PRECISIONS[arch]:
        raise ValueError(f"DOT_PRECISION {consts['DOT_PRECISION']!r} planned for {arch}")
    sig = dict(rec["signature"])
    t0 = time.time()
    k = triton.compile(ASTSource(fn, sig, constexprs=consts), target=GPUTarget("hip", arch, rocm.WAVEFRONT),
                       options=dict(rec["options"]))
    out = _stats(k)
    out["seconds"] = round(time.time() - t0, 2)
    out["lds_ok"] = out["lds"] <= rocm.LDS_BYTES[arch]
    if "DOT_PRECISION" in consts:
        out["dot_precision"] = consts["DOT_PRECISION"]
    return out


def compile_all(records, archs):
    os.environ.pop("TRITON_INTERPRET", None)
    results, bad = [], 0
    for arch in archs:
        for rec in records:
            if rec.get("arch", arch) != arch:
                continue
            entry = dict(arch=arch, kernel=rec["kernel"], case=rec["case"], dtype=rec["dtype"],
                         precision=rec["precision"], options=rec["options"],
                         tiles={k: v for k, v in rec["constexprs"].items() if k.startswith("BLOCK")},
                         flags={k: v for k, v in rec["constexprs"].items()
                                if not k.startswith("BLOCK") and isinstance(v, (bool, str))})
            try:
                entry.update(compile_one(rec, arch))
                if entry.get("lds_ok") is False:
                    bad += 1
            except Exception as e:  # noqa: BLE001 (reported per launch; the others still compile)
                entry["error"] = f"{type(e).__name__}: {str(e)[:400]}"
                bad += 1
            results.append(entry)
            print(arch, rec["kernel"].split(":")[1], rec["case"], rec["dtype"], rec["precision"],
                  {k: entry.get(k) for k in ("error", "skipped", "vgpr", "agpr", "vgpr_spill", "lds",
                                             "seconds") if entry.get(k) is not None}, flush=True)
    return results, bad


# ----------------------------------------------------------------------------- tiles

TILE_CANDIDATES = {2: [(128, 128, 64, 8, 2), (128, 128, 32, 8, 2), (128, 256, 64, 8, 2), (64, 128, 64, 4, 2),
                       (128, 64, 64, 4, 2)],
                   4: [(128, 64, 32, 4, 2), (128, 128, 32, 8, 2), (64, 128, 32, 4, 2), (64, 64, 32, 4, 2)]}


def tiles_report():
    os.environ.pop("TRITON_INTERPRET", None)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import triton
    from check_kernel_asm import signature
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from logitless.triton_lib import lce_kernels

    out = []
    for arch in ARCHS:
        for itemsize, dtype in ((2, "bf16"), (4, "fp32")):
            for flags in (True, False):
                for t in TILE_CANDIDATES[itemsize]:
                    for fn in (lce_kernels.forward_stats_kernel, lce_kernels.dlogits_kernel):
                        c = dict(HAS_BIAS=flags, HAS_SOFTCAP=flags, HAS_CW=flags, NEED_SMOOTH=flags,
                                 NEED_ARGMAX=flags, KEEP=flags, ENTROPY=flags, DOT_PRECISION="ieee", USE_TMA=False,
                                 DZ_TMA=False, FLATTEN=True, BLOCK_N=t[0], BLOCK_V=t[1], BLOCK_H=t[2])
                        sig, consts = signature(fn, dtype, c)
                        e = dict(arch=arch, dtype=dtype, all_flags=flags, tiles=t, kernel=fn.fn.__name__)
                        try:
                            k = triton.compile(ASTSource(fn, sig, constexprs=consts),
                                               target=GPUTarget("hip", arch, 64),
                                               options=dict(num_warps=t[3], num_stages=t[4]))
                            e.update(_stats(k))
                        except Exception as ex:  # noqa: BLE001
                            e["error"] = f"{type(ex).__name__}: {str(ex)[:200]}"
                        print(e, flush=True)
                        out.append(e)
    return out


def main(argv):
    if argv[:1] == ["capture"] and len(argv) >= 2:
        archs = tuple(argv[argv.index("--arch") + 1].split(",")) if "--arch" in argv else ARCHS
        recs = capture("--full" in argv, archs)
        with open(argv[1], "w") as f:
            json.dump(recs, f, indent=1, default=str)
        print(f"{len(recs)} launches recorded")
        return 0
    if argv[:1] == ["compile"] and len(argv) >= 3:
        archs = ARCHS
        if "--arch" in argv:
            archs = tuple(argv[argv.index("--arch") + 1].split(","))
        recs = json.load(open(argv[1]))
        results, bad = compile_all(recs, archs)
        import triton

        summary = dict(triton=triton.__version__, archs=list(archs), launches=len(recs),
                       compiled=sum("vgpr" in r for r in results), skipped=sum("skipped" in r for r in results),
                       failed=[f"{r['arch']} {r['kernel']} {r['case']} {r['dtype']} {r['precision']}: "
                               f"{r.get('error') or 'LDS ' + str(r.get('lds'))}"
                               for r in results if "error" in r or r.get("lds_ok") is False],
                       vgpr_spills=sorted({f"{r['arch']} {r['kernel'].split(':')[1]} {r['dtype']}: {r['vgpr_spill']}"
                                           for r in results if r.get("vgpr_spill")}))
        with open(argv[2], "w") as f:
            json.dump(dict(summary=summary, results=results), f, indent=1, default=str)
        print(json.dumps(summary, indent=1))
        return 1 if bad else 0
    if argv[:1] == ["tiles"] and len(argv) == 2:
        with open(argv[1], "w") as f:
            json.dump(tiles_report(), f, indent=1, default=str)
        return 0
    print(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
