"""Suite ``distill``: fused linear distillation (generalized JSD, beta 0.5, T 1).

Per shape (``logitless_bench/shapes.py``): random bf16 inputs (x ~ N(0, 1), W ~
N(0, 1/H) for student and teacher, targets uniform, none ignored), the GEMM floor (four
cuBLAS GEMMs timed in this run: student logits x_s W_s^T, teacher logits x_t W_t^T,
dx = dz W_s, dW = dz^T x_s), the float64 reference (chunks of tokens); then per method:
forward+backward time / floor, peak extra memory, |loss - ref|, dx and dW relative
errors. Methods: logitless.linear_jsd, the naive formula in eager torch and under
torch.compile, liger's LigerFusedLinearJSD and LigerFusedLinearJSDLoss (soft weight 1,
hard weight 0), TRL's ChunkedDivergenceFunction (when importable).

``python -m logitless_bench --suite distill`` (see ``--help``); without a GPU one tiny
case runs on the CPU, loudly labelled.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from . import report, timing
from .peers import Skip
from .runner import describe, fill_row, grad_leaves, memory_and_loss, phase, run_shapes, select

BETA = 0.5
TEMPERATURE = 1.0

METRICS = """\
Metrics (distill): student x_s (N,H_s), W_s (V,H_s), teacher x_t (N,H_t), W_t (V,H_t), ~N(0,1) and
~N(0,1/H) in bf16; targets uniform (none ignored); generalized JSD beta 0.5, temperature 1, mean over tokens.
- **floor ms**: sum of the medians of four cuBLAS GEMMs measured in this run: x_s W_s^T, x_t W_t^T (logits),
  dz W_s (dx) and dz^T x_s (dW), the least a forward+backward computes.
- **f+b ms**: median of `reps` calls of `loss = f(...); loss.backward()` (x_s, W_s require grad; grads set to
  None untimed before each call), CUDA events, L2 flushed. **f+b/floor** = f+b ms / floor ms.
