"""Where a forward+backward's GPU time goes outside its kernels (idle gaps), one shape.

    python benchmarks/probe_gaps.py [--shape gemma3-4b] [--budget logits|default] [--compile]

Why: at the logits budget the interleaved f+b of logitless (``probe_lce_ab.py``) was up to
10% above torch.compile's at gemma3-4b while its kernels summed to 5% less (``probe_lce.py
--profile --compile``). This profiles one warm f+b with CPU and CUDA activities and prints the
GPU span (first kernel start to last kernel end) against the kernels' sum, the largest idle
gaps with the kernels around them, and the CUDA runtime calls slower than 0.2 ms (cudaMalloc,
cudaFree, synchronisations) with their durations.
"""

from __future__ import annotations

import argparse
import sys

import torch


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="gemma3-4b")
    ap.add_argument("--budget", default="logits")
    ap.add_argument("--compile", action="store_true")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA: nothing to profile")
        return 0
    import logitless
    from logitless_bench import lce
    from logitless_bench.peers import budget_bytes
    from logitless_bench.shapes import MODEL_SHAPES

    shape = {s.name: s for s in MODEL_SHAPES}[args.shape]
    dev = torch.device("cuda")
    x, w, t = lce.make_inputs(shape, dev, 0)
    x.requires_grad_(True)
    w.requires_grad_(True)
    if args.compile:
        fn = torch.compile(lambda x, w, t: torch.nn.functional.cross_entropy(x @ w.T, t), dynamic=False)
        label = "torch.compile"
    else:
        budget = budget_bytes(args.budget, shape.tokens, shape.vocab, 2)
        fn = lambda x, w, t: logitless.linear_cross_entropy(x, w, t, memory_budget=budget)  # noqa: E731
        label = f"logitless budget {args.budget}"
    for _ in range(3):
        x.grad = w.grad = None
        fn(x, w, t).backward()
    torch.cuda.synchronize()
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        x.grad = w.grad = None
        fn(x, w, t).backward()
        torch.cuda.synchronize()
    evs = prof.profiler.kineto_results.events()
    kern = sorted([(e.start_ns(), e.start_ns() + e.duration_ns(), e.name()) for e in evs
                   if e.device_type() == torch.autograd.DeviceType.CUDA and e.duration_ns() > 0],
                  key=lambda k: k[0])
    span = (kern[-1][1] - kern[0][0]) / 1e6
    busy = sum(b - a for a, b, _ in kern) / 1e6
    print(f"{shape.name} {label}: GPU span {span:.3f} ms, kernels {busy:.3f} ms, idle {span - busy:.3f} ms "
          f"({len(kern)} device events)")
    gaps = sorted(((kern[i + 1][0] - kern[i][1]) / 1e6, kern[i][2][:50], kern[i + 1][2][:50])
                  for i in range(len(kern) - 1))[::-1][:8]
    for g, a, b in gaps:
        if g > 0.02:
            print(f"   gap {g:.3f} ms after {a} before {b}")
    slow = [(e.duration_ns() / 1e6, e.name()) for e in evs
            if e.device_type() == torch.autograd.DeviceType.CPU and e.name().startswith("cuda")
            and e.duration_ns() > 200_000]
    for d, n in sorted(slow)[::-1][:12]:
        print(f"   host {n} {d:.3f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
