"""Interleaved forward+backward of linear cross-entropy: logitless's budgets vs torch.compile.

    python benchmarks/probe_lce_ab.py [--shapes llama3.1-8b,...] [--methods logitless,logitless@logits,torch-compile]
                                      [--rounds 5] [--reps 5] [--budget-s 300] [--json out.json]

Why: the lce suite (``python -m logitless_bench --suite lce``) times the methods of a shape one
after the other, minutes apart at the large shapes; two runs of it on the same H100 in session 6
put logitless@logits against torch.compile between -2.5% and +8% per shape, and session 4 between
-1% and +4%: the clock (power cap) moves more than the difference being judged. Here every round
times every contender once (the GEMM unit ``x @ W.T``, each method's forward+backward and
forward), in an order rotated per round (``benchmarks/cute/interleave.py``), and a ratio is the
median over rounds of the ratio of the same round. Methods are the bench's own adapters
(``logitless_bench.peers``: ``logitless`` = default budget, ``logitless@logits``,
``torch-compile`` = torch.compile of F.cross_entropy(x @ W.T, t)); a name ending in ``/triton``
(e.g. ``logitless/triton``) is that method with the CuTe DSL forward switched off
(``override(cute=False)``: the A/B of the CuTe path inside training); timed by the bench's
``timing.time_ms_spread`` (CUDA events, L2 flushed, gradients set to None between calls).

Prints per shape: f+b / 3 GEMMs per method, and logitless@logits / torch-compile (f+b, forward)
with the min-max over rounds. Without CUDA: the CPU case through the torch backend (harness
check only).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "cute"))
import interleave  # noqa: E402


def _without_cute(fn):
    from logitless.planning.overrides import override

    def run(*args):
        with override(cute=False):
            return fn(*args)
    return run


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=None, help="bench shape names (default: the six anchors)")
    ap.add_argument("--methods", default="logitless,logitless@logits,torch-compile")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=5, help="timed calls per contender per round (median)")
    ap.add_argument("--budget-s", type=float, default=300.0, help="no new shape after this")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    import torch

    from logitless_bench import lce, peers, timing
    from logitless_bench.shapes import CPU_SHAPES, MODEL_SHAPES, SHAPES

    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    pool = {s.name: s for s in (CPU_SHAPES + MODEL_SHAPES)}
    shapes = [pool[n] for n in args.shapes.split(",")] if args.shapes else (list(SHAPES) if cuda else list(CPU_SHAPES))
    names = args.methods.split(",")
    catalogue = {m.name: m for m in peers.lce_methods(["default", "logits"], cpu=not cuda, peers=True)}
    out = {"command": " ".join([sys.executable] + sys.argv), "date": datetime.datetime.utcnow().isoformat() + "Z",
           "device": torch.cuda.get_device_name() if cuda else platform.processor() or "cpu",
           "versions": {"torch": torch.__version__, "python": platform.python_version()},
           "timing": "interleaved rounds; per round each contender = median of --reps CUDA-event timed calls",
           "rounds": args.rounds, "reps": args.reps, "rows": []}
    try:
        import triton

        out["versions"]["triton"] = triton.__version__
    except ImportError:
        pass
    t0 = time.monotonic()
    for shape in shapes:
        if time.monotonic() - t0 > args.budget_s:
            out["cut_off"] = f"budget {args.budget_s} s reached before {shape.name}"
            break
        x, w, t = lce.make_inputs(shape, dev, 0)
        xg = x.detach().requires_grad_(True)
        wg = w.detach().requires_grad_(True)

        def setup():
            xg.grad = None
            wg.grad = None

        measures = {"gemm": lambda: timing.time_ms_spread(lambda: x @ w.T, device=dev, warmup=1, reps=args.reps)[0]}
        row = {"shape": shape.name, "tokens": shape.tokens, "hidden": shape.hidden, "vocab": shape.vocab,
               "errors": {}}
        for name in names:
            base, _, variant = name.partition("/")
            try:
                fn = catalogue[base].make(shape, dev)
            except Exception as exc:  # noqa: BLE001  (peers.Skip, a missing method)
                row["errors"][name] = f"{type(exc).__name__}: {exc}"
                continue
            if variant == "triton":
                fn = _without_cute(fn)

            def fb(fn=fn):
                def step():
                    fn(xg, wg, t).backward()
                return timing.time_ms_spread(step, device=dev, setup=setup, warmup=1, reps=args.reps)[0]

            def fwd(fn=fn):
                with torch.no_grad():
                    return timing.time_ms_spread(lambda: fn(x, w, t), device=dev, warmup=1, reps=args.reps)[0]

            measures[f"{name}:fb"] = fb
            measures[f"{name}:fwd"] = fwd
        res = interleave.interleaved(measures, rounds=args.rounds, baseline="gemm")
        row["rounds"] = res.pop("_rounds")
        row["ms"] = {k: rec.get("ms") for k, rec in res.items()}
        row["spread"] = {k: rec.get("spread") for k, rec in res.items()}
        row["errors"].update({k: rec["error"] for k, rec in res.items() if "error" in rec})
        samples = {k: rec.get("samples", []) for k, rec in res.items()}

        def per_round(a, b, scale=1.0):
            sa, sb = samples.get(a, []), samples.get(b, [])
            if not sa or len(sa) != len(sb):
                return None
            rs = [p / (scale * q) for p, q in zip(sa, sb)]
            return {"median": statistics.median(rs), "min": min(rs), "max": max(rs)}

        row["per_3gemm"] = {k.split(":")[0]: per_round(k, "gemm", 3.0) for k in samples if k.endswith(":fb")}
        row["fwd_per_gemm"] = {k.split(":")[0]: per_round(k, "gemm") for k in samples if k.endswith(":fwd")}
        if "logitless@logits" in names and "torch-compile" in names:
            row["logits_vs_compile_fb"] = per_round("logitless@logits:fb", "torch-compile:fb")
            row["logits_vs_compile_fwd"] = per_round("logitless@logits:fwd", "torch-compile:fwd")
        out["rows"].append(row)
        fmt = lambda r: "-" if not r else f"{r['median']:.3f} [{r['min']:.3f}, {r['max']:.3f}]"  # noqa: E731
        print(f"{shape.name} ({shape.tokens}, {shape.hidden}, {shape.vocab}): GEMM {row['ms']['gemm']:.3f} ms, "
              f"{row['rounds']} rounds", flush=True)
        for k, r in row["per_3gemm"].items():
            print(f"   {k:18s} f+b/3G {fmt(r)}   fwd/G {fmt(row['fwd_per_gemm'].get(k))}", flush=True)
        if "logits_vs_compile_fb" in row:
            print(f"   logits / compile:  f+b {fmt(row['logits_vs_compile_fb'])}   "
                  f"fwd {fmt(row['logits_vs_compile_fwd'])}", flush=True)
        if row["errors"]:
            print("   errors:", row["errors"], flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(out, f, indent=1)
        x = w = t = xg = wg = None  # noqa: F841  (freed before the next shape)
        timing.release_memory(dev)
    return 0


if __name__ == "__main__":
    sys.exit(main())
