"""linear_cross_entropy under autocast bf16 with an fp32 head weight (HF Trainer's bf16=True,
fp32 master weights): forward+backward time (median of CUDA-event timings) and peak memory
beyond the inputs and the gradients, at the default memory budget; one JSON line per shape.

Run once per tree on the same GPU, in one call, to compare (e.g. before and after a change):

  PYTHONPATH=OLD/src python benchmarks/gpu/master_weight.py --tag before > before.jsonl
  PYTHONPATH=src     python benchmarks/gpu/master_weight.py --tag after  > after.jsonl

Each line: tag, shape, time_ms, three_gemms_ms (three cuBLAS bf16 GEMMs of the shape in the
same process: the floor), ratio, peak_extra_mib, the weight gradient's dtype.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

import logitless

SHAPES = {
    "llama3.1-8b": (4096, 4096, 128256),
    "llama3.1-8b-16k": (16384, 4096, 128256),
    "qwen3-8b": (4096, 4096, 151936),
    "deepseek-v3": (8192, 7168, 128256),
    "llama3.1-8b-2k": (2048, 4096, 128256),
}


def timed(fn, reps: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tag", required=True)
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--reps", type=int, default=10)
    args = p.parse_args()
    dev = torch.device("cuda")
    for name in args.shapes.split(","):
        n, h, v = SHAPES[name]
        g = torch.Generator(device=dev).manual_seed(0)
        x = torch.randn(n, h, device=dev, generator=g, dtype=torch.bfloat16).requires_grad_()
        w = (torch.randn(v, h, device=dev, generator=g) * h ** -0.5).requires_grad_()  # fp32 master
        t = torch.randint(0, v, (n,), device=dev, generator=g)

        def step():
            x.grad = w.grad = None
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = logitless.linear_cross_entropy(x, w, t)
            loss.backward()
            return loss

        loss = step()
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()  # inputs and the gradients of the last step
        torch.cuda.reset_peak_memory_stats()
        ms = timed(step, args.reps)
        peak = torch.cuda.max_memory_allocated() - base
        xb, wb = x.detach(), w.detach().bfloat16()
        dz = torch.randn(n, v, device=dev, dtype=torch.bfloat16)

        def gemms():
            torch.mm(xb, wb.T)
            torch.mm(dz, wb)
            torch.mm(dz.T, xb)

        floor = timed(gemms, args.reps)
        del dz
        print(json.dumps(dict(tag=args.tag, shape=name, tokens=n, hidden=h, vocab=v, time_ms=round(ms, 3),
                              three_gemms_ms=round(floor, 3), ratio=round(ms / floor, 4),
                              peak_extra_mib=round(peak / 2**20), loss=float(loss),
                              dw_dtype=str(w.grad.dtype), device=torch.cuda.get_device_name())), flush=True)
        del x, w, t, xb, wb
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