- **peak extra MiB**: max_memory_allocated during one more call minus memory before it minus dx and dW bytes.
- **|loss-ref|**, **dx err**, **dW err**: against a float64 reference computed on the device in chunks of
  tokens: absolute loss difference and ||g - g_ref||_F / ||g_ref||_F."""


# --------------------------------------------------------------------------- inputs, floor, reference


def make_inputs(shape, device, seed: int):
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    dtype = getattr(torch, shape.dtype)

    def rnd(*size, scale=1.0):
        return (torch.randn(*size, generator=g, device=device, dtype=torch.float32) * scale).to(dtype)

    xs = rnd(shape.tokens, shape.hidden_s)
    ws = rnd(shape.vocab, shape.hidden_s, scale=shape.hidden_s**-0.5)
    xt = rnd(shape.tokens, shape.hidden_t)
    wt = rnd(shape.vocab, shape.hidden_t, scale=shape.hidden_t**-0.5)
    t = torch.randint(0, shape.vocab, (shape.tokens,), generator=g, device=device)
    return xs, ws, xt, wt, t


def gemm_floor_ms(xs, ws, xt, wt, *, warmup: int, reps: int) -> dict:
    """Medians of the four GEMMs of a distillation step (one dz-shaped operand made once),
    each timed as a unit (warm-up, spread checked: ``timing.measure_unit``); their sum
    "floor"; "warnings": why a part looks wrong (absent when none does)."""
    dev = xs.device
    n, v = xs.shape[0], ws.shape[0]
    with torch.no_grad():
        dz = torch.randn(n, v, device=dev, dtype=xs.dtype)
        gemms = {"student_logits": (lambda: xs @ ws.T, n * v * xs.shape[1]),
                 "teacher_logits": (lambda: xt @ wt.T, n * v * xt.shape[1]),
                 "dx": (lambda: dz @ ws, n * v * xs.shape[1]),
                 "dW": (lambda: dz.T @ xs, n * v * xs.shape[1])}
        units = {name: timing.measure_unit(name, fn, 2.0 * macs, device=dev, warmup=warmup, reps=reps,
                                           expected=timing.expected_gemm_flops(dev, xs.element_size(), 2.0 * macs))
                 for name, (fn, macs) in gemms.items()}
    parts = {name: u.ms for name, u in units.items()}
    parts["floor"] = sum(parts.values())
    warnings = [u.warning for u in units.values() if u.warning]
    if warnings:
        parts["warnings"] = warnings
    return parts


@torch.no_grad()
def jsd_reference(xs, ws, xt, wt, *, beta=BETA, temperature=TEMPERATURE, chunk_bytes=2**30):
    """Mean generalized JSD in float64 (0 < beta < 1, no ignored tokens): (loss, dx, dW),
    dx and dW stored in fp32. Chunks of tokens; dz = (1-beta)/T p (lp - lm - S) / N."""
    n, v = xs.shape[0], ws.shape[0]
    ws64, wt64 = ws.double(), wt.double()
    dw = torch.zeros_like(ws64)
    dx = torch.empty(xs.shape, dtype=torch.float32, device=xs.device)
    total = torch.zeros((), dtype=torch.float64, device=xs.device)
    rows = max(1, chunk_bytes // (v * 8))
    for i in range(0, n, rows):
        xc = xs[i : i + rows].double()
        lp = F.log_softmax((xc @ ws64.T) / temperature, dim=-1)
        lq = F.log_softmax((xt[i : i + rows].double() @ wt64.T) / temperature, dim=-1)
        lm = torch.logaddexp(lp + math.log1p(-beta), lq + math.log(beta))
        p = lp.exp()
        s = (p * (lp - lm)).sum(-1)
        total += (beta * (lq.exp() * (lq - lm)).sum(-1) + (1 - beta) * s).sum()
        dz = p.mul_(lp.sub_(lm).sub_(s[:, None])).mul_((1 - beta) / temperature / n)
        del lq, lm
        dx[i : i + rows] = (dz @ ws64).float()
        dw.addmm_(dz.T, xc)
        del dz, lp, xc
    out = total.item() / n, dx, dw.float()
    del ws64, wt64, dw
    return out


@torch.no_grad()
def rel_err(a, ref) -> float:
    from .reference import rel_err as _rel

    return _rel(a, ref)


# --------------------------------------------------------------------------- methods


def naive_jsd(xs, ws, xt, wt, t, beta=BETA, temperature=TEMPERATURE):
    """What a user writes: both logits, upcast to fp32, the TRL formula, mean over tokens."""
    zs = (xs @ ws.T).float() / temperature
    with torch.no_grad():
        zt = (xt @ wt.T).float() / temperature
    lp = F.log_softmax(zs, dim=-1)
    lq = F.log_softmax(zt, dim=-1)
    lm = torch.logsumexp(torch.stack([lp + math.log(1 - beta), lq + math.log(beta)]), dim=0)
    kl_t = F.kl_div(lm, lq, reduction="none", log_target=True).sum(-1)
    kl_s = F.kl_div(lm, lp, reduction="none", log_target=True).sum(-1)
    return (beta * kl_t + (1 - beta) * kl_s).mean()


def _logitless(shape, device):
    import logitless

    return lambda xs, ws, xt, wt, t: logitless.linear_jsd(xs, ws, xt, wt, t, beta=BETA, temperature=TEMPERATURE)


def _torch_eager(shape, device):
    return naive_jsd


def _torch_compile(shape, device):
    if device.type != "cuda":
        raise Skip("torch.compile is measured on the GPU only")
    torch._dynamo.reset()
    return torch.compile(naive_jsd)


def _liger(module: str, name: str, device):
    """liger-kernel's class ``module.name``; ``Skip`` off CUDA or when it does not import."""
    if device.type != "cuda":
        raise Skip("liger-kernel needs CUDA")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise Skip(f"liger-kernel not importable ({exc})") from None


