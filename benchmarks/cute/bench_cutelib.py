"""Forward-only timing of the library's CuTe DSL backend vs its Triton kernel vs cuBLAS.

    python benchmarks/cute/bench_cutelib.py [--json out.json] [--shapes anchors|models|NxHxV,...]
                                            [--rounds 5] [--no-logp] [--smoke]

Per shape N x H x V (bf16, under torch.no_grad): cuBLAS ``x @ W.T`` (bf16 logits: the
GEMM alone, the yardstick), ``linear_cross_entropy(x, W, t)`` (mean) and
``linear_log_probs(x, W, t, entropy=True, temperature=0.7)`` with the CuTe kernel
(``override(cute=True)``; a probe hook counts its launches, so a row that silently fell
back says so) and with the Triton kernel (``override(cute=False)``). Timed **interleaved**
(``interleave.interleaved``: every candidate once per round, the order rotated, ``--rounds``
rounds, each a ``do_bench`` median with L2 flushed): a ratio is the median over rounds of
candidate / cuBLAS of the same round, so clock drift between rows does not enter it. Also
the CuTe result's max |difference| to Triton's. Shapes: ``anchors`` (the six of ANCHORS.md
plus 2048 x 2048 and a ragged 1000 x 4096 x 32003), ``models`` (the 26 of the models suite),
or an explicit list. The JSON has device, versions, date, command, and per row the ratios
with their min/max over rounds. ``--smoke`` (CPU): one tiny shape through the Triton
interpreter, the CuTe rows skipped: checks the harness only.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import interleave  # noqa: E402

ANCHORS = [(4096, 4096, 128256), (8192, 7168, 128256), (16384, 4096, 128256), (2048, 2048, 128256),
           (4096, 2560, 262144), (4096, 4096, 151936), (4096, 2880, 201088), (1000, 4096, 32003)]


def shape_list(spec: str):
    if spec == "anchors":
        return ANCHORS
    if spec == "models":
        from logitless.ops.linear_cross_entropy.bench_shapes import MODEL_SHAPES

        seen, out = set(), []
        for s in MODEL_SHAPES:
            key = (s.tokens, s.hidden, s.vocab)
            if key not in seen:
                seen.add(key)
                out.append(key)
        return out
    return [tuple(int(d) for d in item.lower().split("x")) for item in spec.split(",") if item]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--shapes", default="anchors", help="anchors | models | NxHxV,NxHxV,...")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--rep", type=int, default=40, help="do_bench rep (ms) per round")
    ap.add_argument("--no-logp", action="store_true", help="cross-entropy rows only")
    ap.add_argument("--max-seconds", type=float, default=None, help="stop starting new shapes after this")
    args = ap.parse_args()
    import torch
    import triton

    import logitless
    from logitless.planning import cute as cute_planning
    from logitless.planning.overrides import override

    t_start = time.monotonic()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    shapes = [(64, 64, 1000)] if args.smoke or dev == "cpu" else shape_list(args.shapes)
    out = {"command": " ".join([sys.executable] + sys.argv), "date": datetime.datetime.utcnow().isoformat() + "Z",
           "device": torch.cuda.get_device_name() if dev == "cuda" else platform.processor() or "cpu",
           "versions": {"torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version()},
           "dsl_importable": cute_planning.dsl_importable(), "timing": "interleaved rounds (interleave.py)",
           "rounds": args.rounds, "rows": []}
    out["versions"]["nvidia-cutlass-dsl"] = cute_planning.dsl_version() or "missing"
    out["dsl_problem"] = cute_planning.dsl_problem()
    bench = interleave.gpu_bench(rep=args.rep) if dev == "cuda" else interleave.cpu_bench(reps=2)

    for n, h, v in shapes:
        if args.max_seconds is not None and time.monotonic() - t_start > args.max_seconds:
            out["cut_off"] = f"stopped after {args.max_seconds} s before {n}x{h}x{v}"
            break
        row = {"n": n, "h": h, "v": v}
        try:
            g = torch.Generator(device=dev).manual_seed(0)
            x = torch.randn(n, h, device=dev, generator=g).to(torch.bfloat16)
            w = (torch.randn(v, h, device=dev, generator=g) * (2.0 / h ** 0.5)).to(torch.bfloat16)
            t = torch.randint(0, v, (n,), device=dev, generator=g)
            ops = {"ce": lambda: logitless.linear_cross_entropy(x, w, t)}
            if not args.no_logp:
                ops["logp"] = lambda: logitless.linear_log_probs(x, w, t, entropy=True, temperature=0.7)
            measures = {}
            with torch.no_grad():
                if dev == "cuda":
                    measures["cublas"] = lambda: bench(lambda: x @ w.T)
                for name, fn in ops.items():
                    with override(cute=False):
                        ref = fn()

                    def triton_ms(fn=fn):
                        with override(cute=False):
                            return bench(fn)

                    measures[f"{name}_triton"] = triton_ms
                    if dev != "cuda":
                        continue
                    seen = []
                    try:
                        with override(cute=True, cute_probe=seen.append):
                            got = fn()
                        row[f"{name}_cute_took_cute"] = len(seen) > 0
                        a = torch.cat([r.reshape(-1) for r in (got if isinstance(got, tuple) else (got,))])
                        b = torch.cat([r.reshape(-1) for r in (ref if isinstance(ref, tuple) else (ref,))])
                        row[f"{name}_cute_vs_triton_maxdiff"] = (a.float() - b.float()).abs().max().item()

                        def cute_ms(fn=fn):
                            with override(cute=True):
                                return bench(fn)

                        measures[f"{name}_cute"] = cute_ms
                    except Exception as exc:  # noqa: BLE001
                        row[f"{name}_cute_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
                res = interleave.interleaved(measures, rounds=args.rounds,
                                             baseline="cublas" if dev == "cuda" else None)
            row["rounds"] = res.pop("_rounds")
            for k, rec in res.items():
                row[f"{k}_ms"] = rec.get("ms")
                row[f"{k}_spread"] = rec.get("spread")
                for key in ("ratio", "ratio_min", "ratio_max", "error"):
                    if key in rec:
                        row[f"{k}_{key}"] = rec[key]
            if row.get("cublas_ms"):
                row["cublas_tflops"] = 2 * n * h * v / row["cublas_ms"] / 1e9
            x = w = t = ref = None  # free before the next shape
        except Exception as exc:  # noqa: BLE001
            row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        if dev == "cuda":
            torch.cuda.empty_cache()
        out["rows"].append(row)
        print(json.dumps(row), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(out, f, indent=1)

    print()
    print(f"{'N x H x V':>20} {'cuBLAS ms':>9} {'TF/s':>5} | {'CE cute':>8} {'CE tri':>8} | {'LP cute':>8} "
          f"{'LP tri':>8} | (x cuBLAS, median of per-round ratios; * = fell back to Triton)")
    for r in out["rows"]:
        def cell(key, took=None, r=r):
            val = r.get(f"{key}_ratio")
            if val is None:
                ms = r.get(f"{key}_ms")
                return f"{ms:6.2f}ms" if ms is not None else f"{'-':>8}"
            return f"{val:7.3f}{'*' if took is False else 'x'}"

        print(f"{r['n']}x{r['h']}x{r['v']:>8} {r.get('cublas_ms') or float('nan'):9.3f} "
              f"{r.get('cublas_tflops') or 0:5.0f} | "
              f"{cell('ce_cute', r.get('ce_cute_took_cute'))} {cell('ce_triton')} | "
              f"{cell('logp_cute', r.get('logp_cute_took_cute'))} {cell('logp_triton')}"
              + (f"  ERROR {r['error'][:80]}" if "error" in r else "")
              + "".join(f"  {k}: {r[k][:80]}" for k in r if k.endswith("_cute_error")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
