"""Do the torch ops' Triton kernels compile for the GPUs they plan for? An ahead-of-time
compile on the CPU (no GPU) of every kernel launch the ops make, with the tiles and kernel
options the planner chooses on that GPU, for gfx942 (MI300X) and gfx950 (MI355X) with
Triton's AMD backend (LLVM AMDGPU codegen, its in-process linker, no ROCm install) and for
sm90 (H100) with Triton's NVIDIA backend and its bundled ptxas.

    python benchmarks/check_gpu_compile.py capture SPECS [--full] [--arch gfx942,gfx950,sm90]
    python benchmarks/check_gpu_compile.py compile SPECS OUT [--arch gfx942,gfx950,sm90]
    python benchmarks/check_gpu_compile.py tiles OUT                 # AMD tile candidates' registers

Run with PYTHONPATH pointing at the tree (src/). ``capture`` runs the ops on the CPU
interpreter (TRITON_INTERPRET=1, small odd shapes, bf16/fp16/fp32 and the main options:
bias, softcap, class weights, label smoothing, z-loss, argmax (return_stats), kept
columns, gradient in the forward, entropy, temperature, TRL's head fields, JSD beta
0.5 / 0 / 1, hard labels, top-k distillation; fp32 at matmul precision "highest" and "high") with the plans
the target gets and records each launch: kernel, argument types (a TMA descriptor as
``tensordesc<dtype[block]>``), constexprs, launch options. AMD: ``planning.rocm``'s tile
tables, no TMA, its dot precisions. sm90: ``tiles.CUDA_TILES`` (``CUDA_TILES_TF32`` on
operands pre-rounded to TF32 at "high", ``JSD_CUDA_TILES`` for linear_jsd), TMA
descriptors where rows are aligned (the interpreter runs them; one case with an odd hidden
size takes the pointer path), persistent dlogits programs (as from 2048 tokens on; the
``FEW_ROWS`` cases as at few tokens), the H100's dot precisions ("tf32" for 16-bit, "tf32x3"
/ "tf32-round" for fp32), no CuTe DSL forward (not Triton). Not covered on sm90: the TMA
bulk store of dz (``dz_tma``, off in the shipped plans) and tuned tiles other than the
shipped H100 table. On every target the row kernels take their GPU tiles
(``logits.ce_triton_plan``) but launches whose sizes the launch code picks from the tensors'
device (``launch.round_to_tf32``) keep their interpreter sizes.
``compile`` compiles each unique launch (a separate process: without the interpreter) for
its target, and writes per launch: ok, registers (AMD: VGPRs / AGPRs; sm90: REG of
``cuobjdump -res-usage``), spills (AMD: spilled VGPRs; sm90: local memory + stack frame
bytes), shared memory (LDS) bytes against the target's, the MFMA instructions (AMD); or
the error. Exits 1 when any launch fails to compile, spills on sm90 (the AMD test holds
VGPR spills), or needs more shared memory than the target has. ``tiles`` compiles the
fused GEMM kernels at candidate AMD tiles (how ``planning.rocm.ROCM_TILES`` were chosen).
Without ``--full`` the capture covers a representative subset (CI).
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
ARCHS = ("gfx942", "gfx950", "sm90")
#: Shared memory one block may use on an H100 (cudaDevAttrMaxSharedMemoryPerBlockOptin, 227 KiB).
SM90_SHARED = 232448
#: sm90 cases planned as at few tokens (one dlogits program per tile); the others persistent.
FEW_ROWS = ("lce-partial", "llp-recompute", "ljsd-kl")
#: Launch sizes that ``launch.round_to_tf32`` picks for CUDA tensors (the capture's are the CPU's).
GPU_LAUNCH = {"round_to_tf32_kernel": (dict(BLOCK_R=16, BLOCK_C=256), dict(num_warps=4))}


# ----------------------------------------------------------------------------- capture


def _cases(full: bool, nv: bool = False):
    """(label, dtype name, fp32 precision, op name, kwargs) of the op calls. Without ``full``
    a subset that still launches every kernel (CI): bf16 with most options, fp32 at "high"
    (TF32 rounding, pre-rounded operands) on the fused linear ops. ``nv`` (sm90): "high"
    is the pre-rounded path, "high-inkernel" (full) the kernels' own rounding."""
    base = [
        ("lce-plain", "lce", dict()),
        ("lce-all", "lce", dict(bias=True, softcap=30.0, label_smoothing=0.1, class_weight=True, z_loss=1e-4,
                                return_stats=True)),
        ("lce-none-keep", "lce", dict(reduction="none", budget="all")),
        ("lce-partial", "lce", dict(budget="partial", bias=True)),
        ("lce-recompute", "lce", dict(budget="none", softcap=30.0, label_smoothing=0.1, class_weight=True)),
        ("lce-gif", "lce", dict(strategy=("grad_in_forward", 16), bias=True, softcap=30.0)),
        ("lce-fwd", "lce", dict(grad=False, return_stats=True)),  # no backward (sm90, fp32 "high": its tiles)
        ("lce-unaligned", "lce", dict(h=41, bias=True)),  # rows not 16-byte aligned: no TMA on sm90
        ("lce-tokens", "lce", dict(n=1031, h=16)),  # past ce_epilogue.BLOCK tokens: its grid, ce_reduce_kernel
        ("llp-entropy", "llp", dict(entropy=True, temperature=0.7, softcap=20.0, bias=True)),
        ("llp-recompute", "llp", dict(budget="none", entropy=True)),
        ("llp-topk", "llp", dict(top_k=5, top_p=0.9, entropy=True)),
        ("llp-sparse-add", "llp", dict(top_p=0.9, bias=True)),  # sparse rows' dW, db added to the dense rows'
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
        ("topk-plain", "topk", dict(k=20)),  # forward KL with a tail bucket, every column kept
        ("topk-all", "topk", dict(k=9, direction="reverse", temperature=0.7, softcap=30.0, hard_label_weight=0.3,
                                  bias=True)),  # z from the kept columns, the second log-sum-exp
        ("topk-recompute", "topk", dict(k=20, budget="none", hard_label_weight=0.5)),
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
                 "llp-topp-search", "lce-fwd",  # (lce-fwd: the interpreter's bf16 dots give no flat rows)
                 "topk-all", "topk-recompute")
        return ([(label, "bfloat16", "highest", op, kw) for label, op, kw in base]
                + [(label, "float32", "high", op, kw) for label, op, kw in base if label in fused])
    out = []
    for dt in ("bfloat16", "float16", "float32"):
        for prec in ((("highest", "high", "high-inkernel") if nv else ("highest", "high")) if dt == "float32"
                     else ("highest",)):
            out += [(label, dt, prec, op, kw) for label, op, kw in base + extra]
    return out


