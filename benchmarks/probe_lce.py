"""Stage-by-stage timing of the Triton linear_cross_entropy on one GPU, for tuning.

Times, at each shape, the cuBLAS GEMM unit, the forward kernel and the backward's
dlogits kernel alone under several tile configurations, the backward matmuls, and the
op end to end at a few budgets. Prints a table and writes JSON (to --out).

    python benchmarks/probe_lce.py --out $OUT
"""

from __future__ import annotations

import argparse
import dataclasses

import torch
import triton
from _probe_common import probe_meta, write_json  # the probes' folder is on sys.path
from triton.testing import do_bench

import logitless
from logitless.formulas.cross_entropy import grad_coefficients
from logitless.ops.linear_cross_entropy import triton_backend as TB
from logitless.triton_lib import lce_kernels as K
from logitless.options import CrossEntropyOptions
from logitless.planning import plans as _plans

SHAPES = {
    "llama3.1-8b": (4096, 4096, 128256),
    "gemma3-4b": (4096, 2560, 262144),
    "deepseek-v3": (8192, 7168, 128256),
    "llama3.1-8b-16k": (16384, 4096, 128256),
}
TILES = [
    (128, 256, 64, 8, 3),
    (128, 256, 64, 8, 4),
    (256, 128, 64, 8, 3),
]


