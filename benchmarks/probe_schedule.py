"""The fused GEMM kernels' scheduling options, measured one by one (issue 12).

For each shape: the cuBLAS GEMM unit; the forward kernel (no kept columns, and keeping
all of them) and the dlogits kernel over the whole vocabulary in 4096-column chunks
(one GEMM's FLOPs) under each option of ``plans.KERNEL_OPTIONS`` (grouped program
order, ``_plans.group_rows`` or a given number of row blocks per group, a flattened pipeline, bulk dz stores,
persistent dlogits programs); then the op end to end (forward only, and
forward+backward at the default and a logits-sized budget) with the plain schedule
and with the shipped default. Every variant is checked bitwise against the plain one.

    python benchmarks/probe_schedule.py --out $OUT [--shapes llama3.1-8b,...]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import time

import torch
from _probe_common import probe_meta, write_json  # the probes' folder is on sys.path
from triton.testing import do_bench

import logitless
from logitless.formulas.cross_entropy import grad_coefficients
from logitless.ops.linear_cross_entropy import triton_backend as TB
from logitless.options import CrossEntropyOptions
from logitless.planning import plans as _plans
from logitless.planning.overrides import override

SHAPES = {  # name: (tokens, hidden, vocab)
    "llama3.1-8b": (4096, 4096, 128256),
    "qwen3-8b": (4096, 4096, 151936),
    "gemma3-4b": (4096, 2560, 262144),
    "gpt-oss-120b": (4096, 2880, 201088),
    "deepseek-v3": (8192, 7168, 128256),
    "llama3.1-8b-16k": (16384, 4096, 128256),
    "llama3.1-70b": (4096, 8192, 128256),
    "llama2-7b-512": (512, 4096, 32000),
    "llama3.1-8b-512": (512, 4096, 128256),
}
PLAIN = dict(group=False, flatten=False, dz_tma=False, dlogits_programs=0)
FWD_VARIANTS = {  # "_rows": row blocks per group (default: _plans.group_rows)
    "plain": dict(PLAIN),
    "group": dict(PLAIN, group=True),
    "flatten": dict(PLAIN, flatten=True),
    "group+flatten": dict(PLAIN, group=True, flatten=True),
    "group8+flatten": dict(PLAIN, group=True, flatten=True, _rows=8),
    "group32+flatten": dict(PLAIN, group=True, flatten=True, _rows=32),
}
DL_VARIANTS = {
    "plain": dict(PLAIN),
    "group": dict(PLAIN, group=True),
    "dz_tma": dict(PLAIN, dz_tma=True),
    "group+dz_tma": dict(PLAIN, group=True, dz_tma=True),
    "persistent+dz_tma": dict(PLAIN, dz_tma=True, dlogits_programs=1, flatten=True),
    "group+persistent": dict(PLAIN, group=True, dlogits_programs=1, flatten=True),
    "group+dz_tma+persistent": dict(PLAIN, group=True, dz_tma=True, dlogits_programs=1, flatten=True),
    "group8+persistent": dict(PLAIN, group=True, dlogits_programs=1, flatten=True, _rows=8),
    "group32+persistent": dict(PLAIN, group=True, dlogits_programs=1, flatten=True, _rows=32),
}
#: Each shape is measured in ROUNDS rounds, every variant and the GEMM unit once per
#: round; a variant's ratio is the median over rounds of its time / that round's GEMM
#: (the H100's clocks drift by 5-10% within a run: ratios within one round are stable).
ROUNDS = 3

#: PROBE_DEVICE=cpu (with TRITON_INTERPRET=1 and --shapes tiny) checks the script itself.
DEVICE = os.environ.get("PROBE_DEVICE", "cuda")
SHAPES["tiny"] = (40, 24, 300)


def ms(fn):
    if DEVICE == "cpu":
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    return do_bench(fn, warmup=5, rep=150, return_mode="median")


_ACTIVE = contextlib.ExitStack()


def set_options(opts):
    """The scheduling options in force from now on (``overrides.override``)."""
    o = dict(opts)
    rows = o.pop("_rows", None)
    _ACTIVE.close()
    _ACTIVE.enter_context(override(kernel_options=o, group_rows=rows))


def median(vals):
    vals = sorted(vals)
    return vals[len(vals) // 2]


def probe(name, n, h, v, rows, meta):
    dev = torch.device(DEVICE)
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(n, h, device=dev, generator=g, dtype=torch.bfloat16)
    w = (torch.randn(v, h, device=dev, generator=g) * h**-0.5).to(torch.bfloat16)
    t = torch.randint(0, v, (n,), device=dev, generator=g)
    print(f"\n{name} N={n} H={h} V={v}", flush=True)
    set_options(PLAIN)
    stats, _ = TB.forward(x, w, None, t, None, None, need_smooth=False, need_argmax=False, budget=1 << 28)
    coef = grad_coefficients(stats.lse, t, torch.full((n,), 1.0 / n, device=dev), v, None, CrossEntropyOptions())
    budget = _plans.DEFAULT_MEMORY_BUDGET
    runs = {}  # (stage, variant) -> (callable, plan, bitwise_same)
    ref = {}
    for stage, variants in (("forward", FWD_VARIANTS), ("forward-keep", FWD_VARIANTS), ("dlogits", DL_VARIANTS)):
        variants = dict(variants, shipped=meta["shipped_options"])
        if meta["quick"]:
            variants = {k: variants[k] for k in ("plain", "shipped")}
        for label, opts in variants.items():
            set_options(opts)
            plan = _plans.triton_plan(n, v, h, 2, budget, dev, keep_allowed=False)
            if stage == "forward-keep":
                plan = dataclasses.replace(plan, keep_cols=v)
            if stage.startswith("forward"):
                def fn(p=plan, keep=stage == "forward-keep"):
                    return TB.forward(x, w, None, t, None, None, need_smooth=False, need_argmax=False,
                                      budget=0, plan=p, need_grad=keep)[0].lse
                out = fn()
            else:  # the recompute of every column, in the planner's chunks (no GEMM after)
                def fn(p=plan):
                    return TB.backward(x, w, None, t, None, None, stats.lse, coef, need_dx=False,
                                       need_dw=False, need_db=False, budget=0, plan=p)
                # bitwise check through dW (dz feeds it directly)
                out = TB.backward(x, w, None, t, None, None, stats.lse, coef, need_dx=False, need_dw=True,
                                  need_db=False, budget=0, plan=plan)[1]
            ref.setdefault(stage, out)
            runs[stage, label] = (fn, plan, bool(torch.equal(out, ref[stage])))
            del out
    ref.clear()
    torch.cuda.empty_cache() if DEVICE == "cuda" else None
    times = {k: [] for k in runs}
    gemms = []
    for _ in range(ROUNDS):
        gemm = ms(lambda: x @ w.T)
        gemms.append(gemm)
        for k, (fn, _, _) in runs.items():
            set_options(PLAIN)
            times[k].append(ms(fn) / gemm)
    gemm = median(gemms)
    print(f"  GEMM {gemm:.3f} ms (rounds: {', '.join(f'{g:.3f}' for g in gemms)})")
    for (stage, label), (_fn, plan, same) in runs.items():
        r = median(times[stage, label])
        spread = max(times[stage, label]) - min(times[stage, label])
        rows.append(dict(shape=name, n=n, h=h, v=v, gemm_ms=gemm, stage=stage, variant=label,
                         group_n=plan.group_n, vocab_chunk=plan.vocab_chunk, ratio=r, spread=spread,
                         ratios=times[stage, label], bitwise_same=same))
        print(f"  {stage:12} {label:28} group_n {plan.group_n:3d}: {r:.3f}x GEMM (spread {spread:.3f})"
              f"{'' if same else '  NOT BITWISE SAME'}", flush=True)
    del runs
    xg = x.clone().requires_grad_(True)
    wg = w.clone().requires_grad_(True)
    e2e = {}
    for label, opts in [("plain", PLAIN), ("shipped", meta["shipped_options"])] * ROUNDS:
        set_options(opts)
        gemm = ms(lambda: x @ w.T)
        with torch.no_grad():
            e2e.setdefault((label, "fwd_only"), []).append(ms(lambda: logitless.linear_cross_entropy(x, w, t)) / gemm)
        for blabel, budget in [("default", None), ("logits", n * v * 2 + n * v * 4 // 256)]:
            def step():
                xg.grad = wg.grad = None
                logitless.linear_cross_entropy(xg, wg, t, memory_budget=budget).backward()
            e2e.setdefault((label, blabel), []).append(ms(step) / (3 * gemm))
    for label in ("plain", "shipped"):
        out = {k: median(e2e[label, k]) for k in ("fwd_only", "default", "logits")}
        rows.append(dict(shape=name, n=n, h=h, v=v, stage="e2e", variant=label, **out))
        print(f"  e2e {label:8}: fwd-only {out['fwd_only']:.3f}x GEMM  f+b default {out['default']:.3f}x 3G  "
              f"logits {out['logits']:.3f}x 3G", flush=True)
    set_options(meta["shipped_options"])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--quick", action="store_true", help="only the plain and the shipped schedule")
    args = ap.parse_args()
    shipped = dict(_plans.KERNEL_OPTIONS, _rows=None)
    dev = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu"
    meta = probe_meta(device=dev, shipped_options=shipped, quick=args.quick)
    print(meta, flush=True)
    rows = []
    tag = "H200" if "H200" in dev else "H100" if "H100" in dev else dev.replace(" ", "_")
    for name in args.shapes.split(","):
        probe(name, *SHAPES[name], rows, meta)
        write_json(f"{args.out}/probe-schedule{'-quick' if args.quick else ''}-{tag}.json", dict(meta, rows=rows))


if __name__ == "__main__":
    main()
