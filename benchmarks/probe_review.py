"""Review of issue 23 (helper "review"): are the dlogits kernels as fast as before the
``recomputed_tile(W_CHUNK)`` refactor? The sm_90 PTX is identical (benchmarks/
check_kernel_asm.py on the CPU), so the times must match the last recorded H100 runs
within their noise; this measures it on the GPU.

    PYTHONPATH=src python benchmarks/probe_review.py --out DIR [--smoke]

Cases at llama3.1-8b's LM head (4096 tokens x H 4096 x V 128256), ``backend="triton"``,
default budget: linear_cross_entropy and linear_log_probs (entropy off), forward and
forward+backward (the backward runs the dlogits kernels), in bf16 and in fp32 at matmul
precision "high" (operands pre-rounded to TF32, W in chunks: the W_CHUNK kernels).
Times: ``triton.testing.do_bench`` medians; each divided by one cuBLAS GEMM x @ W^T of
the same dtype and precision measured in this run (forward / 1 GEMM, forward+backward /
3 GEMMs), and, where the same harness recorded one, compared with that ratio:
    fp32 lce fwd / fb and llp fwd: benchmarks/results/probe-tf32-H100-2026-11-23.json
    (fwd / fb [pre default-budget], llp fwd[pre]: do_bench as here, same inputs' shapes)
The bf16 linear_cross_entropy speed is checked apples to apples by the lce suite and
``compare`` against its recorded run (benchmarks/gpu/review.sh); the bf16 rows and the
log-prob forward+backward here have no recorded twin of this harness: new numbers.
``now/rec`` above 1.05 (and beyond the recorded spread) is flagged SLOWER.
--smoke: tiny shapes on Triton's CPU interpreter (checks that the script runs).
Writes review-probe-<GPU or smoke>.json to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

if "--smoke" in sys.argv:  # before triton is imported: its kernels then run on the interpreter
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import triton  # noqa: E402
from _probe_common import probe_meta, write_json  # noqa: E402

import logitless  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
THRESHOLD = 0.05


def recorded() -> dict:
    """{(op, dtype, metric): (ratio to its GEMM unit, relative spread)} of the recorded
    probe (probe_tf32.py records no spread: 0, so the threshold alone applies)."""
    out = {}
    try:
        p = json.loads((RESULTS / "probe-tf32-H100-2026-11-23.json").read_text())["results"]
        out[("lce", "fp32-high", "fwd")] = (p["fwd[pre default-budget]"] / p["gemm"], 0.0)
        out[("lce", "fp32-high", "fb")] = (p["fb[pre default-budget]"] / (3 * p["gemm"]), 0.0)
        out[("llp", "fp32-high", "fwd")] = (p["llp fwd[pre]"] / p["gemm"], 0.0)
    except (OSError, KeyError, ValueError, TypeError) as e:
        print(f"no recorded fp32 probe: {type(e).__name__}: {e}")
    return out


def bench(fn, rep_ms, smoke):
    if smoke:
        fn()
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    return triton.testing.do_bench(fn, warmup=10, rep=rep_ms, return_mode="median")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--dtypes", default="bf16,fp32-high")
    a = ap.parse_args()
    cuda = torch.cuda.is_available() and not a.smoke
    dev = torch.device("cuda" if cuda else "cpu")
    meta = probe_meta(None if cuda else "cpu (smoke)")
    print(meta, flush=True)
    n, h, v = (4096, 4096, 128256) if cuda else (24, 20, 131)
    rec = recorded() if cuda else {}
    rows = []
    tag = "smoke" if not cuda else ("H200" if "H200" in meta["device"] else "H100")
    path = Path(a.out) / f"review-probe-{tag}.json"
    for dt in a.dtypes.split(","):
        dtype = torch.bfloat16 if dt == "bf16" else torch.float32
        torch.set_float32_matmul_precision("high")
        g = torch.Generator(device=dev).manual_seed(0)
        x = torch.randn(n, h, device=dev, generator=g).to(dtype)
        w = (torch.randn(v, h, device=dev, generator=g) * h**-0.5).to(dtype)
        t = torch.randint(0, v, (n,), device=dev, generator=g)
        xg, wg = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
        try:
            gemm = bench(lambda: x @ w.T, 100, not cuda)
        except Exception as e:  # noqa: BLE001 (reported; the ratios are then missing)
            print(f"gemm {dt}: {type(e).__name__}: {e}")
            gemm = None
        ops = {
            "lce": lambda a_, b_: logitless.linear_cross_entropy(a_, b_, t, backend="triton"),
            "llp": lambda a_, b_: logitless.linear_log_probs(a_, b_, t, backend="triton").sum(),
        }
        for op, f in ops.items():
            def fb(f=f):
                xg.grad = wg.grad = None
                f(xg, wg).backward()

            for metric, fn, rep, units in (("fwd", lambda f=f: f(x, w), 100, 1), ("fb", fb, 200, 3)):
                row = dict(op=op, dtype=dt, metric=metric, shape=[n, h, v], gemm_ms=gemm)
                try:
                    ms = bench(fn, rep, not cuda)
                    row["ms"] = ms
                    if gemm:
                        row["x_gemm"] = ms / (units * gemm)
                    if (op, dt, metric) in rec and gemm:
                        r, spread = rec[(op, dt, metric)]
                        row.update(recorded_x_gemm=r, recorded_spread=spread, now_vs_recorded=row["x_gemm"] / r)
                        row["verdict"] = ("SLOWER" if row["now_vs_recorded"] > 1 + max(THRESHOLD, spread)
                                          else "same" if row["now_vs_recorded"] >= 1 - max(THRESHOLD, spread)
                                          else "faster")
                except Exception as e:  # noqa: BLE001 (one failing case must not stop the others)
                    row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                rows.append(row)
                write_json(str(path), dict(meta, rows=rows, threshold=THRESHOLD))  # kept if cut off
                print(f"  {op} {dt:9s} {metric:3s} " + (row.get("error") or f"{row['ms']:9.3f} ms"), flush=True)
        if cuda:  # (the next dtype's tensors replace these)
            torch.cuda.empty_cache()
    torch.set_float32_matmul_precision("highest")
    write_json(str(path), dict(meta, rows=rows, threshold=THRESHOLD))

    def f3(v):
        return "-" if v is None else f"{v:.3f}"

    print(f"\n=== dlogits refactor speed check, {n} x {h} x {v}, backend triton, default budget ({meta['device']})")
    print("fwd: ms / 1 GEMM; fb (forward+backward): ms / 3 GEMMs; recorded: the same ratio in the last H100 runs")
    print(f"{'op':4s} {'dtype':9s} {'metric':6s} {'ms':>9s} {'x GEMM':>7s} {'recorded':>8s} {'now/rec':>7s}  verdict")
    for r in rows:
        print(f"{r['op']:4s} {r['dtype']:9s} {r['metric']:6s} {f3(r.get('ms')):>9s} {f3(r.get('x_gemm')):>7s} "
              f"{f3(r.get('recorded_x_gemm')):>8s} {f3(r.get('now_vs_recorded')):>7s}  "
              f"{r.get('verdict') or r.get('error', 'new (no recorded twin)')[:80]}")
    print(f"wrote {path}")
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
