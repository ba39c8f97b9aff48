"""Training-loop sanity check: eager vs torch.compile around a model calling logitless.

A small causal LM (embedding, 2 MLP blocks, norm, LM head) with fp32 parameters under
autocast bf16, the way training scripts run: the step time (forward + backward) and
peak memory of

    eager      linear_cross_entropy(h, head.weight, labels, shift=True), no casts
    compiled   the same model under torch.compile(fullgraph=True)
    torch      F.cross_entropy(head(h).float()...) under autocast (logits materialised)

Usage: PYTHONPATH=src python benchmarks/loop_compile.py [--tokens 8192 --hidden 2048
--vocab 128256 --steps 10] [--out benchmarks/results]. Prints a table; writes JSON.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import sys
import time

import torch
import torch.nn.functional as F

import logitless


class LM(torch.nn.Module):
    def __init__(self, vocab, hidden, loss):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, hidden)
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(hidden, 2 * hidden), torch.nn.GELU(),
                                torch.nn.Linear(2 * hidden, hidden)) for _ in range(2))
        self.norm = torch.nn.RMSNorm(hidden)
        self.head = torch.nn.Linear(hidden, vocab, bias=False)
        self.loss = loss

    def forward(self, ids, labels):
        h = self.emb(ids)
        for block in self.blocks:
            h = h + block(h)
        h = self.norm(h)  # fp32 under autocast, as a Llama's final norm
        if self.loss == "logitless":
            return logitless.linear_cross_entropy(h, self.head.weight, labels, shift=True)
        logits = self.head(h).float()
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())


def step_time(fn, ids, labels, params, steps):
    """Median ms of forward + backward, and the peak memory (GiB) over the timed steps."""
    for _ in range(3):  # warm-up (and compilation)
        for p in params:
            p.grad = None
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = fn(ids, labels)
        loss.backward()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(steps):
        for p in params:
            p.grad = None
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = fn(ids, labels)
        loss.backward()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2], torch.cuda.max_memory_allocated() / 2**30, float(loss.detach())


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("needs CUDA")
    seq = 2048
    batch = max(1, args.tokens // seq)
    torch.manual_seed(0)
    ids = torch.randint(0, args.vocab, (batch, seq), device="cuda")
    rows = []
    for name in ("eager", "compiled", "torch"):
        model = LM(args.vocab, args.hidden, "torch" if name == "torch" else "logitless").cuda()
        fn = torch.compile(model, fullgraph=True) if name == "compiled" else model
        t0 = time.time()
        try:
            ms, gib, loss = step_time(fn, ids, ids, list(model.parameters()), args.steps)
            rows.append(dict(name=name, ms=ms, peak_gib=gib, loss=loss, wall_s=time.time() - t0))
        except Exception as e:  # one failing row must not lose the others
            rows.append(dict(name=name, error=f"{type(e).__name__}: {str(e)[:300]}"))
        del model, fn
        torch.cuda.empty_cache()
    ok = {r["name"]: r for r in rows if "ms" in r}
    if "eager" in ok and "compiled" in ok:
        ratio = ok["compiled"]["ms"] / ok["eager"]["ms"]
        verdict = "compiled not slower than eager" if ratio <= 1.05 else "compiled SLOWER than eager"
    else:
        ratio, verdict = None, "incomplete"
    result = dict(
        suite="loop-compile", device=torch.cuda.get_device_name(), torch=torch.__version__,
        python=platform.python_version(), date=datetime.datetime.now(datetime.timezone.utc).isoformat(),
        command=" ".join([os.path.basename(sys.argv[0])] + (argv or sys.argv[1:])),
        shape=dict(tokens=batch * seq, hidden=args.hidden, vocab=args.vocab), rows=rows,
        compiled_over_eager=ratio, verdict=verdict,
    )
    os.makedirs(args.out, exist_ok=True)
    found = re.search(r"\b[A-Z]\d{2,4}\b", torch.cuda.get_device_name())  # "H100", "A100"
    dev = found.group(0) if found else "gpu"
    path = os.path.join(args.out, f"loop-compile-{dev}-{datetime.date.today()}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"\nfp32 params + autocast bf16, {batch * seq} tokens, H={args.hidden}, V={args.vocab}")
    print(f"{'step':<10}{'ms':>10}{'peak GiB':>10}{'loss':>10}")
    for r in rows:
        if "ms" in r:
            print(f"{r['name']:<10}{r['ms']:>10.1f}{r['peak_gib']:>10.2f}{r['loss']:>10.4f}")
        else:
            print(f"{r['name']:<10} {r['error']}")
    print(f"compiled / eager = {ratio if ratio is None else round(ratio, 3)}: {verdict}")
    print(f"wrote {path}")
    return result


if __name__ == "__main__":
    main()
