"""GPU probe: the CuTe forward's CTA order and vocabulary splits at large token counts.

    python benchmarks/cute/probe_raster.py [--json out.json] [--rounds 4] [--budget-s 150]

Why: the library forward (``cute_lib.forward_stats``) runs one CTA per (128-row block,
split) in a grid (row blocks, splits), so the CTAs launched together cover ~132 row blocks
of one split. Each CTA re-reads its x block (128 x H) once per 256-column vocabulary tile,
so those blocks must stay in L2: 132 x 128 x H x 2 bytes is 132 MiB at H = 4096, far above
the H100's 50 MiB, and the first GPU table (session 6, ``cute_choice.sh``) shows the CuTe
forward losing to Triton exactly where N is large (16384 x 4096: 1.11-1.19x cuBLAS vs 1.03).
First run (session 6): a split-major grid (CTAs in flight share row blocks) with more splits
was predicted to fix it and measured 1.2-1.8x cuBLAS (worse). Yet the Triton kernel orders its
programs ``group`` row blocks at a time (``triton_lib.gemm.grouped_tile``: 16 row blocks x the
splits, row block fastest) and reaches 1.03x at 16384 x 4096. This run: the CuTe kernel in the
same grouped order (``forward_stats`` ``group`` = G, a 1-D grid; G = 1 is split-major).

Per shape, contenders timed INTERLEAVED (``interleave.interleaved``; each ratio is the
median over rounds of the per-round ratio to cuBLAS ``x @ W.T``): the library's rule
(``planning.cute.splits_for``, plain grid "g0") and (group G, splits S) for G in 8, 16, 32 and
S in the rule's, 16, 32.
Correctness: each contender's partials merged to lse must equal the rule's bitwise when the
splits match and to 1e-5 otherwise (the same kernel: a different grid order changes no
arithmetic). Without CUDA: prints the plan and exits 0 (nothing to time).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import interleave  # noqa: E402

SHAPES = [(16384, 4096, 128256), (8192, 7168, 128256), (32768, 2048, 128256), (8192, 4096, 32768),
          (8192, 3072, 128256), (4096, 4096, 128256)]
GROUPS = (8, 16, 32)
SPLITS = (16, 32)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--budget-s", type=float, default=150.0)
    args = ap.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("no CUDA: nothing to time; contenders per shape: (group, splits) for groups", GROUPS,
              "and splits (the rule's,)", SPLITS)
        return 0
    import triton

    from logitless.cute_lib import launch as cl
    from logitless.planning import cute as cp
    from logitless.planning.plans import num_sms
    from logitless.triton_lib.launch import partials

    t0 = time.monotonic()
    dev = torch.device("cuda")
    sms = num_sms(dev)
    out = {"command": " ".join([sys.executable] + sys.argv), "date": datetime.datetime.utcnow().isoformat() + "Z",
           "device": torch.cuda.get_device_name(), "sms": sms,
           "versions": {"torch": torch.__version__, "triton": triton.__version__,
                        "python": platform.python_version()}, "rows": []}
    bench = interleave.gpu_bench(rep=40)
    for n, h, v in SHAPES:
        if time.monotonic() - t0 > args.budget_s:
            out["cut_off"] = f"budget {args.budget_s} s reached before {n}x{h}x{v}"
            break
        g = torch.Generator(device=dev).manual_seed(0)
        x = torch.randn(n, h, device=dev, generator=g).to(torch.bfloat16)
        w = (torch.randn(v, h, device=dev, generator=g) * (2.0 / h ** 0.5)).to(torch.bfloat16)
        t = torch.randint(0, v, (n,), device=dev, generator=g, dtype=torch.int32)
        rule = cp.splits_for(n, v, sms)
        v_tiles = -(-v // cp.TILE_N)
        cands = {(0, rule)} | {(g, s) for g in GROUPS for s in (rule,) + SPLITS if s <= v_tiles}
        cands = sorted(cands)
        row = {"n": n, "h": h, "v": v, "rule_splits": rule, "check": {}}

        def runner(group, s):
            parts = partials(3, s, n, dev)

            def fn():
                cl.forward_partials("probe", x, w, t, parts, s, group=group)
            return fn, parts

        def lse_of(parts):
            m, e, _ = parts
            big = m.max(0).values
            return big + torch.log((e * torch.exp(m - big)).sum(0))

        measures = {"cublas": lambda: bench(lambda: x @ w.T)}
        ref = None
        for order, s in cands:
            order = f"g{order}"
            fn, parts = runner(int(order[1:]), s)
            try:
                fn()
                torch.cuda.synchronize()
                lse = lse_of(parts)
                if ref is None:
                    ref_fn, ref_parts = runner(0, rule)
                    ref_fn()
                    ref = lse_of(ref_parts)
                err = (lse - ref).abs().max().item()
                row["check"][f"{order}s{s}"] = err
                if err > 1e-3:  # (fp32 sums in another order: S = 1 sums 128k terms in one CTA)
                    row[f"{order}s{s}_error"] = f"lse differs from the rule's by {err}"
                    continue
                measures[f"{order}s{s}"] = (lambda fn=fn: bench(fn))
            except Exception as exc:  # noqa: BLE001
                row[f"{order}s{s}_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
        res = interleave.interleaved(measures, rounds=args.rounds, baseline="cublas")
        row["rounds"] = res.pop("_rounds")
        row["cublas_ms"] = res["cublas"].get("ms")
        row["ratios"] = {k: {q: rec.get(q) for q in ("ratio", "ratio_min", "ratio_max", "ms", "spread")}
                         for k, rec in res.items() if k != "cublas"}
        out["rows"].append(row)
        best = min(row["ratios"].items(), key=lambda kv: kv[1]["ratio"] or 9)
        print(f"{n}x{h}x{v}: cuBLAS {row['cublas_ms']:.3f} ms; rule g0s{rule} "
              f"{row['ratios'].get(f'g0s{rule}', {}).get('ratio')}; best {best[0]} {best[1]['ratio']:.3f}", flush=True)
        print("   " + "  ".join(f"{k} {r['ratio']:.3f}" for k, r in row["ratios"].items() if r["ratio"]), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(out, f, indent=1)
        x = w = t = None
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