def capture(full: bool, archs=ARCHS):
    os.environ["TRITON_INTERPRET"] = "1"
    import torch
    from triton.runtime import interpreter

    import logitless as L
    from logitless.ops.cross_entropy import triton_backend as ce_b
    from logitless.ops.jsd import triton_backend as jsd_b
    from logitless.ops.linear_jsd import planning as ljsd_planning
    from logitless.ops.log_probs import triton_backend as lp_b
    from logitless.planning import cost_model, logits, memo, plans, rocm, tiles
    from logitless.planning import device as device_facts
    from logitless.planning.overrides import override

    # The row kernels' tiles as on a GPU (ce_triton_plan reads only the planning rule).
    real_ce_plan = logits.ce_triton_plan
    gpu = device_facts.DeviceFacts(model=cost_model.DEFAULT, sms=132)

    def gpu_ce_plan(n, v, itemsize, device):
        return real_ce_plan(n, v, itemsize, gpu)

    for mod in (logits, ce_b, jsd_b, lp_b):
        mod.ce_triton_plan = gpu_ce_plan
    # Plans adapted as on an AMD GPU (rocm.adapt_plan: no TMA) although the device is the CPU:
    # the CPU's facts with the AMD architecture (the interpreter's rule, tiles forced below).
    real_facts = device_facts.facts
    # The dot precision as on the AMD GPU (launch.dot_precision's HIP branch). On the
    # interpreter bf16 dots then multiply garbage (its bf16 bug, see gemm.dot): the launches,
    # not the values, are what is recorded.
    from logitless.triton_lib import launch

    real_precision = launch.dot_precision
    memo.clear()

    records, seen = [], set()
    real_run = interpreter.InterpretedFunction.run
    current = {}

    def run(self, *args, grid, warmup, **kwargs):
        rec = _record(self, args, kwargs, current)
        key = json.dumps({k: rec[k] for k in ("arch", "kernel", "signature", "constexprs", "options", "bound")},
                         sort_keys=True, default=str)
        if key not in seen:
            seen.add(key)
            records.append(rec)
        return real_run(self, *args, grid=grid, warmup=warmup, **kwargs)

    interpreter.InterpretedFunction.run = run
    min_rows = plans.PERSISTENT_MIN_ROW_BLOCKS
    g = torch.Generator().manual_seed(0)
    n, h, v, ht = 37, 40, 173, 24  # odd: masks everywhere
    try:
      for arch in archs:
        nv = arch == "sm90"
        # sm90: the NVIDIA planner as is (no AMD architecture on the CPU), TMA kept; its dot
        # precision but for the interpreter's bf16 stand-in (``_record`` writes "tf32").
        device_facts.facts = real_facts if nv else lambda d, arch=arch: (
            d if type(d) is device_facts.DeviceFacts else dataclasses.replace(real_facts(d), arch=arch))
        launch.dot_precision = real_precision if nv else lambda dtype, arch=arch: rocm.dot_precision(
            dtype == torch.float32, launch.tf32_allowed(), arch_name=arch)
        for label, dt, prec, op, kw in _cases(full, nv):
            dtype = getattr(torch, dt)
            i = 4 if dtype.itemsize == 4 else 2
            kw = dict(kw)
            if not nv:
                tiles_ = (rocm.JSD_ROCM_TILES if op == "ljsd" else rocm.ROCM_TILES)[arch][i]
                ov = dict(tiles=tiles_)
            else:  # pre-rounded fp32 at "high": CUDA_TILES_TF32 (by whether a backward follows)
                pre = dt == "float32" and prec == "high"
                tiles_ = (ljsd_planning.JSD_CUDA_TILES[i] if op == "ljsd" else
                          tiles.CUDA_TILES_TF32[kw.get("grad", True)] if pre else tiles.CUDA_TILES[i])
                ov = dict(tiles=tiles_, cute=False, tf32_preround=pre if dt == "float32" else None)
            # persistent dlogits programs (sm90, as from PERSISTENT_MIN_ROW_BLOCKS row blocks)
            plans.PERSISTENT_MIN_ROW_BLOCKS = 1 if nv and label not in FEW_ROWS else min_rows
            current.update(arch=arch, case=label, dtype=dt, precision=prec)
            torch.set_float32_matmul_precision(prec.split("-")[0])
            memo.clear()
            if "strategy" in kw:
                ov["strategy"] = kw.pop("strategy")
            budget = kw.pop("budget", None)
            _call(L, op, dtype, kw.pop("n", n), kw.pop("h", h), ht, kw.pop("v", v), kw, budget, g, ov, override)
    finally:
        interpreter.InterpretedFunction.run = real_run
        for mod in (logits, ce_b, jsd_b, lp_b):
            mod.ce_triton_plan = real_ce_plan
        device_facts.facts = real_facts
        launch.dot_precision = real_precision
        plans.PERSISTENT_MIN_ROW_BLOCKS = min_rows
        memo.clear()
    return records


