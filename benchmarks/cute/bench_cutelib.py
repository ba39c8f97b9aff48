"""Forward-only timing of the library's CuTe DSL backend vs its Triton kernel vs cuBLAS.

    python benchmarks/cute/bench_cutelib.py [--json out.json] [--smoke]

Per shape N x H x V (bf16, under torch.no_grad): cuBLAS ``x @ W.T`` (bf16 logits: the
GEMM alone, the yardstick), ``linear_cross_entropy(x, W, t)`` (mean) and
``linear_log_probs(x, W, t, entropy=True, temperature=0.7)`` with the CuTe kernel
(``override(cute=True)``; a probe hook counts its launches, so a row that silently fell
back says so) and with the Triton kernel (``override(cute=False)``), median ms by
``triton.testing.do_bench``, and the CuTe result's max |difference| to Triton's. The
JSON has device, versions, date, command. ``--smoke`` (CPU): one tiny shape through
the Triton interpreter, the CuTe rows skipped: checks the harness only.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import time

SHAPES = [(4096, 4096, 128256), (8192, 7168, 128256), (16384, 4096, 128256), (2048, 2048, 128256),
          (4096, 2560, 262144), (1000, 4096, 32003)]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--rep", type=int, default=150, help="do_bench rep (ms)")
    args = ap.parse_args()
    import torch
    import triton

    import logitless
    from logitless.planning import cute as cute_planning
    from logitless.planning.overrides import override

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    shapes = [(64, 64, 1000)] if args.smoke or dev == "cpu" else SHAPES
    out = {"command": " ".join([sys.executable] + sys.argv), "date": datetime.datetime.utcnow().isoformat() + "Z",
           "device": torch.cuda.get_device_name() if dev == "cuda" else platform.processor() or "cpu",
           "versions": {"torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version()},
           "dsl_importable": cute_planning.dsl_importable(), "rows": []}
    try:
        import cutlass

        out["versions"]["nvidia-cutlass-dsl"] = getattr(cutlass, "__version__", "?")
    except Exception as exc:  # noqa: BLE001
        out["versions"]["nvidia-cutlass-dsl"] = f"missing ({type(exc).__name__})"

    def bench(fn):
        if dev == "cpu":
            t0 = time.perf_counter()
            fn()
            return (time.perf_counter() - t0) * 1e3
        return triton.testing.do_bench(fn, warmup=25, rep=args.rep)

    for n, h, v in shapes:
        row = {"n": n, "h": h, "v": v}
        try:
            g = torch.Generator(device=dev).manual_seed(0)
            x = torch.randn(n, h, device=dev, generator=g).to(torch.bfloat16)
            w = (torch.randn(v, h, device=dev, generator=g) * (2.0 / h ** 0.5)).to(torch.bfloat16)
            t = torch.randint(0, v, (n,), device=dev, generator=g)
            with torch.no_grad():
                if dev == "cuda":
                    row["cublas_ms"] = bench(lambda: x @ w.T)
                    row["cublas_tflops"] = 2 * n * h * v / row["cublas_ms"] / 1e9
                ops = {"ce": lambda: logitless.linear_cross_entropy(x, w, t),
                       "logp": lambda: logitless.linear_log_probs(x, w, t, entropy=True, temperature=0.7)}
                for name, fn in ops.items():
                    with override(cute=False):
                        ref = fn()
                        row[f"{name}_triton_ms"] = bench(fn)
                    if dev != "cuda":
                        continue
                    seen = []
                    try:
                        with override(cute=True, cute_probe=seen.append):
                            got = fn()
                            row[f"{name}_cute_took_cute"] = len(seen) > 0
                            row[f"{name}_cute_ms"] = bench(fn)
                        a = torch.cat([r.reshape(-1) for r in (got if isinstance(got, tuple) else (got,))])
                        b = torch.cat([r.reshape(-1) for r in (ref if isinstance(ref, tuple) else (ref,))])
                        row[f"{name}_cute_vs_triton_maxdiff"] = (a.float() - b.float()).abs().max().item()
                    except Exception as exc:  # noqa: BLE001
                        row[f"{name}_cute_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
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
    print(f"{'N x H x V':>20} {'cuBLAS ms':>9} | {'CE cute':>8} {'CE tri':>8} | {'LP cute':>8} {'LP tri':>8} "
          "| (x cuBLAS; * = fell back to Triton)")
    for r in out["rows"]:
        base = r.get("cublas_ms")

        def cell(key, took=None, base=base):
            val = r.get(key)
            if val is None:
                return f"{'-':>8}"
            flag = "*" if took is False else ""
            return f"{val / base:7.3f}{flag or 'x'}" if base else f"{val:7.1f}ms"

        print(f"{r['n']}x{r['h']}x{r['v']:>8} {base if base is not None else float('nan'):9.3f} | "
              f"{cell('ce_cute_ms', r.get('ce_cute_took_cute'))} {cell('ce_triton_ms')} | "
              f"{cell('logp_cute_ms', r.get('logp_cute_took_cute'))} {cell('logp_triton_ms')}"
              + (f"  ERROR {r['error'][:80]}" if "error" in r else "")
              + "".join(f"  {k}: {r[k][:80]}" for k in r if k.endswith("_cute_error")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
