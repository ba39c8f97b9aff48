"""Can the CuTe DSL (nvidia-cutlass-dsl) route of issue 23 item 1 run on the lent GPU?

A feasibility probe, not a kernel of the library: it compiles and runs a small kernel of
our own in the CuTe DSL (a row-wise log-sum-exp over a (rows, cols) fp32 matrix, one
thread per row, the math of the fused forward's epilogue), checks it against torch in
float64, times it against torch.logsumexp, and reports which Hopper building blocks
(warpgroup MMA, TMA, pipelines) the installed DSL exposes.

    python benchmarks/probe_cute_dsl.py            # needs cutlass (nvidia-cutlass-dsl) importable

On a machine without a GPU it stops after the compile (CuTe DSL lowers to the device code
without one; only the host JIT needs libcuda). The 4.2.1 wheel is one 62 MB file (the 4.8
wheels split into a 92 MB library wheel whose Python front end was absent in our mirror):
it fits the device tool's 64 MiB carry alone.
"""

from __future__ import annotations

import importlib
import json
import sys
import time


def main() -> int:
    out = {"stage": "import"}
    try:
        import cutlass
        import cutlass.cute as cute
        from cutlass.cute.runtime import from_dlpack
    except Exception as exc:  # noqa: BLE001
        print(f"import failed: {type(exc).__name__}: {exc}")
        return 1
    out["cutlass"] = getattr(cutlass, "__version__", "?")
    blocks = {}
    for name in ("nvgpu.warpgroup", "nvgpu.cpasync", "nvgpu.tcgen05", "arch"):
        mod = cute
        try:
            for part in name.split("."):
                mod = getattr(mod, part)
            blocks[name] = True
        except AttributeError:
            blocks[name] = False
    try:
        import cutlass.pipeline  # noqa: F401
        blocks["cutlass.pipeline"] = True
    except Exception:  # noqa: BLE001
        blocks["cutlass.pipeline"] = False
    out["hopper_blocks"] = blocks
    print("CuTe DSL", out["cutlass"], "building blocks:", blocks)

    @cute.kernel
    def row_lse_kernel(x: cute.Tensor, lse: cute.Tensor, rows: cutlass.Int32, cols: cutlass.Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        bdim, _, _ = cute.arch.block_dim()
        r = bidx * bdim + tidx
        if r < rows:
            m = cutlass.Float32(-3.0e38)
            s = cutlass.Float32(0.0)
            for c in range(cols):
                z = x[r, c]
                m_new = cute.arch.fmax(m, z) if hasattr(cute.arch, "fmax") else (z if z > m else m)
                s = s * cute.math.exp(m - m_new) + cute.math.exp(z - m_new)
                m = m_new
            lse[r] = m + cute.math.log(s)

    @cute.jit
    def row_lse(x: cute.Tensor, lse: cute.Tensor, rows: cutlass.Int32, cols: cutlass.Int32):
        threads = 128
        row_lse_kernel(x, lse, rows, cols).launch(grid=((rows + threads - 1) // threads, 1, 1),
                                                  block=(threads, 1, 1))

    try:  # importlib: the DSL's preprocessor re-runs the imports it finds in this module
        torch = importlib.import_module("torch")
        cuda = torch.cuda.is_available()
    except Exception:  # noqa: BLE001
        torch, cuda = None, False
    rows, cols = (8192, 4096) if cuda else (64, 32)
    if torch is not None:
        dev = "cuda" if cuda else "cpu"
        x = torch.randn(rows, cols, device=dev, dtype=torch.float32) * 3
        lse = torch.full((rows,), float("nan"), device=dev, dtype=torch.float32)
        ax, al = from_dlpack(x), from_dlpack(lse)
    else:
        np = importlib.import_module("numpy")
        x = np.random.randn(rows, cols).astype(np.float32)
        lse = np.full((rows,), np.nan, dtype=np.float32)
        ax, al = from_dlpack(x), from_dlpack(lse)
    out["stage"] = "compile"
    t0 = time.perf_counter()
    try:
        compiled = cute.compile(row_lse, ax, al, rows, cols)
    except Exception as exc:  # noqa: BLE001
        msg = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
        out["compile_error"] = msg
        traceback = importlib.import_module("traceback")
        print("".join(traceback.format_exc().splitlines(keepends=True)[-8:]))
        print("compile stopped:", msg, "(expected without a GPU: the host JIT needs libcuda)" if not cuda else "")
        print(json.dumps(out))
        return 0 if not cuda else 1
    out["compile_s"] = round(time.perf_counter() - t0, 2)
    if not cuda:
        print("compiled without a GPU")
        print(json.dumps(out))
        return 0
    out["stage"] = "run"
    compiled(ax, al, rows, cols)
    torch.cuda.synchronize()
    ref = torch.logsumexp(x.double(), dim=1)
    err = (lse.double() - ref).abs().max().item()
    out["max_abs_err_vs_float64"] = err
    out["all_written"] = bool(torch.isfinite(lse).all().item())
    do_bench = importlib.import_module("triton.testing").do_bench
    out["cute_ms"] = do_bench(lambda: compiled(ax, al, rows, cols), return_mode="median")
    out["torch_logsumexp_ms"] = do_bench(lambda: torch.logsumexp(x, dim=1), return_mode="median")
    out["ok"] = err < 1e-4 and out["all_written"]
    print(json.dumps(out))
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
