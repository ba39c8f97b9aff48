"""Eager against compiled (the custom ops) calls of the ops that keep logit columns for their
backward: peak memory beyond inputs and the returned gradients, and forward + backward ms
(median of 8, CUDA events), bf16, default budget. One JSON line per (case, mode) on stdout and
in $OUT/compiled-memory-TAG.jsonl.

    python3 benchmarks/gpu/compiled_memory.py TAG [OP:TOKENS:HIDDEN:VOCAB ...]   # OP: lce, llp, topk

Default cases: the shapes where the custom ops' plan keeps fewer columns than the eager one
(``planning.plans.triton_plan``'s ``kept_owned``). Evidence of
benchmarks/results/compiled-kept-owned-H100-2026-11-28.md."""

import json
import os
import sys

import torch

import logitless

DEFAULT = ("lce:8192:4096:151936", "lce:8192:896:151936", "llp:8192:4096:151936", "topk:8192:4096:151936")
K = 20  # the teacher's ids per token (topk)


def loss_fn(op, ids, teacher):
    if op == "lce":
        return lambda x, w, t: logitless.linear_cross_entropy(x, w, t)
    if op == "llp":
        def llp(x, w, t):
            logp, entropy = logitless.linear_log_probs(x, w, t, entropy=True)
            return logp.sum() * 1e-3 + entropy.sum() * 1e-4
        return llp
    if op == "topk":
        return lambda x, w, t: logitless.linear_topk_kl(x, w, ids, teacher, t)
    raise SystemExit(f"unknown op {op!r}: lce, llp or topk")


def measure(op: str, n: int, h: int, v: int, tag: str) -> list:
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    x = (torch.randn(n, h, device=dev, generator=g) * 0.5).to(torch.bfloat16).requires_grad_()
    w = (torch.randn(v, h, device=dev, generator=g) * 0.02).to(torch.bfloat16).requires_grad_()
    t = torch.randint(0, v, (n,), device=dev, generator=g)
    ids = torch.arange(K, device=dev)[None, :] * (v // K) + t[:, None] % (v // K)  # ascending, distinct
    teacher = torch.log_softmax(torch.randn(n, K, device=dev, generator=g), -1)
    budget = int(0.03 * torch.cuda.get_device_properties(0).total_memory)
    rows = []
    for mode in ("eager", "compiled"):
        f = loss_fn(op, ids, teacher)
        if mode == "compiled":
            torch._dynamo.reset()
            f = torch.compile(f, dynamic=False)
        for _ in range(3):
            torch.autograd.grad(f(x, w, t), (x, w))
        torch.cuda.synchronize()
        times, peaks = [], []
        for _ in range(8):
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            loss = f(x, w, t)
            gx, gw = torch.autograd.grad(loss, (x, w))
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
            peaks.append(torch.cuda.max_memory_allocated() - before - (gx.numel() + gw.numel()) * gx.element_size())
            value = float(loss.detach())
            del loss, gx, gw
        rows.append(dict(tag=tag, op=op, shape=[n, h, v], mode=mode, ms=sorted(times)[len(times) // 2],
                         peak_mib=max(peaks) / 2**20, budget_mib=budget / 2**20, loss=value,
                         device=torch.cuda.get_device_name(), torch=torch.__version__))
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main(tag: str, cases) -> None:
    rows = []
    for case in cases:
        op, n, h, v = case.split(":")
        rows += measure(op, int(n), int(h), int(v), tag)
    with open(os.path.join(os.environ.get("OUT", "."), f"compiled-memory-{tag}.jsonl"), "w") as fh:
        fh.write("\n".join(json.dumps(r) for r in rows) + "\n")


if __name__ == "__main__":
    if len(sys.argv) < 2:
        raise SystemExit(__doc__)
    main(sys.argv[1], sys.argv[2:] or DEFAULT)
