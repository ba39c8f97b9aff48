"""Issue 23 item 2: fp32 at matmul precision "high": the planner's choice between operands
rounded to TF32 beforehand (``override(tf32_preround=True)``) and rounded in the kernels'
registers (``tf32_preround=False``), against both forced paths, with the cost model's
predictions (``plans.tf32_choice``: both plans priced by ``cost_model.predict_tf32``).

    PYTHONPATH=src python benchmarks/probe_tf32plan.py --out DIR [--smoke] [--budget-s S]

Cases: the precision suite's three shapes (2048x2048x32000, 4096x2048x128256,
llama3.1-8b 4096x4096x128256) at the default 256 MiB budget, 2048x2048x32000 at 1 GiB
(where the model predicts the switch to pre-rounded) and 512 tokens of llama3.1-8b (few
tokens: the model predicts in-kernel, the rounding pass over W costing about a forward),
each forward only (no input
requires grad) and forward+backward; per case: one cuBLAS TF32 GEMM x @ W^T (the unit),
the default (planner's path), forced pre-rounded, forced in-kernel (ms, median of
``triton.testing.do_bench``), the predicted ms of both, and whether the three losses are
bitwise equal (they must be: the paths differ in speed only). Writes
probe-tf32plan-<GPU>.json after every case (a cut-off run keeps what it measured) and
prints the summary table last. ``--budget-s``: stop starting cases after S seconds.
--smoke: tiny shapes on the CPU interpreter (checks the script runs).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

if "--smoke" in sys.argv:  # before triton is imported: its kernels then run on the interpreter
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

import logitless  # noqa: E402
from logitless.options import DEFAULT_MEMORY_BUDGET  # noqa: E402
from logitless.planning import plans as _plans  # noqa: E402
from logitless.planning.overrides import override  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _probe_common import probe_meta, write_json  # noqa: E402

PATHS = {"default": {}, "pre": dict(tf32_preround=True), "in-kernel": dict(tf32_preround=False)}


def _bench(fn, rep_ms, smoke):
    if smoke:
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    from triton.testing import do_bench

    return do_bench(fn, warmup=5, rep=rep_ms, return_mode="median")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=".")
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--budget-s", type=float, default=1e9)
    a = p.parse_args()
    t_start = time.time()
    cuda = torch.cuda.is_available() and not a.smoke
    dev = torch.device("cuda" if cuda else "cpu")
    torch.set_float32_matmul_precision("high")
    if cuda:
        cases = [("2048x2048x32000", 2048, 2048, 32000, DEFAULT_MEMORY_BUDGET),
                 ("4096x2048x128256", 4096, 2048, 128256, DEFAULT_MEMORY_BUDGET),
                 ("llama3.1-8b", 4096, 4096, 128256, DEFAULT_MEMORY_BUDGET),
                 ("2048x2048x32000", 2048, 2048, 32000, 1 << 30),
                 ("512x4096x128256", 512, 4096, 128256, DEFAULT_MEMORY_BUDGET)]
    else:  # the interpreter: tiny shapes, budgets on both sides of the logits' size
        cases = [("smoke-16x16x200", 16, 16, 200, 1 << 20)]
    meta = probe_meta(device=torch.cuda.get_device_name() if cuda else "cpu (interpreter)")
    tag = "smoke" if not cuda else ("H200" if "H200" in meta["device"] else "H100")
    path = os.path.join(a.out, f"probe-tf32plan-{tag}.json")
    rows = []
    for name, n, h, v, budget in cases:
        if time.time() - t_start > a.budget_s:
            print(f"skipped {name} at {budget >> 20} MiB: past --budget-s {a.budget_s}", flush=True)
            continue
        g = torch.Generator(device=dev).manual_seed(0)
        x = torch.randn(n, h, device=dev, generator=g)
        w = torch.randn(v, h, device=dev, generator=g) * h**-0.5
        t = torch.randint(0, v, (n,), device=dev, generator=g)
        xg, wg = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
        gemm = _bench(lambda: x @ w.T, 100, a.smoke)

        def fwd():
            return logitless.linear_cross_entropy(x, w, t, memory_budget=budget, backend="triton")

        def fb():
            xg.grad = wg.grad = None
            logitless.linear_cross_entropy(xg, wg, t, memory_budget=budget, backend="triton").backward()

        for mode, fn, rep in (("fwd", fwd, 150), ("fb", fb, 400)):
            grad = mode == "fb"
            choice = _plans.tf32_choice(n, v, h, budget, dev, grad=grad)
            row = dict(shape=name, tokens=n, hidden=h, vocab=v, budget_mib=budget >> 20, mode=mode,
                       gemm_ms=gemm, chosen="pre" if choice.prerounded else "in-kernel",
                       pred_pre_ms=choice.pre.ms, pred_in_kernel_ms=choice.in_kernel.ms,
                       pre_plan=str(choice.pre_plan), in_kernel_plan=str(choice.in_kernel_plan))
            losses = {}
            for label, ov in PATHS.items():
                try:
                    with override(**ov):
                        with torch.no_grad():
                            losses[label] = fwd()
                        row[f"{label}_ms"] = _bench(fn, rep, a.smoke)
                except Exception as exc:  # noqa: BLE001 - report, go on with the others
                    row[f"{label}_ms"] = None
                    row[f"{label}_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
                    print(f"  {name} {mode} {label}: {row[f'{label}_error']}", flush=True)
            if len(losses) == 3:
                row["losses_bitwise_equal"] = all(torch.equal(losses["default"], o) for o in losses.values())
            ms = {k: row.get(f"{k}_ms") for k in PATHS}
            if ms["pre"] and ms["in-kernel"]:
                best = "pre" if ms["pre"] <= ms["in-kernel"] else "in-kernel"
                # right, or within 3% of the faster path (noise)
                row["choice_ok"] = row["chosen"] == best or min(ms["pre"], ms["in-kernel"]) * 1.03 >= (
                    ms["pre"] if row["chosen"] == "pre" else ms["in-kernel"])
            rows.append(row)
            unit = gemm * (3 if grad else 1)
            print(f"{name} {budget >> 20} MiB {mode}: chosen {row['chosen']}, "
                  + ", ".join(f"{k} {m:.3f} ms ({m / unit:.2f}x)" for k, m in ms.items() if m)
                  + f"; predicted pre {choice.pre.ms:.3f} / in-kernel {choice.in_kernel.ms:.3f}", flush=True)
            write_json(path, dict(meta, rows=rows))
        if cuda:
            torch.cuda.empty_cache()

    print(f"\n=== tf32plan: fp32 'high', the planner's path vs both forced ({meta['device']}); "
          "ms and x TF32 GEMMs (fwd: 1 GEMM, fb: 3); pred = cost model ms")
    print(f"{'shape':18s} {'MiB':>5s} {'pass':4s} {'chosen':9s} {'default':>16s} {'pre':>16s} {'in-kernel':>16s}"
          f" {'pred pre/in':>17s} ok  bitwise")

    def cell(r, k, unit):
        m = r.get(f"{k}_ms")
        return f"{m:8.3f} ({m / unit:4.2f}x)" if m else f"{'failed':>16s}"

    for r in rows:
        unit = r["gemm_ms"] * (3 if r["mode"] == "fb" else 1)
        print(f"{r['shape']:18s} {r['budget_mib']:5d} {r['mode']:4s} {r['chosen']:9s} {cell(r, 'default', unit)} "
              f"{cell(r, 'pre', unit)} {cell(r, 'in-kernel', unit)} "
              f"{r['pred_pre_ms']:8.2f}/{r['pred_in_kernel_ms']:<8.2f}"
              f" {str(r.get('choice_ok', '-')):5s} {r.get('losses_bitwise_equal', '-')}")
    print(f"wrote {path} ({time.time() - t_start:.0f} s)")


if __name__ == "__main__":
    main()