def ms(fn):
    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def probe(name, n, h, v, rows):
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(n, h, device=dev, generator=g, dtype=torch.bfloat16)
    w = (torch.randn(v, h, device=dev, generator=g) * h**-0.5).to(torch.bfloat16)
    t = torch.randint(0, v, (n,), device=dev, generator=g)
    gemm = ms(lambda: x @ w.T)
    rec = dict(shape=name, n=n, h=h, v=v, gemm_ms=gemm)
    print(f"\n{name} N={n} H={h} V={v}: GEMM {gemm:.3f} ms", flush=True)
    stats, _ = TB.forward(x, w, None, t, None, None, need_smooth=False, need_argmax=False, budget=1 << 28)
    coef = grad_coefficients(stats.lse, t, torch.full((n,), 1.0 / n, device=dev), v, None, CrossEntropyOptions())
    dz = torch.empty(n, v, device=dev, dtype=torch.bfloat16)
    for tiles in TILES:
      for tma in (True, False):
        base = _plans.triton_plan(n, v, h, 2, 1 << 40, dev, tiles=tiles)
        plan = dataclasses.replace(base, tma=tma)
        keep_plan = dataclasses.replace(plan, keep_cols=v)
        try:
            f = ms(lambda: TB.forward(x, w, None, t, None, None, need_smooth=False,
                                      need_argmax=False, budget=0, plan=plan))
            fk = ms(lambda: TB.forward(x, w, None, t, None, None, need_smooth=False,
                                       need_argmax=False, budget=0, plan=keep_plan, need_grad=True))
            grid = (triton.cdiv(n, plan.block_n), triton.cdiv(v, plan.block_v))
            x_op, w_op, use_tma = TB._operands(x, w, plan)

            def dl():
                K.dlogits_kernel[grid](
                    x_op, w_op, x, x, t, stats.lse, coef, dz, n, v, h, x.stride(0), x.stride(1),  # noqa: F821 (deleted below, after use)
                    w.stride(0), w.stride(1), dz.stride(0), 0, v, 1.0,  # noqa: F821 (deleted below, after use)
                    HAS_BIAS=False, HAS_SOFTCAP=False, HAS_CW=False, DOT_PRECISION="tf32",
                    USE_TMA=use_tma,
                    BLOCK_N=plan.block_n, BLOCK_V=plan.block_v, BLOCK_H=plan.block_h,
                    num_warps=plan.num_warps, num_stages=plan.num_stages)

            d = ms(dl)
        except Exception as e:  # a config may not fit in shared memory
            print(f"  tiles {tiles} tma {tma}: failed: {type(e).__name__}: {str(e)[:120]}", flush=True)
            continue
        rows.append(dict(rec, stage="tiles", tiles=tiles, tma=use_tma, splits=plan.vocab_splits,
                         fwd_ms=f, fwd_keep_ms=fk, dlogits_ms=d))
        print(f"  tiles {tiles} tma {use_tma:d} splits {plan.vocab_splits}: forward {f:.3f} ms ({f / gemm:.2f}x)  "
              f"with keep {fk:.3f} ({fk / gemm:.2f}x)  dlogits {d:.3f} ms ({d / gemm:.2f}x)", flush=True)
    dw = torch.empty_like(w)
    mm_dw = ms(lambda: torch.mm(dz.T, x, out=dw))  # noqa: F821 (deleted below, after use)
    mm_dx = ms(lambda: dz @ w)  # noqa: F821 (deleted below, after use)
    acc = torch.zeros(n, h, device=dev, dtype=torch.float32)
    half = v // 2
    try:
        mm_dx_acc = ms(lambda: torch.addmm(acc, dz[:, :half], w[:half], out_dtype=torch.float32, out=acc)) * 2  # noqa: F821 (deleted below, after use)
    except Exception as e:
        mm_dx_acc = float("nan")
        print("  addmm out_dtype failed:", e)
    print(f"  dW mm {mm_dw:.3f} ms ({mm_dw / gemm:.2f}x)  dx mm {mm_dx:.3f} ({mm_dx / gemm:.2f}x)  "
          f"dx fp32-acc in 2 chunks {mm_dx_acc:.3f}", flush=True)
    rows.append(dict(rec, stage="mm", dw_ms=mm_dw, dx_ms=mm_dx, dx_acc2_ms=mm_dx_acc))
    del dz
    torch.cuda.empty_cache()

    xg = x.clone().requires_grad_(True)
    wg = w.clone().requires_grad_(True)
    with torch.no_grad():
        fwd_only = ms(lambda: logitless.linear_cross_entropy(x, w, t))
    for label, budget in [("default", None), ("64MiB", 64 << 20), ("logits", n * v * 2 + n * v * 4 // 256)]:
        def step():
            xg.grad = wg.grad = None
            logitless.linear_cross_entropy(xg, wg, t, memory_budget=budget).backward()
        xg.grad = wg.grad = None
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - base - xg.grad.nbytes - wg.grad.nbytes) / 2**20
        fb = ms(step)
        rows.append(dict(rec, stage="e2e", budget=label, fwd_only_ms=fwd_only, fwdbwd_ms=fb, peak_extra_mib=peak))
        print(f"  e2e budget {label}: fwd-only {fwd_only:.3f} ms ({fwd_only / gemm:.2f}x GEMM)  "
              f"fwd+bwd {fb:.3f} ms ({fb / (3 * gemm):.2f}x 3 GEMMs)  peak extra {peak:.0f} MiB", flush=True)


def profile(name, n, h, v, budgets=("default", "logits"), with_compile=False):
    """Per-kernel CUDA time of one forward+backward at the ``budgets`` (torch.profiler);
    ``with_compile``: also torch.compile of F.cross_entropy(x @ W.T, t) (the logits-budget
    yardstick), profiled the same way."""
    dev = torch.device("cuda")
    x = torch.randn(n, h, device=dev, dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(v, h, device=dev) * h**-0.5).to(torch.bfloat16).requires_grad_(True)
    t = torch.randint(0, v, (n,), device=dev)
    sizes = {"default": None, "logits": n * v * 2 + n * v * 4 // 256}
    fns = {f"budget {b}": (lambda b=b: logitless.linear_cross_entropy(x, w, t, memory_budget=sizes[b]))
           for b in budgets}
    if with_compile:
        torch._dynamo.reset()
        compiled = torch.compile(lambda x, w, t: torch.nn.functional.cross_entropy(x @ w.T, t), dynamic=False)
        fns["torch.compile"] = lambda: compiled(x, w, t)
    for label, fn in fns.items():
        for _ in range(2):  # warm-up (compilation)
            x.grad = w.grad = None
            fn().backward()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            x.grad = w.grad = None
            fn().backward()
            torch.cuda.synchronize()
        print(f"\nprofile {name} {label}:")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=60))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--profile", action="store_true", help="per-kernel times only")
    ap.add_argument("--budgets", default="default,logits", help="with --profile: default, logits")
    ap.add_argument("--compile", action="store_true", help="with --profile: also torch.compile on logits")
    args = ap.parse_args()
    if args.profile:
        for name in args.shapes.split(","):
            profile(name, *SHAPES[name], budgets=tuple(args.budgets.split(",")), with_compile=args.compile)
        return
    rows = []
    meta = probe_meta(device=torch.cuda.get_device_name())
    print(meta, flush=True)
    for name in args.shapes.split(","):
        probe(name, *SHAPES[name], rows)
        write_json(f"{args.out}/probe_lce.json", dict(meta, rows=rows))


if __name__ == "__main__":
    main()
