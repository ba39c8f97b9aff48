"""Suite ``rl``: token log-probs and entropy at a temperature (RL post-training's LM head).

Per shape (``logitless_bench/shapes.py``: bf16, T = 0.7): random inputs (x ~
N(0, 1), W ~ N(0, 1/H), tokens uniform), the unit (one cuBLAS ``x @ W.T``), the float64
reference (computed on the device in chunks of tokens); then per method: forward time
(no_grad) / 1 GEMM, forward+backward time with upstream gradients on both outputs /
3 GEMMs, peak extra memory, max |error| of log p and entropy against float64.

Methods: logitless.linear_log_probs (default budget; a logits-sized budget), torch eager
on the logits (bf16 logits, fp32 log_softmax of logits / T), the same under
torch.compile, verl's fused kernel (``verl.utils.kernel.linear_cross_entropy``, when
importable); truncated sampling (top-k / top-p / min-p, and a logits-based sort mask for
comparison), the untruncated and top-p calls on peaked rows (the same inputs at T = 0.1)
and ``batch_invariant=True`` rows (no error column for truncated or peaked rows); the
``logitless-tp1*`` rows run the vocab-parallel path over a one-rank process group.
``python -m logitless_bench --suite rl`` (options of cli.py); without a GPU one tiny
case runs on the CPU, loudly labelled.
"""

from __future__ import annotations

import math
import time

import torch

from . import report, runner, timing
from .peers import Skip
from .runner import describe, fill_row, run_shapes, select

METRICS = """\
Metrics (rl): x (N,H) ~N(0,1), W (V,H) ~N(0,1/H) in the shape's dtype, tokens uniform, temperature 0.7; every
method returns per-token log p(token) and the entropy of softmax(logits / T).
- **fwd/GEMM**: median forward time under no_grad / one cuBLAS x @ W.T of the same shape.
- **f+b/3GEMM**: median time of forward + backward with random upstream gradients on both outputs (x and W
  require grad; grads set to None untimed before each call) / three such GEMMs. CUDA events, L2 flushed.
- **peak extra MiB**: max_memory_allocated during one more forward+backward minus memory before it minus the
  dx and dW bytes.
- **logp err**, **H err**: max |ours - float64| over tokens (the float64 reference computed in token chunks)."""


# --------------------------------------------------------------------------- inputs and reference


def make_inputs(shape, device, seed: int):
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    dtype = getattr(torch, shape.dtype)
    x = torch.randn(shape.tokens, shape.hidden, generator=g, device=device, dtype=torch.float32).to(dtype)
    w = (torch.randn(shape.vocab, shape.hidden, generator=g, device=device, dtype=torch.float32)
         * shape.hidden**-0.5).to(dtype)
    t = torch.randint(0, shape.vocab, (shape.tokens,), generator=g, device=device)
    g_lp = torch.randn(shape.tokens, generator=g, device=device)
    g_h = torch.randn(shape.tokens, generator=g, device=device)
    return x, w, t, g_lp, g_h


def reference(x, w, t, temperature, chunk: int = 1024):
    """(logp, entropy) in float64, chunks of tokens (at most chunk x V float64 at once)."""
    lp = torch.empty(x.shape[0], dtype=torch.float64, device=x.device)
    ent = torch.empty_like(lp)
    wd = w.double()
    for n0 in range(0, x.shape[0], chunk):
        a = (x[n0:n0 + chunk].double() @ wd.T) / temperature
        ls = torch.log_softmax(a, dim=-1)
        del a
        lp[n0:n0 + chunk] = ls.gather(1, t[n0:n0 + chunk, None])[:, 0]
        ent[n0:n0 + chunk] = -(ls.exp() * ls).sum(-1)
        del ls
    return lp, ent


# --------------------------------------------------------------------------- methods


def _torch_on_logits(x, w, t, temperature):
    logits = x @ w.T  # in the input dtype, as a model's lm_head
    a = logits.float() / temperature
    ls = torch.log_softmax(a, dim=-1)
    lp = ls.gather(-1, t[:, None])[:, 0]
    ent = -(ls.exp() * ls).sum(-1)
    return lp, ent