def _liger_fused(shape, device):
    mod = _liger("liger_kernel.transformers.fused_linear_jsd", "LigerFusedLinearJSD", device)(
        jsd_beta=BETA, temperature=TEMPERATURE)
    return lambda xs, ws, xt, wt, t: mod(xs, ws, xt, wt, t)


def _liger_chunked(shape, device):
    cls = _liger("liger_kernel.chunked_loss", "LigerFusedLinearJSDLoss", device)
    torch._dynamo.reset()
    mod = cls(weight_hard_loss=0.0, weight_soft_loss=1.0, beta=BETA, temperature=TEMPERATURE)
    return lambda xs, ws, xt, wt, t: mod(xs, ws, xt, wt, t)


def _trl_chunked(shape, device):
    if device.type != "cuda":
        raise Skip("TRL's chunked divergence is measured on the GPU only")
    try:
        from trl.kernels.chunked_divergence import ChunkedDivergenceFunction
    except Exception as exc:  # noqa: BLE001 - trl or one of its dependencies missing
        raise Skip(f"trl.kernels.chunked_divergence not importable ({describe(exc)})") from None

    def f(xs, ws, xt, wt, t):
        per_token, _entropy = ChunkedDivergenceFunction.apply(xs, ws, None, xt, wt, None, BETA, TEMPERATURE)
        return per_token.float().mean()

    return f


METHODS: dict[str, tuple[Callable, str]] = {
    "logitless": (_logitless, "logitless.linear_jsd (default memory budget: 3% of the GPU)"),
    "torch-eager": (_torch_eager, "naive formula: both logits, fp32 log_softmax, kl_div"),
    "torch-compile": (_torch_compile, "torch.compile of the naive formula"),
    "liger-fused": (_liger_fused, "liger_kernel LigerFusedLinearJSD"),
    "liger-chunked": (_liger_chunked, "liger_kernel.chunked_loss LigerFusedLinearJSDLoss (hard 0, soft 1)"),
    "trl-chunked": (_trl_chunked, "trl.kernels.chunked_divergence.ChunkedDivergenceFunction"),
}


# --------------------------------------------------------------------------- measuring


def measure(fn, inputs, floor, ref, device, warmup, reps, row) -> None:
    xs, ws, xt, wt, t = inputs
    xg, wg, setup = grad_leaves(xs, ws)

    def step():
        loss = fn(xg, wg, xt, wt, t)
        loss.backward()
        return loss

    row["fwdbwd_ms"] = phase(row, "forward+backward", device,
                              lambda: timing.time_ms(step, device=device, setup=setup, warmup=warmup, reps=reps))
    if row["fwdbwd_ms"] is None:
        setup()
        return
    row["fwdbwd_per_floor"] = row["fwdbwd_ms"] / floor
    grads = xg.numel() * xg.element_size() + wg.numel() * wg.element_size()
    if memory_and_loss(row, step, setup, device, grads) and ref is not None:
        row["loss_abs_err"] = abs(row["loss"] - ref[0])
        if xg.grad is not None and wg.grad is not None:
            row["dx_rel_err"] = phase(row, "dx error", device, lambda: rel_err(xg.grad, ref[1]))
            row["dw_rel_err"] = phase(row, "dW error", device, lambda: rel_err(wg.grad, ref[2]))
    setup()


# --------------------------------------------------------------------------- report


def _fmt(v, spec):
    return "-" if v is None else format(v, spec)