def _call(L, op, dtype, n, h, ht, v, kw, budget, g, ov, override):
    import torch

    need = kw.pop("grad", True)  # False: a forward alone

    def r(*shape, scale=1.0, grad=True):
        return (torch.randn(*shape, generator=g) * scale).to(dtype).requires_grad_(grad and need)

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
        elif op == "topk":
            x, w = r(n, h), r(v, h, scale=0.2)
            lp, ids = torch.log_softmax(torch.randn(n, v, generator=g) * 2, -1).topk(kw.pop("k"), -1)
            res = L.linear_topk_kl(x, w, ids, lp, target, memory_budget=mem, backend="triton", **kw)
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
        if need:
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
    if consts.get("DOT_PRECISION") == "interpreter-bf16":  # (launch.dot_precision's stand-in)
        consts["DOT_PRECISION"] = "tf32"
    sizes, opts = GPU_LAUNCH.get(fn.fn.__name__, ({}, {}))
    bound = {k: _enc(a) if k not in constexpr else consts[k] for k, a in bound.items()}
    return dict(kernel=f"{fn.fn.__module__}:{fn.fn.__name__}", signature=signature, constexprs={**consts, **sizes},
                options={**options, **opts}, bound={**bound, **sizes}, **current)


def _enc(a):
    """A runtime argument as what Triton's launch specialises on (``_dec`` rebuilds it): a
    tensor's dtype and 16-byte alignment, a descriptor's dtype and block, an int's class (a
    multiple of 16 or not; 32 or 64 bits; a 1 at the capture's small shapes, e.g. one
    split, as any other int: Triton would make it a constant), a float's type."""
    if type(a).__name__ == "TensorDescriptor":
        return dict(desc=str(a.base.dtype)[6:], block=list(a.block_shape))
    if hasattr(a, "data_ptr"):
        return dict(tensor=str(a.dtype)[6:], aligned=a.data_ptr() % 16 == 0)
    if isinstance(a, bool) or a is None or isinstance(a, str):
        return a
    if isinstance(a, int):
        return (16 if a % 16 == 0 and a else 17) + (0 if -2**31 <= a < 2**31 else 2**32)
    return 1.5 if isinstance(a, float) else a