def _logitless(budget):
    def make(shape, device):
        import logitless

        b = budget(shape) if callable(budget) else budget

        def fn(x, w, t):
            return logitless.linear_log_probs(x, w, t, temperature=shape.temperature, entropy=True,
                                              memory_budget=b)
        return fn
    return make


def _logits_budget(shape):
    itemsize = torch.empty(0, dtype=getattr(torch, shape.dtype)).element_size()
    return shape.tokens * shape.vocab * itemsize + 64 * 2**20


def _eager(shape, device):
    return lambda x, w, t: _torch_on_logits(x, w, t, shape.temperature)


def _compiled(shape, device):
    compiled = torch.compile(_torch_on_logits)
    return lambda x, w, t: compiled(x, w, t, shape.temperature)


def _verl(shape, device):
    if device.type != "cuda":
        raise Skip("verl's kernel needs CUDA")
    try:
        from verl.utils.kernel.linear_cross_entropy import linear_cross_entropy as verl_lce
    except Exception as exc:  # noqa: BLE001 - an optional peer
        raise Skip(f"verl not importable ({describe(exc)})") from None

    def fn(x, w, t):
        lp, ent = verl_lce(x, w, t, shape.temperature)
        return lp, ent
    return fn


def _logitless_with(temperature=None, **extra):
    """linear_log_probs with truncation and/or batch_invariant (default budget);
    ``temperature``: instead of the shape's (PEAKED: rows with a few dominant tokens)."""
    def make(shape, device):
        import logitless

        temp = temperature or shape.temperature

        def fn(x, w, t):
            return logitless.linear_log_probs(x, w, t, temperature=temp, entropy=True, **extra)
        return fn
    return make


def _tp1(**extra):
    """linear_log_probs over a vocab-parallel head of ONE rank (a world-1 process group:
    NCCL on a GPU, gloo on the CPU): the tensor-parallel code path's own cost on one GPU
    (its threshold pass is the chunked one with the candidates all-gathered)."""
    def make(shape, device):
        import torch.distributed as dist

        if not dist.is_initialized():
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(), rank=0,
                                    world_size=1, **({"device_id": device} if device.type == "cuda" else {}))
        return _logitless_with(process_group=dist.group.WORLD, **extra)(shape, device)
    return make


def _torch_truncated_on_logits(x, w, t, temperature, top_k, top_p, min_p=0.0):
    """The logits-based way: vLLM's min-p mask, then its sort-based top-k / top-p mask, on
    fp32 logits / T (min-p alone: no sort)."""
    a = (x @ w.T).float() / temperature
    if min_p > 0:
        a = a.masked_fill(a < a.amax(-1, keepdim=True) + math.log(min_p), float("-inf"))
        if not top_k and top_p >= 1:
            ls = torch.log_softmax(a, dim=-1)
            p = ls.exp()
            return ls.gather(-1, t[:, None])[:, 0], -(torch.where(p > 0, p * ls, torch.zeros_like(p))).sum(-1)
    srt, idx = a.sort(dim=-1)
    v = a.shape[-1]
    if top_k:
        srt = srt.masked_fill(srt < srt[:, v - top_k:v - top_k + 1], float("-inf"))
    if top_p < 1:
        drop = srt.softmax(-1).cumsum(-1) <= 1 - top_p
        drop[:, -1] = False
        srt = srt.masked_fill(drop, float("-inf"))
    masked = torch.empty_like(a).scatter_(-1, idx, srt)
    ls = torch.log_softmax(masked, dim=-1)
    lp = ls.gather(-1, t[:, None])[:, 0]
    p = ls.exp()
    ent = -(torch.where(p > 0, p * ls, torch.zeros_like(p))).sum(-1)
    return lp, ent


def _eager_truncated(top_k=0, top_p=1.0, min_p=0.0):
    def make(shape, device):
        return lambda x, w, t: _torch_truncated_on_logits(x, w, t, shape.temperature, top_k, top_p, min_p)
    return make


#: The temperature of the peaked rows: z ~ N(0, 1) over V = 152k columns, a = z / 0.1 leaves
#: a handful of tokens with most of the mass.
PEAKED = 0.1

