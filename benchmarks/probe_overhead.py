"""Host overhead of linear_cross_entropy at small shapes, and CUDA-graph capture.

For each shape: forward+backward timed back to back (what the benchmark reports), the
host (Python) time per call, the sum of the GPU kernels' times (torch.profiler), and
the same step captured in a CUDA graph and replayed (no host work per step: the GPU
time a training loop sees when the host runs ahead). Also checks that the graph's
loss and gradients equal eager's.

What the columns are: "eager" is ``triton.testing.do_bench``'s median of CUDA-event spans,
each after a 256 MB L2 flush (host-bound calls: the host's time per call minus the ~0.09
ms flush the GPU runs meanwhile); "host" is the *mean* wall time of 50 back-to-back calls
(no sync at the end); both are one measurement each. Do not compare them across processes
(e.g. LOGITLESS_FAST_LAUNCH=0 in another run): ``benchmarks/probe_launch_ab.py`` is the
in-process, interleaved A/B of the launch path (docs/host_jsd.md).

    python benchmarks/probe_overhead.py --out $OUT
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time

import torch
import triton
from triton.testing import do_bench

import logitless

SHAPES = {
    "llama2-7b-512": (512, 4096, 32000),
    "llama3.1-8b-512": (512, 4096, 128256),
    "gpt2-1k": (1024, 768, 50257),
    "llama3.1-8b": (4096, 4096, 128256),
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--shapes", help="TOKENS:HIDDEN:VOCAB[,...] instead of the default shapes")
    args = ap.parse_args()
    shapes = SHAPES
    if args.shapes:
        shapes = {f"{n}x{h}x{v}": (n, h, v) for n, h, v in
                  (tuple(int(d) for d in s.split(":")) for s in args.shapes.split(","))}
    dev = torch.device("cuda")
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                python=platform.python_version(), date=time.strftime("%Y-%m-%dT%H:%M:%S"),
                command=" ".join(sys.argv))
    print(meta, flush=True)
    rows = []
    for name, (n, h, v) in shapes.items():
        x = torch.randn(n, h, device=dev, dtype=torch.bfloat16, requires_grad=True)
        w = (torch.randn(v, h, device=dev) * h**-0.5).to(torch.bfloat16).requires_grad_(True)
        t = torch.randint(0, v, (n,), device=dev)
        gemm = do_bench(lambda: x.detach() @ w.detach().T, warmup=10, rep=100, return_mode="median")  # noqa: F821 (deleted below, after use)

        def step():
            x.grad = w.grad = None  # noqa: F821 (deleted below, after use)
            logitless.linear_cross_entropy(x, w, t).backward()  # noqa: F821 (deleted below, after use)

        eager = do_bench(step, warmup=10, rep=200, return_mode="median")
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(50):
            step()
        host = (time.perf_counter() - t0) / 50 * 1e3
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
        kernels = sum(e.device_time for e in prof.key_averages()) / 1e3  # us -> ms
        nkern = sum(e.count for e in prof.key_averages())
        rec = dict(shape=name, n=n, h=h, v=v, gemm_ms=gemm, eager_ms=eager, host_ms=host,
                   kernel_sum_ms=kernels, kernel_launches=nkern)
        # CUDA graph of one forward+backward (static inputs; grads written in the graph).
        try:
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                for _ in range(3):
                    step()
            torch.cuda.current_stream().wait_stream(s)
            g = torch.cuda.CUDAGraph()
            x.grad = w.grad = None
            with torch.cuda.graph(g):
                loss = logitless.linear_cross_entropy(x, w, t)
                loss.backward()
            g.replay()
            torch.cuda.synchronize()
            gl, gdx, gdw = loss.clone(), x.grad.clone(), w.grad.clone()
            x.grad = w.grad = None
            el = logitless.linear_cross_entropy(x, w, t)
            el.backward()
            same = bool(torch.equal(gl, el) and torch.equal(gdx, x.grad) and torch.equal(gdw, w.grad))
            graph = do_bench(g.replay, warmup=10, rep=200, return_mode="median")
            rec.update(graph_ms=graph, graph_same_as_eager=same)
            del g
        except Exception as e:  # noqa: BLE001  (report, do not hide)
            rec.update(graph_ms=None, graph_error=f"{type(e).__name__}: {str(e)[:300]}")
        rows.append(rec)
        gtxt = (f"graph {rec['graph_ms']:.3f} ms ({rec['graph_ms'] / (3 * gemm):.2f}x 3G) "
                f"same={rec['graph_same_as_eager']}"
                if rec.get("graph_ms") else f"graph FAILED: {rec.get('graph_error')}")
        print(f"{name:16} 3 GEMMs {3 * gemm:.3f} ms | eager {eager:.3f} ms ({eager / (3 * gemm):.2f}x) | host "
              f"{host:.3f} ms/call | kernels {kernels:.3f} ms in {nkern} launches ({kernels / (3 * gemm):.2f}x) "
              f"| {gtxt}",
              flush=True)
        del x, w, t
        torch.cuda.empty_cache()
    tag = "H200" if "H200" in meta["device"] else "H100"
    with open(f"{args.out}/probe-overhead-{tag}.json", "w") as f:
        json.dump(dict(meta, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
