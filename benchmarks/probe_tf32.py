"""Issue 23 item 2: fp32 inputs at matmul precision "high" on operands rounded to TF32
beforehand (x once, W in vocabulary chunks into a scratch buffer; the fused kernels on
TF32-exact operands by TMA), against the path before it (rounding in the kernels'
registers, ``override(tf32_preround=False)``) and one cuBLAS TF32 GEMM.

    PYTHONPATH=src python benchmarks/probe_tf32.py --out DIR [--smoke]

Rows (ms, and x one TF32 GEMM x @ W^T; forward+backward also x three):
  gemm / round_w / clone_w   cuBLAS TF32 GEMM; one ``launch.round_to_tf32`` pass over W;
                             W.clone() (one read + one write: the rounding pass's floor)
  fwd[...]                   forward only (no input requires grad): pre-rounded at the
                             default budget (W in chunks), at 4 GiB (W whole), with the
                             two candidate tile sets forced; the in-kernel rounding path
  fb[...]                    forward+backward, the same variants
  highest fwd / fb           3xTF32 at "highest" (must be no worse than before the change)
  llp fwd[...]               linear_log_probs forward, pre-rounded and in-kernel
Also the loss of each variant against a float64 loss of a row subset (TF32-class errors
expected, the pre-rounded and in-kernel losses equal up to summation order).
--smoke: tiny shapes on whatever device there is (CPU: Triton's interpreter), to check
the script runs. Writes probe-tf32-<GPU>.json to --out.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import sys
import time

if "--smoke" in sys.argv:  # before triton is imported: its kernels then run on the interpreter
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import triton  # noqa: E402

import logitless  # noqa: E402
from logitless.planning.overrides import override  # noqa: E402
from logitless.triton_lib import launch  # noqa: E402


def _bench(fn, rep_ms, smoke):
    if smoke:
        fn()
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    from triton.testing import do_bench

    return do_bench(fn, warmup=5, rep=rep_ms, return_mode="median")


def _tiles_per_program(k, v):
    """override(plan=...): forward splits of k vocabulary tiles each (pre-rounded plans
    only; each W chunk then holds w_chunk // (k tiles) whole splits)."""
    def reshape(p):
        if not p.w_chunk:
            return p
        return dataclasses.replace(p, vocab_splits=math.ceil(math.ceil(v / p.block_v) / k))
    return reshape


def lce(*args, **kw):
    return logitless.linear_cross_entropy(*args, backend="triton", **kw)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--smoke", action="store_true")
    a = ap.parse_args()
    cuda = torch.cuda.is_available() and not a.smoke
    dev = torch.device("cuda" if cuda else "cpu")
    meta = dict(device=torch.cuda.get_device_name() if cuda else "cpu (smoke)", torch=torch.__version__,
                triton=triton.__version__, python=platform.python_version(),
                date=time.strftime("%Y-%m-%dT%H:%M:%S"), command=" ".join(sys.argv))
    print(meta, flush=True)
    n, h, v = (4096, 4096, 128256) if cuda else (32, 24, 301)
    big = 4 * 2**30 if cuda else 2**24
    torch.manual_seed(0)
    x = torch.randn(n, h, device=dev)
    w = torch.randn(v, h, device=dev) * h**-0.5
    t = torch.randint(0, v, (n,), device=dev)
    res, errs = dict(shape=[n, h, v]), {}
    torch.set_float32_matmul_precision("high")

    def timed(name, fn, rep_ms=150):
        try:
            res[name] = _bench(fn, rep_ms, not cuda)
        except Exception as e:  # noqa: BLE001  (report, do not hide: the other rows still run)
            res[name] = f"{type(e).__name__}: {str(e)[:300]}"
        print(f"  {name:44s} {res[name] if isinstance(res[name], str) else round(res[name], 3)}", flush=True)

    timed("gemm", lambda: x @ w.T)
    timed("round_w", lambda: launch.round_to_tf32(w))
    timed("clone_w", lambda: w.clone())

    # float64 loss of a row subset, for the error column
    rows = slice(0, min(n, 256))
    ref = torch.nn.functional.cross_entropy(x[rows].double() @ w.double().T, t[rows]).item()

    variants = {  # name: (overrides, memory_budget)
        "pre default-budget": (dict(), None),
        "pre 4GiB (W whole)": (dict(), big),
        "pre tiles(128,256,32,8,4)": (dict(tiles=(128, 256, 32, 8, 4)), None),
        "pre tiles(128,128,32,8,4)": (dict(tiles=(128, 128, 32, 8, 4)), None),
        # the forward's splits: tiles per program within each W chunk (default: WAVES rule)
        "pre 2 tiles/program": (dict(plan=_tiles_per_program(2, v)), None),
        "pre 4 tiles/program": (dict(plan=_tiles_per_program(4, v)), None),
        "in-kernel rounding (before)": (dict(tf32_preround=False), None),
        "in-kernel rounding 4GiB": (dict(tf32_preround=False), big),
    }
    if not cuda:  # the interpreter: tiles of its own
        variants = {k: val for k, val in variants.items() if "tiles(" not in k}
    for name, (ov, budget) in variants.items():
        with override(**ov):
            timed(f"fwd[{name}]", lambda b=budget: lce(x, w, t, memory_budget=b))
            try:
                loss = lce(x[rows], w, t[rows], memory_budget=budget).item()
                errs[f"fwd[{name}]"] = abs(loss - ref)
            except Exception as e:  # noqa: BLE001
                errs[f"fwd[{name}]"] = f"{type(e).__name__}: {str(e)[:200]}"
    xg = x.clone().requires_grad_(True)
    wg = w.clone().requires_grad_(True)

    def fb(budget):
        xg.grad = wg.grad = None
        logitless.linear_cross_entropy(xg, wg, t, memory_budget=budget, backend="triton").backward()

    for name, (ov, budget) in variants.items():
        if "tiles/program" in name:  # forward-only variants
            continue
        with override(**ov):
            timed(f"fb[{name}]", lambda b=budget: fb(b), rep_ms=400)
    for name, ov in (("pre", {}), ("in-kernel", dict(tf32_preround=False))):
        with override(**ov):
            timed(f"llp fwd[{name}]", lambda: logitless.linear_log_probs(x, w, t, backend="triton"))
    torch.set_float32_matmul_precision("highest")
    timed("highest gemm", lambda: x @ w.T)
    timed("highest fwd", lambda: logitless.linear_cross_entropy(x, w, t, backend="triton"))
    timed("highest fb", lambda: fb(None), rep_ms=400)
    torch.set_float32_matmul_precision("high")

    gemm = res["gemm"] if isinstance(res["gemm"], float) else float("nan")
    print(f"\n=== tf32 pre-rounded, {n} x {h} x {v} fp32 at 'high' ({meta['device']}): ms, x one TF32 GEMM"
          " (forward+backward rows also x three); |loss - float64| of 256 rows")
    for k, val in res.items():
        if k == "shape":
            continue
        if isinstance(val, float):
            base = res.get("highest gemm", gemm) if k.startswith("highest") else gemm
            extra = f"  {val / (3 * base):6.3f}x3" if k.startswith("fb") or k == "highest fb" else ""
            err = errs.get(k)
            err_s = f"  err {err:.2e}" if isinstance(err, float) else ""
            print(f"  {k:44s} {val:9.3f} ms  {val / base:6.3f}x{extra}{err_s}")
        else:
            print(f"  {k:44s} {val}")
    tag = "smoke" if not cuda else ("H200" if "H200" in meta["device"] else "H100")
    os.makedirs(a.out, exist_ok=True)
    with open(f"{a.out}/probe-tf32-{tag}.json", "w") as f:
        json.dump(dict(meta, results=res, loss_err_vs_float64=errs), f, indent=1)


if __name__ == "__main__":
    main()