METHODS = {
    "logitless": (_logitless(None), "logitless.linear_log_probs(entropy=True), default memory budget (3% of the GPU)"),
    "logitless@logits": (_logitless(_logits_budget), "logitless.linear_log_probs, budget = bf16 logits + 64 MiB"),
    "torch-eager": (_eager, "x @ W.T in bf16, fp32 log_softmax(logits / T), gather, entropy"),
    "torch-compile": (_compiled, "the same under torch.compile"),
    "verl": (_verl, "verl.utils.kernel.linear_cross_entropy (fused Triton, when installed)"),
    # truncated sampling (issue 38): errors against the untruncated float64 reference are not reported
    "logitless-topk64": (_logitless_with(top_k=64), "linear_log_probs(top_k=64)"),
    "logitless-minp0.05": (_logitless_with(min_p=0.05), "linear_log_probs(min_p=0.05)"),
    "logitless-topp0.95": (_logitless_with(top_p=0.95), "linear_log_probs(top_p=0.95)"),
    "logitless-k50p0.9": (_logitless_with(top_k=50, top_p=0.9), "linear_log_probs(top_k=50, top_p=0.9)"),
    "torch-eager-k50p0.9": (_eager_truncated(50, 0.9), "bf16 logits, vLLM's sort-based top-k=50/top-p=0.9 mask, fp32"),
    "torch-eager-topp0.95": (_eager_truncated(top_p=0.95), "bf16 logits, vLLM's sort-based top-p=0.95 mask, fp32"),
    "torch-eager-minp0.05": (_eager_truncated(min_p=0.05), "bf16 logits, vLLM's min-p=0.05 mask (no sort), fp32"),
    # peaked rows, as an LM's (a few dominant tokens): the same inputs at T = PEAKED (N(0,1) logits at
    # T = 0.7 are flat rows, the worst case of top-p / min-p)
    "logitless-peaked": (_logitless_with(temperature=PEAKED), f"linear_log_probs at T = {PEAKED} (peaked rows)"),
    "logitless-topp0.95-peaked": (_logitless_with(temperature=PEAKED, top_p=0.95),
                                  f"linear_log_probs(top_p=0.95) at T = {PEAKED} (peaked rows)"),
    "logitless-invariant": (_logitless_with(batch_invariant=True), "linear_log_probs(batch_invariant=True)"),
    "logitless-invariant-k50p0.9": (_logitless_with(batch_invariant=True, top_k=50, top_p=0.9),
                                    "linear_log_probs(batch_invariant=True, top_k=50, top_p=0.9)"),
    "logitless-tp1": (_tp1(), "linear_log_probs(process_group=<1 rank>)"),
    "logitless-tp1-k50p0.9": (_tp1(top_k=50, top_p=0.9),
                              "linear_log_probs(process_group=<1 rank>, top_k=50, top_p=0.9)"),
    "logitless-tp1-topk64": (_tp1(top_k=64), "linear_log_probs(process_group=<1 rank>, top_k=64)"),
    "logitless-tp1-invariant": (_tp1(batch_invariant=True),
                                "linear_log_probs(process_group=<1 rank>, batch_invariant=True)"),
}

#: Methods whose distribution is truncated or at another temperature: no error against the reference.
TRUNCATED = {m for m in METHODS if "top" in m or "minp" in m or "k50" in m or "peaked" in m}


# --------------------------------------------------------------------------- measurement


def measure(fn, inputs, gemm_ms, ref, temperature, device, warmup, reps, row) -> None:
    x, w, t, g_lp, g_h = inputs
    tm = dict(device=device, warmup=warmup, reps=reps)

    def phase(name, f):
        return runner.phase(row, name, device, f)

    def forward():
        with torch.no_grad():
            ms, row["fwd_spread"] = timing.time_ms_spread(lambda: fn(x, w, t), **tm)
            return ms

    row["fwd_ms"] = phase("forward", forward)
    if row["fwd_ms"] is None:
        return
    row["fwd_per_gemm"] = row["fwd_ms"] / gemm_ms
    xg, wg = x.detach().requires_grad_(True), w.detach().requires_grad_(True)

    def setup():
        xg.grad = wg.grad = None

    def step():
        lp, ent = fn(xg, wg, t)
        torch.autograd.backward([lp, ent], [g_lp, g_h])
        return lp.detach(), ent.detach()

    def fwdbwd():
        ms, row["fwdbwd_spread"] = timing.time_ms_spread(step, setup=setup, **tm)
        return ms

    row["fwdbwd_ms"] = phase("forward+backward", fwdbwd)
    if row["fwdbwd_ms"] is not None:
        row["fwdbwd_per_3gemm"] = row["fwdbwd_ms"] / (3 * gemm_ms)
    grads = xg.numel() * xg.element_size() + wg.numel() * wg.element_size()
    out = phase("memory", lambda: timing.peak_extra_bytes(step, device=device, setup=setup, exclude_bytes=grads))
    if out is not None:
        (lp, ent), extra = out
        row["peak_extra_mib"] = None if extra is None else extra / 2**20
        if ref is not None:
            lp = lp.double()
            if lp.mean() > 0:  # a peer returning -log p
                lp = -lp
                row["note"] = "returned -log p (negated)"
            row["logp_err"] = (lp - ref[0]).abs().max().item()
            row["entropy_err"] = (ent.double() - ref[1]).abs().max().item()
    setup()