def _dec(a):
    import torch
    from triton.tools.tensor_descriptor import TensorDescriptor

    if isinstance(a, dict) and "desc" in a:
        b = a["block"]
        return TensorDescriptor(torch.empty(b, dtype=getattr(torch, a["desc"])), b, [b[1], 1], b)
    if isinstance(a, dict):
        t = torch.empty(64, dtype=getattr(torch, a["tensor"]))
        return t if a["aligned"] else t[1:]
    return a


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
    if type(a).__name__ == "TensorDescriptor":
        return f"tensordesc<{TORCH_TYPES[str(a.base.dtype)]}{list(a.block_shape)}>", _NOTHING
    raise TypeError(f"no AOT type for {type(a).__name__}")


# ----------------------------------------------------------------------------- compile

#: Dot precisions planned per target (AMD: what Triton's backend accepts; gfx942: xf32 MFMA for "tf32").
PRECISIONS = {"gfx942": {"ieee", "tf32", "tf32-round"}, "gfx950": {"ieee"}, "sm90": {"tf32", "tf32x3", "tf32-round"}}


def _stats(k) -> dict:
    a = k.asm["amdgcn"]

    def g(name):
        m = re.search(name + r":\s*(\d+)", a)
        return int(m.group(1)) if m else None

    return dict(vgpr=g("vgpr_count"), agpr=g("agpr_count"), spill=g("vgpr_spill_count"),
                sgpr_spill=g("sgpr_spill_count"), smem=k.metadata.shared,
                mfma=sorted(set(re.findall(r"v_mfma_\w+", a))), hsaco_bytes=len(k.asm["hsaco"]))


