"""Suite ``topk``: top-k distillation (``logitless.linear_topk_kl``, issue 64) against the
logits way.

Per shape (``logitless_bench/shapes.py``: bf16, 8k tokens, K = 20 and 100): x ~ N(0, 1),
W ~ N(0, 1/H); the teacher's top-K ids and log-probs from teacher logits correlated with
the student's (1.5 z + N(0, 1), computed untimed in chunks); the unit (one cuBLAS
``x @ W.T``); the float64 reference (chunked on the device). Then per method: forward time
(no_grad) / 1 GEMM, forward+backward of the mean loss / 3 GEMMs, peak extra memory, the
loss' relative error against float64.

Methods: logitless (forward KL, tail bucket, default budget), its reverse / renormalize /
truncated ("none", verl's) forms, and the logits way -- ``x @ W.T`` in bf16,
``log_softmax`` in fp32, gather at the ids, the same KL with the tail bin from 1 - sum of
the gathered probabilities (clamped at 1e-10, as verl's RFC) -- eager and under
torch.compile. ``python -m logitless_bench --suite topk`` (options of cli.py); without a
GPU one tiny case runs on the CPU, loudly labelled.
"""

from __future__ import annotations

import time

import torch

from . import report, timing
from .runner import describe, fill_row, run_shapes, select

METRICS = """\
Metrics (topk): x (N,H) ~N(0,1), W (V,H) ~N(0,1/H) in the shape's dtype; the teacher's top-K ids and
log-probs from logits 1.5 z + N(0,1) (z the student's); the loss is the mean over tokens.
- **fwd/GEMM**: median forward time under no_grad / one cuBLAS x @ W.T of the same shape.
- **f+b/3GEMM**: median time of forward + backward (x and W require grad; grads set to None untimed before
  each call) / three such GEMMs. CUDA events, L2 flushed.
- **peak extra MiB**: max_memory_allocated during one more forward+backward minus memory before it minus the
  dx and dW bytes.
- **rel err**: |loss - float64| / |float64| of the method's own KL (the reverse / renormalize / none rows
  against their own float64 reference)."""


# --------------------------------------------------------------------------- inputs and reference


def make_inputs(shape, device, seed: int):
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    dtype = getattr(torch, shape.dtype)
    x = torch.randn(shape.tokens, shape.hidden, generator=g, device=device, dtype=torch.float32).to(dtype)
    w = (torch.randn(shape.vocab, shape.hidden, generator=g, device=device, dtype=torch.float32)
         * shape.hidden**-0.5).to(dtype)
    ids = torch.empty(shape.tokens, shape.k, dtype=torch.int64, device=device)
    lp = torch.empty(shape.tokens, shape.k, dtype=torch.float32, device=device)
    for n0 in range(0, shape.tokens, 1024):
        z = (x[n0:n0 + 1024] @ w.T).float() * 1.5
        z += torch.randn(z.shape, generator=g, device=device)
        lp[n0:n0 + 1024], ids[n0:n0 + 1024] = torch.log_softmax(z, -1).topk(shape.k, -1)
        del z
    return x, w, ids, lp


def reference(x, w, ids, lp, chunk: int = 512, **kw) -> float:
    """The mean loss in float64, ``chunk`` tokens at a time."""
    from logitless.ops.linear_topk_kl.reference import linear_topk_kl_reference

    total = 0.0
    for n0 in range(0, x.shape[0], chunk):
        s = slice(n0, n0 + chunk)
        total += linear_topk_kl_reference(x[s], w, ids[s], lp[s], reduction="sum", **kw).item()
    return total / x.shape[0]


# --------------------------------------------------------------------------- methods


def logits_way(x, w, ids, lp):
    """Forward KL over the top-k with a tail bucket on materialised logits (as a trainer
    does it): bf16 logits, fp32 log_softmax, gather, the tail bin from 1 - sum."""
    logq = torch.log_softmax((x @ w.T).float(), dim=-1)
    lq = logq.gather(-1, ids)
    p = lp.exp()
    loss = (p * (lp - lq)).sum(-1)
    tail_p = (1 - p.sum(-1)).clamp_min(1e-10)
    tail_q = (1 - lq.exp().sum(-1)).clamp_min(1e-10)
    return (loss + tail_p * (tail_p.log() - tail_q.log())).mean()


def _logitless(**kw):
    def make(shape, device):
        import logitless

        return lambda x, w, ids, lp: logitless.linear_topk_kl(x, w, ids, lp, **kw)
    return make


def _eager(shape, device):
    return logits_way


def _compiled(shape, device):
    return torch.compile(logits_way)


#: name -> (make, description, the options of its float64 reference)
METHODS = {
    "logitless": (_logitless(), "linear_topk_kl: forward KL, tail bucket, default budget (3% of the GPU)", {}),
    "logitless-reverse": (_logitless(direction="reverse"), "linear_topk_kl(direction='reverse')",
                          dict(direction="reverse")),
    "logitless-renormalize": (_logitless(tail="renormalize"), "linear_topk_kl(tail='renormalize')",
                              dict(tail="renormalize")),
    "logitless-none": (_logitless(tail="none"), "linear_topk_kl(tail='none') (verl's forward_kl_topk)",
                       dict(tail="none")),
    "torch-eager": (_eager, "bf16 logits, fp32 log_softmax, gather, the same KL (tail bin from 1 - sum)", {}),
    "torch-compile": (_compiled, "the same under torch.compile", {}),
}


