"""Issue 23 diagnosis on one GPU: where the host time of small calls goes, what the fp32
"high" forward would cost with operands already rounded to TF32, and the distillation
stage times. Prints tables; writes JSON to --out.

    PYTHONPATH=src python benchmarks/probe_hopper_diag.py --out $OUT [--parts host,tf32]

host  cProfile of eager forward+backward steps (top functions by own time) and the
      kernels one step launches (torch.profiler: names, counts, GPU time), at 512-2048
      tokens.
tf32  fp32 inputs at precision "high", 4096 x 4096 x 128256: cuBLAS TF32 GEMM; our
      forward rounding in the kernel (shipped); truncating; truncating operands that
      were rounded to TF32 beforehand (what a pre-rounding pass would give the kernel),
      for a few tiles; the cost of a torch rounding pass over W.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import platform
import pstats
import sys
import time

import torch
import triton
from triton.testing import do_bench

import logitless
from logitless.planning.overrides import override

HOST_SHAPES = {"llama2-7b-512": (512, 4096, 32000), "llama3.1-8b-1k": (1024, 4096, 128256),
               "llama3.2-1b-2k": (2048, 2048, 128256)}


def _bench(fn, rep=100):
    return do_bench(fn, warmup=10, rep=rep, return_mode="median")


def host(dev, rows):
    for name, (n, h, v) in HOST_SHAPES.items():
        x = torch.randn(n, h, device=dev, dtype=torch.bfloat16, requires_grad=True)
        w = (torch.randn(v, h, device=dev) * h**-0.5).to(torch.bfloat16).requires_grad_(True)
        t = torch.randint(0, v, (n,), device=dev)

        def step(x=x, w=w, t=t):
            x.grad = w.grad = None
            logitless.linear_cross_entropy(x, w, t).backward()

        gemm = _bench(lambda x=x, w=w: x.detach() @ w.detach().T)
        eager = _bench(step, rep=200)
        for _ in range(5):
            step()
        torch.cuda.synchronize()
        prof = cProfile.Profile()
        t0 = time.perf_counter()
        prof.enable()
        for _ in range(20):
            step()
        prof.disable()
        host_ms = (time.perf_counter() - t0) / 20 * 1e3
        torch.cuda.synchronize()
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(30)
        s2 = io.StringIO()
        pstats.Stats(prof, stream=s2).sort_stats("cumulative").print_stats(45)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as tp:
            step()
            torch.cuda.synchronize()
        kern = sorted(((e.key, e.count, e.device_time_total / 1e3) for e in tp.key_averages()
                       if e.device_time_total > 0), key=lambda r: -r[2])
        print(f"\n=== host {name}: 3 GEMMs {3 * gemm:.3f} ms, eager f+b {eager:.3f} ms, host {host_ms:.3f} ms/step, "
              f"{sum(k[1] for k in kern)} kernels, {sum(k[2] for k in kern):.3f} ms GPU", flush=True)
        for k in kern:
            print(f"  {k[1]:4d} x {k[2]:8.3f} ms  {k[0][:110]}")
        print("--- by own time (20 steps)\n" + s.getvalue()[-6000:])
        print("--- cumulative\n" + s2.getvalue()[-9000:], flush=True)
        rows.append(dict(part="host", shape=name, gemm_ms=gemm, eager_ms=eager, host_ms=host_ms,
                         kernels=[list(k) for k in kern]))
        del x, w, t
        torch.cuda.empty_cache()


def _round_tf32(a):
    i = a.view(torch.int32)
    r = (i + 0xFFF + ((i >> 13) & 1)) & ~0x1FFF
    return r.view(torch.float32)


def tf32(dev, rows):
    torch.set_float32_matmul_precision("high")
    n, h, v = 4096, 4096, 128256
    x = torch.randn(n, h, device=dev)
    w = torch.randn(v, h, device=dev) * h**-0.5
    t = torch.randint(0, v, (n,), device=dev)
    xr, wr = _round_tf32(x.clone()), _round_tf32(w.clone())
    gemm = _bench(lambda: x @ w.T)
    rnd = _bench(lambda: _round_tf32(w.clone()))
    copy = _bench(lambda: w.clone())
    res = dict(part="tf32", shape=[n, h, v], gemm_ms=gemm, round_w_ms=rnd, clone_w_ms=copy)

    def fwd(a, b):
        return lambda: logitless.linear_cross_entropy(a, b, t)

    res["shipped_round"] = _bench(fwd(x, w))
    with override(tf32_round=False):
        res["truncate"] = _bench(fwd(x, w))
        res["prerounded"] = _bench(fwd(xr, wr))
        for tiles in [(128, 256, 32, 8, 3), (128, 128, 64, 8, 3), (128, 256, 32, 8, 4), (128, 128, 32, 8, 4),
                      (128, 128, 32, 4, 4), (64, 256, 32, 4, 4)]:
            try:
                with override(tiles=tiles):
                    res[f"prerounded{tiles}"] = _bench(fwd(xr, wr))
            except Exception as e:  # noqa: BLE001  (report, do not hide)
                res[f"prerounded{tiles}"] = f"{type(e).__name__}: {str(e)[:200]}"
    # fwd+bwd at the default budget, shipped
    xg = x.clone().requires_grad_(True)
    wg = w.clone().requires_grad_(True)

    def fb():
        xg.grad = wg.grad = None
        logitless.linear_cross_entropy(xg, wg, t).backward()

    res["shipped_fb"] = _bench(fb, rep=50)
    print("\n=== tf32 (ms; x one TF32 GEMM)")
    for k, val in res.items():
        if isinstance(val, float):
            print(f"  {k:40s} {val:8.3f}  {val / gemm:6.3f}x")
        else:
            print(f"  {k:40s} {val}")
    rows.append(res)
    torch.set_float32_matmul_precision("highest")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--parts", default="host,tf32")
    a = ap.parse_args()
    dev = torch.device("cuda")
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                python=platform.python_version(), date=time.strftime("%Y-%m-%dT%H:%M:%S"),
                command=" ".join(sys.argv))
    print(meta, flush=True)
    rows = []
    for part in a.parts.split(","):
        {"host": host, "tf32": tf32}[part](dev, rows)
    tag = "H200" if "H200" in meta["device"] else "H100"
    with open(f"{a.out}/probe-hopper-diag-{tag}.json", "w") as f:
        json.dump(dict(meta, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
