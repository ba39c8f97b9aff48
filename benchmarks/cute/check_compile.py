"""Compile-check the CuTe DSL probe kernels (benchmarks/cute/dlogits.py, fused_forward_pingpong.py) for sm_90a.

(The library's forward, ``logitless.cute_lib.forward_stats``, has its own check,
``check_lib_compile.py``; the session-5 probe copy of it, ``fused_forward.py``, was retired in
session 6: git history up to cbde95b.)

    PYTHONPATH=<nvidia-cutlass-dsl 4.2.1 python_packages>:<its deps> CUTE_DSL_ARCH=sm_90a \\
        python benchmarks/cute/check_compile.py [--kernels forward,dlogits] \\
        [--hidden 256,4096,7168] [--dlogits-hidden 64,4096,7168] [--json out.json]
        [--kernels pingpong --pingpong-hidden 256,4096,7168 --pingpong-configs 64x256:5:40:232,...]

For every (hidden size, specialised or not) it runs ``cute.compile`` with the device binary
requested as PTX text (``cubin-format=isa`` in the DSL's ``cute-to-nvvm`` pass pipeline),
takes the PTX out of the lowered module, and reports:
  * the PTX instructions that make the kernel what it claims to be: wgmma m64n256k16 bf16,
    TMA (cp.async.bulk.tensor) with mbarrier transaction counts, setmaxnreg (warp
    specialisation), ex2.approx (epilogue), and the absence of any global store of logits
    (only the 6 fp32 stores of the partials);
  * ptxas -v (registers, spills, shared memory) and the SASS opcodes (HGMMA, UTMALDG,
    USETMAXREG, MUFU.EX2) when ptxas/cuobjdump are found (/usr/local/bin, triton's bin);
  * the wgmma accumulator layout the epilogue relies on (thread t's element i lies on row
    slot (i // 2) % 2, quads of lanes share rows), checked on the static layout algebra.
For the d(logits) kernel (--kernels dlogits; per H and epilogue): 384 threads, 4 wgmma, 2
TMA load sites, setmaxnreg, 128 ex2 and 128 bf16 roundings per tile, and either the TMA
store path (128 st.shared.b16, fence.proxy.async, the warpgroup's named barriers, bulk
commit / wait.read, no st.global) or 128 masked st.global (direct epilogue).
For the consumer ping-pong forward (--kernels pingpong; fused_forward_pingpong.py): 384
threads, per k slab 4 wgmma m64n256k16 (64 x 256 tile per warpgroup) or 8 m64n128k16
(128 x 128), 2 TMA load sites, the setmaxnreg pair asked for, the ordering barrier (one
bar.sync + one bar.arrive over 256 threads), 3 partial stores per row slot, 128 ex2 + one per
row slot, smem; and the one-warpgroup wgmma C layouts of both tiles.
Where the compile stops: the PTX-capturing compile is stopped by this script right after the
DSL's pass pipeline (no host JIT, no module load: the same on both machines) and must not fail
before; on a GPU machine an unmodified compile of the same configuration must also succeed and
load (after the script made the primary CUDA context current: the DSL creates none).
Exit status 1 if a compile stops elsewhere or a check fails.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
# a module loaded from the DSL's file cache skips the compile this script captures the PTX of
os.environ.setdefault("CUTE_DSL_DISABLE_FILE_CACHING", "1")


def _cuda_driver() -> bool:
    """True where libcuda loads (a GPU machine): there the host JIT does not stop, and the
    PTX-capturing compile fails later, when the driver is handed PTX text as a cubin."""
    import ctypes

    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


_CONTEXT: list = []


def _cuda_context() -> str:
    """Make the device's primary context current (GPU machine, no torch here): the DSL loads
    each compiled module with cuModuleLoadData, which needs a current context, and creates
    none itself (without one the load fails inside the DSL's module walk: "Exception raised
    in callback", what the first GPU run of this check reported)."""
    if _CONTEXT:
        return _CONTEXT[0]
    try:
        import cuda.bindings.driver as drv

        (err,) = drv.cuInit(0)
        err, dev = drv.cuDeviceGet(0)
        err, ctx = drv.cuDevicePrimaryCtxRetain(dev)
        (err,) = drv.cuCtxSetCurrent(ctx)
        _CONTEXT.append(f"primary context of device 0: {err}")
    except Exception as exc:  # noqa: BLE001
        _CONTEXT.append(f"no context ({_first_line(exc)})")
    return _CONTEXT[0]


def _first_line(exc) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"


class _PtxCaptured(Exception):
    """Raised right after the MLIR pipeline produced the PTX: nothing is loaded or JIT-ed."""


def _captured_ptx(build):
    """Run ``build()`` (a cute.compile) with the device code requested as PTX text, stopping it
    once the pass pipeline has run (before the host JIT and any module load: the same stop on a
    CPU and on a GPU machine); return (ptx, error or None, dynamic smem bytes of the launch).
    The error is None when the only stop was this one."""
    from cutlass.base_dsl import compiler as dsl_compiler

    modules, smem = [], []
    orig = dsl_compiler.Compiler.compile

    def compile_isa(self, module, pipeline, *args, **kwargs):
        pipeline = pipeline.replace("cubin-format=bin", "cubin-format=isa")
        launch = re.search(r"dynamic_shared_memory_size %c(\d+)_i32", str(module))
        smem.append(int(launch.group(1)) if launch else None)
        orig(self, module, pipeline, *args, **kwargs)
        modules.append(str(module))
        raise _PtxCaptured("PTX captured")

    dsl_compiler.Compiler.compile = compile_isa
    err = None
    try:
        build()
    except Exception as exc:  # noqa: BLE001
        err = None if modules and "PTX captured" in str(exc) else _first_line(exc)
    finally:
        dsl_compiler.Compiler.compile = orig
    if not modules:
        return None, err, None
    text = modules[-1]
    i = text.index('assembly = "') + len('assembly = "')
    j = i
    while text[j] != '"':
        j += 2 if text[j] == "\\" else 1
    ptx = re.sub(r"\\([0-9A-Fa-f]{2}|\\)",
                 lambda m: "\\" if m.group(1) == "\\" else chr(int(m.group(1), 16)), text[i:j])
    return ptx.rstrip("\0"), err, smem[-1]


def _compiles_for_real(build) -> tuple:
    """On a GPU machine: the plain compile (cubin, loaded by the driver) must raise nothing."""
    try:
        build()
    except Exception as exc:  # noqa: BLE001
        return False, _first_line(exc)
    return True, None


def _compile_stop_check(rec, build, err) -> tuple:
    """(check name, passed). Both machines: the PTX-capturing compile stopped only where this
    script stops it (after the pass pipeline, before any host JIT or module load). On a GPU
    machine also: an unmodified compile (cubin, host JIT, module load into the primary
    context) succeeds. (The old check accepted the host JIT's missing libcuda as the stop and
    so could not pass on a GPU machine, where the host JIT goes on and loads.)"""
    if _cuda_driver():
        rec["cuda_context"] = _cuda_context()
        ok, real_err = _compiles_for_real(build)
        rec["gpu_compile_error"] = real_err
        return "lowered to PTX, and compiles + loads on this GPU", err is None and ok
    return "lowered to PTX with no error (no GPU here: nothing loaded)", err is None


def _tool(name):
    cands = [shutil.which(name), f"/usr/local/bin/{name}", f"/usr/local/cuda/bin/{name}"]
    try:  # triton ships ptxas / cuobjdump in backends/nvidia/bin
        import importlib.util

        spec = importlib.util.find_spec("triton")
        if spec and spec.origin:
            cands.append(os.path.join(os.path.dirname(spec.origin), "backends", "nvidia", "bin", name))
    except Exception:  # noqa: BLE001
        pass
    cands += glob.glob(f"/work/main/.venv/lib/python3*/site-packages/triton/backends/nvidia/bin/{name}")
    for c in cands:
        if c and os.path.exists(c):
            return c
    return None


PTX_PATTERNS = {
    "wgmma_m64n256k16_bf16": r"wgmma\.mma_async\.sync\.aligned\.m64n256k16\.f32\.bf16\.bf16",
    "wgmma_commit": r"wgmma\.commit_group",
    "wgmma_wait": r"wgmma\.wait_group",
    "tma_load_2d": r"cp\.async\.bulk\.tensor\.2d\.shared::cluster\.global",
    "mbarrier_expect_tx": r"mbarrier\.arrive\.expect_tx",
    "mbarrier_try_wait": r"mbarrier\.try_wait",
    "setmaxnreg_inc": r"setmaxnreg\.inc",
    "setmaxnreg_dec": r"setmaxnreg\.dec",
    "ex2_approx": r"ex2\.approx",
    "shfl_bfly": r"shfl\.sync\.bfly",
    "st_global": r"st\.global",
    "tma_store_2d": r"cp\.async\.bulk\.tensor\.2d\.global\.shared::cta",
    "bulk_commit": r"cp\.async\.bulk\.commit_group",
    "bulk_wait_read": r"cp\.async\.bulk\.wait_group\.read",
    "fence_proxy_async_shared": r"fence\.proxy\.async\.shared::cta",
    "bar_sync_named": r"bar(rier)?\.sync(\.aligned)?\s+(%r\d+|[12]),\s*128;",
    "st_shared_b16": r"st\.shared(::cta)?\.b16",
    "cvt_bf16x2": r"cvt\.rn\.bf16x2\.f32",
    "cvt_bf16": r"cvt\.rn\.bf16\.f32",
    "wgmma_m64n128k16_bf16": r"wgmma\.mma_async\.sync\.aligned\.m64n128k16\.f32\.bf16\.bf16",
    "bar_sync_256": r"bar(rier)?\.sync(\.aligned)?\s+(%r\d+|\d+),\s*256;",
    "bar_arrive_256": r"bar(rier)?\.arrive(\.aligned)?\s+(%r\d+|\d+),\s*256;",
}


def _ptxas(rec, ptx, checks):
    """ptxas -v and cuobjdump -sass of the PTX, where the tools are found."""
    ptxas = _tool("ptxas")
    if ptxas:
        with tempfile.TemporaryDirectory() as d:
            src, cubin = os.path.join(d, "k.ptx"), os.path.join(d, "k.cubin")
            with open(src, "w") as f:
                f.write(ptx)
            r = subprocess.run([ptxas, "-arch=sm_90a", "-v", src, "-o", cubin],
                               capture_output=True, text=True, timeout=300)
            info = r.stdout + r.stderr
            rec["ptxas_rc"] = r.returncode
            for key, pat in (("registers", r"Used (\d+) registers"),
                             ("spill_stores", r"(\d+) bytes spill stores"),
                             ("spill_loads", r"(\d+) bytes spill loads")):
                mm = re.search(pat, info)
                rec[key] = int(mm.group(1)) if mm else None
            if r.returncode != 0:
                rec["ptxas_error"] = info[-400:]
            cuobjdump = _tool("cuobjdump")
            if cuobjdump and r.returncode == 0:
                s = subprocess.run([cuobjdump, "-sass", cubin], capture_output=True, text=True,
                                   timeout=300).stdout
                rec["sass_counts"] = {k: len(re.findall(p, s)) for k, p in (
                    ("HGMMA.64x256x16.F32.BF16", r"HGMMA\.64x256x16\.F32\.BF16"),
                    ("HGMMA.64x128x16.F32.BF16", r"HGMMA\.64x128x16\.F32\.BF16"),
                    ("UTMALDG", r"UTMALDG"), ("USETMAXREG", r"USETMAXREG"),
                    ("MUFU.EX2", r"MUFU\.EX2"), ("STL (spill)", r"\bSTL\b"),
                    ("UTMASTG", r"UTMASTG"), ("STG", r"\bSTG\."), ("STS", r"\bSTS\b"))}
        checks["ptxas assembles for sm_90a"] = rec.get("ptxas_rc") == 0
        checks["no spills"] = rec.get("spill_stores") == 0 and rec.get("spill_loads") == 0


def check_dlogits(hidden: int, epilogue: str, stages: int) -> dict:
    """The d(logits) kernel (benchmarks/cute/dlogits.py) for one (H, epilogue)."""
    import dlogits as dl

    def build():
        dl._COMPILED.clear()
        dl.compile_dlogits(hidden, stages=stages, epilogue=epilogue)

    t0 = time.perf_counter()
    ptx, err, smem_bytes = _captured_ptx(build)
    rec = {"kernel": "dlogits", "hidden": hidden, "epilogue": epilogue, "stages": stages,
           "dynamic_smem_bytes": smem_bytes,
           "compile_s": round(time.perf_counter() - t0, 2), "stopped_at": err}
    if ptx is None:
        rec["ok"] = False
        return rec
    counts = {k: len(re.findall(p, ptx)) for k, p in PTX_PATTERNS.items()}
    rec["ptx_counts"] = counts
    m = re.search(r"\.reqntid (\d+)", ptx)
    rec["threads"] = int(m.group(1)) if m else None
    tma = epilogue != "direct"
    blocks = 2 if epilogue == "tma128" else 1  # TMA stores per warpgroup and tile
    checks = {
        "384 threads (producer + 2 consumer warpgroups)": rec["threads"] == 384,
        "4 wgmma m64n256k16 per k slab": counts["wgmma_m64n256k16_bf16"] == 4,
        "2 TMA load sites (x, w), producer only": counts["tma_load_2d"] == 2,
        "mbarrier expect_tx": counts["mbarrier_expect_tx"] >= 1,
        "setmaxnreg (warp specialised)": counts["setmaxnreg_inc"] > 0
        and counts["setmaxnreg_dec"] > 0,
        "128 exp2 per tile (one per accumulator)": counts["ex2_approx"] == 128,
        "128 accumulators rounded to bf16 (cvt.rn)": counts["cvt_bf16"] + 2 * counts["cvt_bf16x2"]
        == 128,
        "dynamic smem fits sm_90 (227 KiB)": smem_bytes is not None and smem_bytes <= 227 * 1024,
    }
    if tma:
        checks.update({
            "TMA store of the dz tile (4 boxes of 64 x 64 per 256 columns)":
            counts["tma_store_2d"] == 4,
            "bulk commit + wait.read before reuse": counts["bulk_commit"] >= 1
            and counts["bulk_wait_read"] >= 1,
            "fence.proxy.async.shared::cta before the store": counts["fence_proxy_async_shared"] >= 1,
            "a warpgroup's named barrier (128 threads) around the smem writes":
            counts["bar_sync_named"] == 2 * blocks,
            "128 bf16 smem stores per tile": counts["st_shared_b16"] == 128,
            # the ragged tail [C8, C) only (dlogits.py "Ragged C"): 4 per thread and block
            "no global store of dz but the ragged tail's (4 per block)":
            counts["st_global"] == 4 * blocks,
        })
    else:
        checks.update({
            "no TMA store": counts["tma_store_2d"] == 0,
            "128 masked bf16 global stores per tile": counts["st_global"] == 128,
        })
    name, ok = _compile_stop_check(rec, build, err)
    checks[name] = ok
    rec["checks"] = checks
    _ptxas(rec, ptx, checks)
    rec["ok"] = all(checks.values())
    return rec


def check_pingpong(hidden: int, stages: int, regs: tuple, tile: tuple = (64, 256)) -> dict:
    """The consumer ping-pong forward (benchmarks/cute/fused_forward_pingpong.py)."""
    import fused_forward_pingpong as pp

    def build():
        pp._COMPILED.clear()
        pp.compile_forward(hidden, stages=stages, regs=regs, tile=tile)

    t0 = time.perf_counter()
    ptx, err, smem_bytes = _captured_ptx(build)
    rec = {"kernel": "pingpong", "hidden": hidden, "stages": stages, "regs": list(regs),
           "tile": list(tile),
           "dynamic_smem_bytes": smem_bytes,
           "compile_s": round(time.perf_counter() - t0, 2), "stopped_at": err}
    if ptx is None:
        rec["ok"] = False
        return rec
    counts = {k: len(re.findall(p, ptx)) for k, p in PTX_PATTERNS.items()}
    rec["ptx_counts"] = counts
    m = re.search(r"\.reqntid (\d+)", ptx)
    rec["threads"] = int(m.group(1)) if m else None
    rec["setmaxnreg"] = re.findall(r"setmaxnreg\.(?:inc|dec)\.sync\.aligned\.u32\s+(\d+)", ptx)
    rows = tile[0] // 64 * 2  # rows per thread
    wgmma_ok = (counts["wgmma_m64n256k16_bf16"] == 4 and counts["wgmma_m64n128k16_bf16"] == 0) \
        if tile == (64, 256) else \
        (counts["wgmma_m64n128k16_bf16"] == 8 and counts["wgmma_m64n256k16_bf16"] == 0)
    checks = {
        "384 threads (producer + 2 consumer warpgroups)": rec["threads"] == 384,
        "per k slab: 4 wgmma m64n256k16 (64 x 256) or 8 m64n128k16 (128 x 128), one warpgroup":
        wgmma_ok,
        "2 TMA load sites (x, w), producer only": counts["tma_load_2d"] == 2,
        "mbarrier expect_tx": counts["mbarrier_expect_tx"] >= 1,
        f"setmaxnreg dec {regs[0]} / inc {regs[1]}":
        sorted(rec["setmaxnreg"]) == sorted([str(regs[0]), str(regs[1])]),
        "ordering barrier: one bar.sync and one bar.arrive over 256 threads":
        counts["bar_sync_256"] == 1 and counts["bar_arrive_256"] == 1,
        f"only the {3 * rows} partial stores reach global memory": counts["st_global"] == 3 * rows,
        f"128 exp2 per tile + {rows} rescales": counts["ex2_approx"] == 128 + rows,
        "dynamic smem fits sm_90 (227 KiB)": smem_bytes is not None and smem_bytes <= 227 * 1024,
    }
    name, ok = _compile_stop_check(rec, build, err)
    checks[name] = ok
    rec["checks"] = checks
    _ptxas(rec, ptx, checks)
    rec["ok"] = all(checks.values())
    return rec


_LAYOUT_FOUND: dict = {}
_THREADS = tuple(range(256))


def _layout_probe():
    """Evaluated at trace time (module level and a tuple loop: the DSL keeps it in Python)."""
    import cutlass
    import cutlass.cute as cute
    import cutlass.utils as utils
    import cutlass.utils.hopper_helpers as sm90_utils

    @cute.jit
    def probe():
        major = utils.LayoutEnum.ROW_MAJOR.sm90_mma_major_mode()
        tiled_mma = sm90_utils.make_trivial_tiled_mma(
            cutlass.BFloat16, cutlass.BFloat16, major, major, cutlass.Float32, (2, 1, 1),
            tiler_mn=(64, 256))
        ident = cute.make_identity_tensor((128, 256))
        for t in _THREADS:
            c = tiled_mma.get_slice(t).partition_C(ident)
            _LAYOUT_FOUND[t] = [c[i] for i in _THREADS[:128]]

    return cute.compile, probe


def check_layout() -> dict:
    """The epilogue's assumption on the wgmma C layout, on the static layout algebra."""
    found = _LAYOUT_FOUND
    found.clear()
    compile_fn, probe = _layout_probe()
    try:
        compile_fn(probe)
    except Exception as exc:  # noqa: BLE001  (host JIT without libcuda: layouts were evaluated)
        err = f"{type(exc).__name__}: {str(exc)[:200]}"
    else:
        err = None
    if len(found) != 256:
        return {"ok": False, "why": f"layout probe evaluated {len(found)} threads", "error": err}
    bad = []
    cover = set()
    found = {t: [tuple(int(v) for v in rc) for rc in coords] for t, coords in found.items()}
    for t, coords in found.items():
        rows = {0: coords[0][0], 1: coords[2][0]}
        for i, (r, c) in enumerate(coords):
            cover.add((r, c))
            if r != rows[(i // 2) % 2]:
                bad.append((t, i, "row slot"))
            if c // 128 != i // 64:  # the dlogits "tma128" epilogue's two column blocks
                bad.append((t, i, "column block of 128"))
        quad = found[t - t % 4]
        if [rc[0] for rc in coords] != [rc[0] for rc in quad]:
            bad.append((t, "quad rows differ"))
        if t // 128 != coords[0][0] // 64:
            bad.append((t, "warpgroup owns rows wg*64..wg*64+63"))
    return {"ok": not bad and len(cover) == 128 * 256, "elements_per_thread": len(found[0]),
            "tile_covered_once": len(cover) == 128 * 256, "violations": bad[:5]}


_LAYOUT_PP: dict = {}
_THREADS_PP = tuple(range(128))
_PP_TILE: list = [(64, 256)]


def _layout_probe_pingpong():
    """The ping-pong kernel's tiled MMA: one warpgroup, m64n256k16 on a 64 x 256 tile or
    2 x m64n128k16 on a 128 x 128 tile (the tile is read from _PP_TILE at trace time)."""
    import cutlass
    import cutlass.cute as cute
    import cutlass.utils as utils
    import cutlass.utils.hopper_helpers as sm90_utils

    @cute.jit
    def probe():
        major = utils.LayoutEnum.ROW_MAJOR.sm90_mma_major_mode()
        tiled_mma = sm90_utils.make_trivial_tiled_mma(
            cutlass.BFloat16, cutlass.BFloat16, major, major, cutlass.Float32, (1, 1, 1),
            tiler_mn=(64, _PP_TILE[0][1]))
        ident = cute.make_identity_tensor(_PP_TILE[0])
        for t in _THREADS_PP:
            c = tiled_mma.get_slice(t).partition_C(ident)
            _LAYOUT_PP[t] = [c[i] for i in _THREADS_PP]

    return cute.compile, probe


def check_layout_pingpong(tile=(64, 256)) -> dict:
    """Ping-pong epilogue's assumption: each of the 128 threads of a consumer warpgroup holds
    128 elements of its tile; 64 x 256: on 2 rows, element i on row slot (i // 2) % 2;
    128 x 128: on 4 rows, element i on row slot 2 (i // 64) + (i // 2) % 2; the rows of
    different slots differ, the 4 lanes of a quad share their rows, and the warpgroup covers
    the tile exactly once."""
    found = _LAYOUT_PP
    found.clear()
    _PP_TILE[0] = tuple(tile)

    def slot(i):
        return (i // 2) % 2 if tile[0] == 64 else 2 * (i // 64) + (i // 2) % 2

    n_slots = 2 if tile[0] == 64 else 4
    compile_fn, probe = _layout_probe_pingpong()
    try:
        compile_fn(probe)
    except Exception as exc:  # noqa: BLE001  (host JIT without libcuda: layouts were evaluated)
        err = _first_line(exc)
    else:
        err = None
    if len(found) != 128:
        return {"ok": False, "why": f"layout probe evaluated {len(found)} threads", "error": err}
    bad, cover = [], set()
    found = {t: [tuple(int(v) for v in rc) for rc in coords] for t, coords in found.items()}
    for t, coords in found.items():
        rows = {}
        for i, (r, _c) in enumerate(coords):
            rows.setdefault(slot(i), r)
        if len(set(rows.values())) != n_slots:
            bad.append((t, f"{n_slots} distinct rows"))
        for i, (r, c) in enumerate(coords):
            cover.add((r, c))
            if r != rows[slot(i)]:
                bad.append((t, i, "row slot"))
        quad = found[t - t % 4]
        if [rc[0] for rc in coords] != [rc[0] for rc in quad]:
            bad.append((t, "quad rows differ"))
    size = tile[0] * tile[1]
    return {"tile": list(tile), "ok": not bad and len(cover) == size and len(found[0]) == 128,
            "elements_per_thread": len(found[0]), "tile_covered_once": len(cover) == size,
            "violations": bad[:5]}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kernels", default="dlogits",
                    help="dlogits and/or pingpong, comma-separated (cute_dlogits.sh passes dlogits, "
                         "cute_pingpong.sh pingpong)")
    ap.add_argument("--dlogits-hidden", default="64,4096,7168")
    ap.add_argument("--dlogits-configs", default="tma:3,tma128:4,direct:3",
                    help="epilogue:stages pairs of the dlogits kernel")
    ap.add_argument("--pingpong-hidden", default="256,4096,7168")
    ap.add_argument("--pingpong-configs", default="64x256:5:40:232,128x128:6:40:232",
                    help="MxN:stages:producer_regs:consumer_regs of the ping-pong forward, "
                         "each at every --pingpong-hidden")
    ap.add_argument("--pingpong-extra", default="64x256:4:40:232,64x256:5:24:240,128x128:7:40:232",
                    help="more configurations, at the largest --pingpong-hidden only")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    kernels = args.kernels.split(",")
    out = {"arch": os.environ["CUTE_DSL_ARCH"], "gpu_driver": _cuda_driver(),
           "cuda_context": _cuda_context() if _cuda_driver() else None,
           "layout": check_layout(), "kernels": []}
    print("wgmma C layout assumption:", json.dumps(out["layout"]))
    if "pingpong" in kernels:
        lays = [check_layout_pingpong(t) for t in ((64, 256), (128, 128))]
        out["layout_pingpong"] = {"ok": all(x["ok"] for x in lays), "tiles": lays}
        print("ping-pong (one warpgroup per tile) C layouts:", json.dumps(out["layout_pingpong"]))

    def save():
        if args.json:
            with open(args.json, "w") as f:
                json.dump(out, f, indent=1)

    todo = []
    if "forward" in kernels:
        raise SystemExit("--kernels forward: retired in session 6; the library's forward is checked by "
                         "check_lib_compile.py")
    if "dlogits" in kernels:
        todo += [(check_dlogits, h, ep, int(st))
                 for h in [int(v) for v in args.dlogits_hidden.split(",")]
                 for ep, st in (cfg.split(":") for cfg in args.dlogits_configs.split(","))]
    if "pingpong" in kernels:
        pp_hidden = [int(v) for v in args.pingpong_hidden.split(",")]
        def parse(spec):
            if not spec:
                return []
            out_cfgs = []
            for c in spec.split(","):
                tile, st, pr, cr = c.split(":")
                out_cfgs.append((int(st), (int(pr), int(cr)),
                                 tuple(int(v) for v in tile.split("x"))))
            return out_cfgs

        todo += [(check_pingpong, h, *c) for c in parse(args.pingpong_configs) for h in pp_hidden]
        todo += [(check_pingpong, max(pp_hidden), *c) for c in parse(args.pingpong_extra)]
    for fn, *a in todo:
        try:
            rec = fn(*a)
        except Exception as exc:  # noqa: BLE001  (one configuration's failure is reported, not fatal)
            rec = {"kernel": fn.__name__, "args": a, "ok": False, "error": _first_line(exc)}
        rec.setdefault("kernel", "forward")
        out["kernels"].append(rec)
        print(json.dumps(rec), flush=True)
        save()  # a run killed by its timeout keeps the configurations done
    ok = out["layout"]["ok"] and all(r["ok"] for r in out["kernels"]) \
        and out.get("layout_pingpong", {"ok": True})["ok"]
    print()
    print(f"{'H':>6} {'spec':>5} {'thr':>4} {'wgmma':>5} {'tma':>4} {'regs':>5} {'spill':>5} "
          f"{'HGMMA':>5} {'smem':>7} {'ok':>3} kernel (spec: forward ws / inline, dlogits epilogue)")
    for r in out["kernels"]:
        sc = r.get("sass_counts", {})
        pc = r.get("ptx_counts", {})
        variant = r.get("epilogue", {True: "ws", False: "inl"}.get(r.get("specialised"), "?"))
        if r.get("kernel") == "pingpong":
            variant = f"{r.get('tile', ['?'])[0]}/{r.get('stages')}"
        failed = [k for k, v in r.get("checks", {}).items() if not v]
        print(f"{r.get('hidden')!s:>6} {variant:>5} {r.get('threads')!s:>4} "
              f"{pc.get('wgmma_m64n256k16_bf16', 0) + pc.get('wgmma_m64n128k16_bf16', 0)!s:>5} "
              f"{r.get('ptx_counts', {}).get('tma_load_2d')!s:>4} {r.get('registers')!s:>5} "
              f"{r.get('spill_stores')!s:>5} "
              f"{sc.get('HGMMA.64x256x16.F32.BF16', 0) + sc.get('HGMMA.64x128x16.F32.BF16', 0)!s:>5} "
              f"{r.get('dynamic_smem_bytes')!s:>7} "
              f"{'yes' if r['ok'] else 'NO':>3} {r['kernel']}"
              + (f"  FAILED: {failed} {r.get('error') or r.get('gpu_compile_error') or ''}"
                 if not r["ok"] else ""))
    print("all checks:", "PASS" if ok else "FAIL")
    save()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