def _sm90_stats(k) -> dict:
    """Registers, spills (local memory + stack frame bytes per thread) and shared memory
    (Triton's dynamic + the cubin's static) of ``cuobjdump -res-usage`` on the cubin."""
    import subprocess
    import tempfile

    from triton import knobs

    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(k.asm["cubin"])
        f.flush()
        res = subprocess.run([knobs.nvidia.cuobjdump.path, "-res-usage", f.name], capture_output=True, text=True,
                             check=True).stdout
    u = {key: int(val) for key, val in re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", res)}
    return dict(regs=u["REG"], spill=u["STACK"] + u["LOCAL"], smem=k.metadata.shared + u["SHARED"],
                cubin_bytes=len(k.asm["cubin"]))


def compile_one(rec, arch):
    import importlib

    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    from logitless.planning import rocm

    mod, name = rec["kernel"].split(":")
    fn = getattr(importlib.import_module(mod), name)
    dot = rec["constexprs"].get("DOT_PRECISION")
    if dot is not None and dot not in PRECISIONS[arch]:
        raise ValueError(f"DOT_PRECISION {dot!r} planned for {arch}")
    t0 = time.time()
    nv = arch == "sm90"
    target = GPUTarget("cuda", 90, 32) if nv else GPUTarget("hip", arch, rocm.WAVEFRONT)
    # Triton's own binding of the launch (JITFunction.run): its signature, constexprs and
    # specialisation attributes (16-byte aligned pointers, ints divisible by 16).
    backend = make_backend(target)
    kwargs = {k: _dec(a) for k, a in rec["bound"].items()}
    kwargs.update(rec["options"], debug=False, instrumentation_mode=knobs.compilation.instrumentation_mode)
    bound, spec, _ = create_function_from_signature(fn.signature, fn.params, backend)(**kwargs)
    opts, sig, consts, attrs = fn._pack_args(backend, kwargs, bound, spec, None)
    k = triton.compile(ASTSource(fn, sig, consts, attrs), target=target, options=opts.__dict__)
    out = _sm90_stats(k) if nv else _stats(k)
    out["seconds"] = round(time.time() - t0, 2)
    out["smem_ok"] = out["smem"] <= (SM90_SHARED if nv else rocm.LDS_BYTES[arch])
    if dot is not None:
        out["dot_precision"] = dot
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
                bad += not entry["smem_ok"] or bool(entry["spill"])
            except Exception as e:  # noqa: BLE001 (reported per launch; the others still compile)
                entry["error"] = f"{type(e).__name__}: {str(e)[:400]}"
                bad += 1
            results.append(entry)
            print(arch, rec["kernel"].split(":")[1], rec["case"], rec["dtype"], rec["precision"],
                  {k: entry.get(k) for k in ("error", "vgpr", "agpr", "regs", "spill", "smem", "seconds")
                   if entry.get(k) is not None}, flush=True)
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

        ok = [r for r in results if "error" not in r]
        by = {a: [r for r in ok if r["arch"] == a] for a in archs}
        summary = dict(triton=triton.__version__, archs=list(archs), launches=len(recs), compiled=len(ok),
                       failed=[f"{r['arch']} {r['kernel']} {r['case']} {r['dtype']} {r['precision']}: "
                               f"{r.get('error') or 'shared memory ' + str(r.get('smem'))}"
                               for r in results if "error" in r or not r["smem_ok"]],
                       spills=sorted({f"{r['arch']} {r['kernel'].split(':')[1]} {r['case']} {r['dtype']}: {r['spill']}"
                                      for r in ok if r["spill"]}),
                       max_regs={a: max((r.get("regs") or r["vgpr"] for r in rs), default=None)
                                 for a, rs in by.items()},
                       max_smem={a: max((r["smem"] for r in rs), default=None) for a, rs in by.items()})
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