def table(rows) -> str:
    head = ["shape", "method", "status", "f+b ms", "f+b/floor", "peak extra MiB", "|loss-ref|", "dx err", "dW err"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        status = r["status"] if r["status"] == "ok" else f"{r['status']}: {r['reason'][:120]}"
        lines.append("| " + " | ".join([
            r["shape"], r["method"], status, _fmt(r.get("fwdbwd_ms"), ".2f"), _fmt(r.get("fwdbwd_per_floor"), ".2f"),
            _fmt(r.get("peak_extra_mib"), ".0f"), _fmt(r.get("loss_abs_err"), ".2e"),
            _fmt(r.get("dx_rel_err"), ".2e"), _fmt(r.get("dw_rel_err"), ".2e")]) + " |")
    return "\n".join(lines)


def save(data, out_dir) -> list:
    lines = [f"**!!! {w}**" for w in data.get("unit_warnings", [])]
    lines += ["GEMM floors (ms): " + ", ".join(f"{k}: {v['floor']:.3f}" for k, v in data["floors"].items()), ""]
    return report.save_suite(data, out_dir, report.suite_markdown(data, lines, table(data["rows"]), METRICS))


# --------------------------------------------------------------------------- entry point


def run_cli(args, cpu: bool) -> int:
    """``python -m logitless_bench --suite distill ...`` (options of cli.py)."""
    import time

    from .shapes import CPU_DISTILL_SHAPES as CPU_SHAPES
    from .shapes import DISTILL_SHAPES as SHAPES

    device, shapes, methods, (warmup, reps, deadline) = select(args, cpu, SHAPES, CPU_SHAPES, METHODS, "distill")
    meta = report.environment(device)
    print(f"device: {meta['device']} | torch {meta['torch']} | triton {meta['triton']} | peers: {meta['peers']}",
          flush=True)
    data = report.suite_data("distill", "fused linear distillation, generalized JSD (beta 0.5, T 1), fwd+bwd", meta,
                             (warmup, reps, args.seed), {m: METHODS[m][1] for m in methods}, floors={})
    out_dir = args.out or "benchmarks/results"

    def run_shape(shape):
        inputs = make_inputs(shape, device, args.seed)
        floor = gemm_floor_ms(*inputs[:4], warmup=warmup, reps=reps)
        unit_warnings = [f"{shape.name}: {w}" for w in floor.pop("warnings", [])]
        data["floors"][shape.name] = floor
        data.setdefault("unit_warnings", []).extend(unit_warnings)
        print(f"== distill {shape.label} {shape.dtype}: floor {floor['floor']:.3f} ms "
              f"({', '.join(f'{k} {v:.3f}' for k, v in floor.items() if k != 'floor')})", flush=True)
        for w in unit_warnings:
            print(f"!!! {w}", flush=True)
        ref = None
        if not args.no_errors:
            try:
                ref = jsd_reference(*inputs[:4])
            except Exception as exc:  # noqa: BLE001
                data["notes"].append(f"{shape.name}: float64 reference failed ({describe(exc)})")
            timing.release_memory(device)
        for name in methods:
            row = {"shape": shape.name, "method": name, "status": "ok", "reason": "", "errors": [],
                   "floor_ms": floor["floor"]}
            fill_row(row, lambda: METHODS[name][0](shape, device),
                     lambda fn: measure(fn, inputs, floor["floor"], ref, device, warmup, reps, row),
                     out_of_time=deadline is not None and time.monotonic() > deadline)
            data["rows"].append(row)
            print(f"  {name:<14} {row['status']:<8} f+b {_fmt(row.get('fwdbwd_ms'), '.2f')} ms = "
                  f"{_fmt(row.get('fwdbwd_per_floor'), '.2f')} x floor, peak "
                  f"{_fmt(row.get('peak_extra_mib'), '.0f')} MiB, "
                  f"|loss-ref| {_fmt(row.get('loss_abs_err'), '.1e')}, "
                  f"dx {_fmt(row.get('dx_rel_err'), '.1e')}, dW {_fmt(row.get('dw_rel_err'), '.1e')} "
                  f"{row['reason'][:160]}", flush=True)
            timing.release_memory(device)

    written = run_shapes(data, shapes, run_shape, save, out_dir, device)
    if cpu:  # before the numbers it introduces
        print("\n" + report.CPU_BANNER)
    for w in data.get("unit_warnings", []):
        print(f"!!! {w}")
    print("\n" + table(data["rows"]))
    print("files: " + " ".join(str(p) for p in written))
    return 0 if data["complete"] else 130