# --------------------------------------------------------------------------- report


#: The error columns of this suite's table (``report.gemm_table``).
ERRORS = (("logp err", "logp_err"), ("H err", "entropy_err"))


def table(rows) -> str:
    return report.gemm_table(rows, ERRORS)


def save(data, out_dir) -> list:
    return report.save_gemm_suite(data, out_dir, ERRORS, METRICS)


# --------------------------------------------------------------------------- entry point


def run_cli(args, cpu: bool) -> int:
    """``python -m logitless_bench --suite rl ...`` (options of cli.py)."""
    from .shapes import CPU_RL_SHAPES as CPU_SHAPES
    from .shapes import RL_SHAPES as SHAPES

    device, shapes, methods, (warmup, reps, deadline) = select(args, cpu, SHAPES, CPU_SHAPES, METHODS, "rl")
    meta = report.environment(device)
    print(f"device: {meta['device']} | torch {meta['torch']} | triton {meta['triton']}", flush=True)
    data = report.suite_data("rl", "token log-probs + entropy at T=0.7, upstream gradients on both outputs", meta,
                             (warmup, reps, args.seed), {m: METHODS[m][1] for m in methods}, gemm_ms={})
    out_dir = args.out or "benchmarks/results"

    def run_shape(shape):
        inputs = make_inputs(shape, device, args.seed)
        gemm_ms = timing.gemm_ms(inputs[0], inputs[1], warmup=warmup, reps=reps)
        data["gemm_ms"][shape.name] = gemm_ms
        print(f"== rl {shape.label} {shape.dtype} T={shape.temperature}: 1 GEMM = {gemm_ms:.3f} ms", flush=True)
        ref = None
        if not args.no_errors:
            try:
                ref = reference(*inputs[:3], shape.temperature)
            except Exception as exc:  # noqa: BLE001
                data["notes"].append(f"{shape.name}: float64 reference failed ({describe(exc)})")
            timing.release_memory(device)
        for name in methods:
            row = {"shape": shape.name, "method": name, "status": "ok", "reason": "", "errors": [],
                   "gemm_ms": gemm_ms}
            fill_row(row, lambda: METHODS[name][0](shape, device),
                     lambda fn: measure(fn, inputs, gemm_ms, None if name in TRUNCATED else ref, shape.temperature,
                                       device, warmup, reps, row),
                     out_of_time=deadline is not None and time.monotonic() > deadline)
            data["rows"].append(row)
            print(f"  {name:<17} {row['status']:<8} fwd {report.fmt(row.get('fwd_per_gemm'), '.2f')}x GEMM, "
                  f"f+b {report.fmt(row.get('fwdbwd_per_3gemm'), '.2f')}x 3 GEMMs, peak "
                  f"{report.fmt(row.get('peak_extra_mib'), '.0f')} MiB, "
                  f"logp err {report.fmt(row.get('logp_err'), '.1e')}, "
                  f"H err {report.fmt(row.get('entropy_err'), '.1e')} {row['reason'][:160]}", flush=True)
            timing.release_memory(device)

    written = run_shapes(data, shapes, run_shape, save, out_dir, device)
    print("\n" + table(data["rows"]), flush=True)
    print("written: " + ", ".join(str(p) for p in written), flush=True)
    return 0
