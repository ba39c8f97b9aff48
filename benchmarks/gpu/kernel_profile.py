"""Where a linear_cross_entropy call's time goes, against the compiled logits way: forward and
backward ms (CUDA events, synchronized before each call) and each kernel's CUDA time (torch
profiler, mean of three calls), bf16 inputs, default budget.

    python3 benchmarks/gpu/kernel_profile.py TOKENS HIDDEN VOCAB    # e.g. 4096 8192 128256

Evidence of benchmarks/results/lce-kernels-H100-2026-11-27.md."""

import sys

import torch
from torch.profiler import ProfilerActivity, profile

import logitless


def ours(x, w, t):
    return logitless.linear_cross_entropy(x, w, t)


def plain(x, w, t):
    return torch.nn.functional.cross_entropy((x @ w.T).float(), t)


def main(n: int, h: int, v: int) -> None:
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(n, h, device=dev, dtype=torch.bfloat16, generator=g).requires_grad_()
    w = (torch.randn(v, h, device=dev, dtype=torch.bfloat16, generator=g) * h**-0.5).requires_grad_()
    t = torch.randint(0, v, (n,), device=dev, generator=g)
    for name, f in (("ours", ours), ("plain-compile", torch.compile(plain, dynamic=False))):
        def fb():
            x.grad = w.grad = None
            s0, s1, s2 = (torch.cuda.Event(enable_timing=True) for _ in range(3))
            s0.record()
            loss = f(x, w, t)
            s1.record()
            loss.backward()
            s2.record()
            return s0, s1, s2

        for _ in range(3):
            fb()
        torch.cuda.synchronize()
        fw, bw = [], []
        for _ in range(10):
            a, b, c = fb()
            torch.cuda.synchronize()
            fw.append(a.elapsed_time(b))
            bw.append(b.elapsed_time(c))
        print(f"TIME {name}: fwd {sorted(fw)[5]:.2f} bwd {sorted(bw)[5]:.2f} ms", flush=True)
        with profile(activities=[ProfilerActivity.CUDA]) as p:
            for _ in range(3):
                fb()
            torch.cuda.synchronize()
        rows = []
        for e in p.key_averages():
            total = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
            if total > 0:
                rows.append((total / 3 / 1e3, e.count // 3, e.key[:110]))
        for ms, count, key in sorted(rows, reverse=True)[:10]:
            print(f"  K {name}: {ms:7.3f} ms x{count} {key}")


if __name__ == "__main__":
    main(*map(int, sys.argv[1:4]))