# --------------------------------------------------------------------------- measurement


def measure(fn, inputs, gemm_ms, ref, device, warmup, reps, row) -> None:
    from . import runner

    x, w, ids, lp = inputs
    tm = dict(device=device, warmup=warmup, reps=reps)

    def phase(name, f):
        return runner.phase(row, name, device, f)

    def forward():
        with torch.no_grad():
            ms, row["fwd_spread"] = timing.time_ms_spread(lambda: fn(x, w, ids, lp), **tm)
            return ms

    row["fwd_ms"] = phase("forward", forward)
    if row["fwd_ms"] is None:
        return
    row["fwd_per_gemm"] = row["fwd_ms"] / gemm_ms
    xg, wg = x.detach().requires_grad_(True), w.detach().requires_grad_(True)

    def setup():
        xg.grad = wg.grad = None

    def step():
        loss = fn(xg, wg, ids, lp)
        loss.backward()
        return loss.detach()

    def fwdbwd():
        ms, row["fwdbwd_spread"] = timing.time_ms_spread(step, setup=setup, **tm)
        return ms

    row["fwdbwd_ms"] = phase("forward+backward", fwdbwd)
    if row["fwdbwd_ms"] is not None:
        row["fwdbwd_per_3gemm"] = row["fwdbwd_ms"] / (3 * gemm_ms)
    grads = xg.numel() * xg.element_size() + wg.numel() * wg.element_size()
    out = phase("memory", lambda: timing.peak_extra_bytes(step, device=device, setup=setup, exclude_bytes=grads))
    if out is not None:
        loss, extra = out
        row["peak_extra_mib"] = None if extra is None else extra / 2**20
        row["loss"] = float(loss)
        if ref is not None:
            row["rel_err"] = abs(row["loss"] - ref) / abs(ref)
    setup()


# --------------------------------------------------------------------------- report


#: The error columns of this suite's table (``report.gemm_table``).
ERRORS = (("rel err", "rel_err"),)


def table(rows) -> str:
    return report.gemm_table(rows, ERRORS)


def save(data, out_dir) -> list:
    return report.save_gemm_suite(data, out_dir, ERRORS, METRICS)


# --------------------------------------------------------------------------- entry point


def run_cli(args, cpu: bool) -> int:
    """``python -m logitless_bench --suite topk ...`` (options of cli.py)."""
    from .shapes import CPU_TOPK_SHAPES, TOPK_SHAPES

    device, shapes, methods, (warmup, reps, deadline) = select(args, cpu, TOPK_SHAPES, CPU_TOPK_SHAPES, METHODS,
                                                               "topk")
    meta = report.environment(device)
    print(f"device: {meta['device']} | torch {meta['torch']} | triton {meta['triton']}", flush=True)
    data = report.suite_data("topk", "top-k distillation: mean KL over the teacher's top-K, forward+backward", meta,
                             (warmup, reps, args.seed), {m: METHODS[m][1] for m in methods}, gemm_ms={})
    out_dir = args.out or "benchmarks/results"

    def run_shape(shape):
        inputs = make_inputs(shape, device, args.seed)
        gemm_ms = timing.gemm_ms(inputs[0], inputs[1], warmup=warmup, reps=reps)
        data["gemm_ms"][shape.name] = gemm_ms
        print(f"== topk {shape.label} {shape.dtype}: 1 GEMM = {gemm_ms:.3f} ms", flush=True)
        refs = {}
        for name in methods:
            row = {"shape": shape.name, "method": name, "status": "ok", "reason": "", "errors": [],
                   "gemm_ms": gemm_ms}
            ref = None
            if not args.no_errors:
                key = tuple(sorted(METHODS[name][2].items()))
                try:
                    if key not in refs:
                        refs[key] = reference(*inputs, **METHODS[name][2])
                    ref = refs[key]
                except Exception as exc:  # noqa: BLE001
                    data["notes"].append(f"{shape.name}: float64 reference failed ({describe(exc)})")
                timing.release_memory(device)
            fill_row(row, lambda: METHODS[name][0](shape, device),
                     lambda fn: measure(fn, inputs, gemm_ms, ref, device, warmup, reps, row),
                     out_of_time=deadline is not None and time.monotonic() > deadline)
            data["rows"].append(row)
            print(f"  {name:<22} {row['status']:<8} fwd {report.fmt(row.get('fwd_per_gemm'), '.2f')}x GEMM, "
                  f"f+b {report.fmt(row.get('fwdbwd_per_3gemm'), '.2f')}x 3 GEMMs, peak "
                  f"{report.fmt(row.get('peak_extra_mib'), '.0f')} MiB, "
                  f"rel err {report.fmt(row.get('rel_err'), '.1e')} "
                  f"{row['reason'][:160]}", flush=True)
            timing.release_memory(device)

    written = run_shapes(data, shapes, run_shape, save, out_dir, device)
    print("\n" + table(data["rows"]), flush=True)
    print("written: " + ", ".join(str(p) for p in written), flush=True)
    return 0
