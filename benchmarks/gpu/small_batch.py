"""Small batches on a GPU (RL and SFT micro-batches): linear_cross_entropy at 512-2048 tokens
against cuBLAS and torch.compile, and whether the CuTe forward ran.

    python benchmarks/gpu/small_batch.py --json OUT.json [--tokens 512,1024,2048]

Per token count (bf16, H 4096, V 128256, mean reduction, the default memory budget):
- ``gemm``: one cuBLAS ``x @ W.T``; ``gemm3``: the three GEMMs of a forward + backward;
- ``fwd``: ``linear_cross_entropy`` under no_grad, ``fwd_grad``: its forward when x and W
  require grad (what a training step runs first), ``fb``: forward + backward;
- ``compile_fwd`` / ``compile_fb``: ``torch.compile`` of ``F.cross_entropy(x @ W.T, t)``;
- ``took_cute_*``: whether the CuTe kernel launched (the planner's probe hook), and the
  ``CuteFallbackWarning`` raised, if any (the DSL's absence or problem);
- ``host_fwd_ms``: the host's time per forward call, 20 calls back to back (the Python
  overhead, where it exceeds the GPU's time);
- ``--triton-too``: ``triton_*``, the same rows under ``override(cute=False)``.
Times (milliseconds): median of CUDA-event timings of single calls after warm-ups, each
call synchronised (the host's launch latency counts, as for a call alone); ``pipe_*``: per
call of 20 back to back with no sync (the host runs ahead, as in a training step).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import time
import warnings


def _median_ms(fn, warmup: int = 5, reps: int = 25) -> float:
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def _pipelined_ms(fn, warmup: int = 3, calls: int = 20, rounds: int = 5) -> float:
    """Milliseconds per call of ``calls`` calls back to back with no sync between them (the
    host runs ahead of the GPU as in a training step, so its time hides where it is the
    smaller); the median over ``rounds``."""
    import torch

    for _ in range(warmup):
        fn()
    out = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(calls):
            fn()
        b.record()
        torch.cuda.synchronize()
        out.append(a.elapsed_time(b) / calls)
    return statistics.median(out)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", required=True)
    ap.add_argument("--tokens", default="512,1024,2048")
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--triton-too", action="store_true",
                    help="also time each logitless row under override(cute=False) (the Triton forward), same process")
    args = ap.parse_args()
    import torch
    import torch.nn.functional as F
    import triton

    import logitless
    from logitless.planning import cute
    from logitless.planning.overrides import override, what_if

    warnings.simplefilter("always", cute.CuteFallbackWarning)
    out = {"command": " ".join([sys.executable] + sys.argv),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "device": torch.cuda.get_device_name(),
           "versions": {"torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
                        "nvidia-cutlass-dsl": cute.dsl_version(), "logitless": logitless.__version__},
           "dsl_problem": cute.dsl_problem(), "rows": []}
    print(json.dumps({k: v for k, v in out.items() if k != "rows"}), flush=True)
    h, v = args.hidden, args.vocab
    for n in (int(s) for s in args.tokens.split(",")):
        torch.compiler.reset()  # one compiled function per shape (dynamo's recompile limit is 8)
        compiled = torch.compile(lambda x, w, t: F.cross_entropy((x @ w.T).float(), t), dynamic=False)
        g = torch.Generator(device="cuda").manual_seed(n)
        x = torch.randn(n, h, device="cuda", generator=g).to(torch.bfloat16).requires_grad_()
        w = (torch.randn(v, h, device="cuda", generator=g) / h ** 0.5).to(torch.bfloat16).requires_grad_()
        t = torch.randint(0, v, (n,), device="cuda", generator=g)
        dl = torch.randn(n, v, device="cuda", generator=g).to(torch.bfloat16)
        row = {"n": n, "h": h, "v": v, "dtype": "bfloat16"}
        with torch.no_grad():
            row["gemm"] = _median_ms(lambda: x @ w.T)
            row["gemm3"] = _median_ms(lambda: (x @ w.T, dl @ w, dl.T @ x))
        del dl
        with warnings.catch_warnings(record=True) as rec:
            warnings.simplefilter("always", cute.CuteFallbackWarning)
            for label, run, grad in (
                ("fwd", lambda: logitless.linear_cross_entropy(x, w, t), False),
                ("fwd_grad", lambda: logitless.linear_cross_entropy(x, w, t), True),
                ("fb", lambda: torch.autograd.grad(logitless.linear_cross_entropy(x, w, t), (x, w)), True),
            ):
                seen = []
                with torch.set_grad_enabled(grad), what_if(cute_probe=seen.append):
                    run()
                    row[label] = _median_ms(run)
                    if label != "fwd_grad":
                        row[f"pipe_{label}"] = _pipelined_ms(run)
                    if label == "fwd":
                        torch.cuda.synchronize()
                        s = time.perf_counter()
                        for _ in range(20):
                            run()
                        row["host_fwd_ms"] = (time.perf_counter() - s) / 20 * 1e3
                        torch.cuda.synchronize()
                row[f"took_cute_{label}"] = len(seen) > 0
                if seen:
                    row[f"cute_{label}"] = {k: seen[0][k] for k in seen[0] if isinstance(seen[0][k], (int, bool, str))}
            row["warnings"] = sorted({str(r.message)[:200] for r in rec})
        if args.triton_too:
            with override(cute=False):
                with torch.no_grad():
                    row["triton_fwd"] = _median_ms(lambda: logitless.linear_cross_entropy(x, w, t))
                row["triton_fwd_grad"] = _median_ms(lambda: logitless.linear_cross_entropy(x, w, t))
                tfb = lambda: torch.autograd.grad(logitless.linear_cross_entropy(x, w, t), (x, w))  # noqa: E731
                row["triton_fb"] = _median_ms(tfb)
                row["pipe_triton_fb"] = _pipelined_ms(tfb)
                with torch.no_grad():
                    row["pipe_triton_fwd"] = _pipelined_ms(lambda: logitless.linear_cross_entropy(x, w, t))
                with torch.no_grad():
                    torch.cuda.synchronize()
                    s = time.perf_counter()
                    for _ in range(20):
                        logitless.linear_cross_entropy(x, w, t)
                    row["triton_host_fwd_ms"] = (time.perf_counter() - s) / 20 * 1e3
                    torch.cuda.synchronize()
        with torch.no_grad():
            row["compile_fwd"] = _median_ms(lambda: compiled(x, w, t))
        row["compile_fb"] = _median_ms(lambda: torch.autograd.grad(compiled(x, w, t), (x, w)))
        row["pipe_compile_fb"] = _pipelined_ms(lambda: torch.autograd.grad(compiled(x, w, t), (x, w)))
        with torch.no_grad():
            row["pipe_compile_fwd"] = _pipelined_ms(lambda: compiled(x, w, t))
            row["pipe_gemm"] = _pipelined_ms(lambda: x @ w.T)
        row["ratios"] = {"fwd/gemm": row["fwd"] / row["gemm"], "fwd_grad/gemm": row["fwd_grad"] / row["gemm"],
                         "fb/gemm3": row["fb"] / row["gemm3"], "compile_fwd/gemm": row["compile_fwd"] / row["gemm"],
                         "compile_fb/gemm3": row["compile_fb"] / row["gemm3"], "fb/compile_fb": row["fb"] / row["compile_fb"]}
        out["rows"].append(row)
        print(json.dumps(row), flush=True)
        x = w = t = None
        torch.cuda.empty_cache()
    with open(args.json, "w") as f:
        json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
