"""Suite ``lce``: fused linear cross-entropy, loss of ``x @ W.T`` against targets.

Per shape (``prepare``): random inputs in the shape's dtype (x ~ N(0, 1), W ~ N(0, 1/H),
targets uniform), the unit (one cuBLAS ``x @ W.T``), the float64 reference; then per
method (``measure``): forward time, forward+backward time, peak extra memory, errors.
"""

from __future__ import annotations

import torch

from . import reference, report, timing
from .runner import Config, Progress, describe, grad_leaves, memory_and_loss, phase, run_methods


def make_inputs(shape, device, seed: int):
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    dtype = getattr(torch, shape.dtype)
    x = torch.randn(shape.tokens, shape.hidden, generator=g, device=device, dtype=dtype)
    w = torch.randn(shape.vocab, shape.hidden, generator=g, device=device, dtype=dtype)
    w.mul_(shape.hidden**-0.5)
    t = torch.randint(0, shape.vocab, (shape.tokens,), generator=g, device=device)
    return x, w, t


def measure(fn, x, w, t, gemm_ms, ref, cfg: Config, row: dict) -> None:
    """Fills ``row`` with the metrics of loss function ``fn(x, w, t)``."""
    dev, tm = cfg.device, dict(warmup=cfg.warmup, reps=cfg.reps)

    # Forward only: no autograd graph, inputs that do not require grad.
    def forward():
        with torch.no_grad():
            ms, row["fwd_spread"] = timing.time_ms_spread(lambda: fn(x, w, t), device=dev, **tm)
            return ms

    row["fwd_ms"] = phase(row, "forward", dev, forward)
    if row["fwd_ms"] is None:
        return  # what broke the forward (or ran out of memory) breaks the rest too
    row["fwd_per_gemm"] = row["fwd_ms"] / gemm_ms

    # Forward + backward: x and W leaves requiring grad; grads set to None before each
    # call (untimed) so every call allocates dx and dW afresh, as a training step does.
    xg, wg, setup = grad_leaves(x, w)

    def step():
        loss = fn(xg, wg, t)
        loss.backward()
        return loss

    def fwdbwd():
        ms, row["fwdbwd_spread"] = timing.time_ms_spread(step, device=dev, setup=setup, **tm)
        return ms

    row["fwdbwd_ms"] = phase(row, "forward+backward", dev, fwdbwd)
    if row["fwdbwd_ms"] is None:
        setup()
        return
    row["fwdbwd_per_3gemm"] = row["fwdbwd_ms"] / (3 * gemm_ms)

    # One more call: peak memory beyond inputs and the two gradients, then the errors
    # of that call's loss and gradients against the float64 reference.
    grads_bytes = xg.numel() * xg.element_size() + wg.numel() * wg.element_size()
    if memory_and_loss(row, step, setup, dev, grads_bytes) and ref is not None:
        ref_loss, ref_dx, ref_dw = ref
        row["loss_abs_err"] = abs(row["loss"] - ref_loss)
        if xg.grad is None or wg.grad is None:
            row["errors"].append("errors: the method gave no gradient for x or W")
        else:
            row["dx_rel_err"] = phase(row, "dx error", dev, lambda: reference.rel_err(xg.grad, ref_dx))
            row["dw_rel_err"] = phase(row, "dW error", dev, lambda: reference.rel_err(wg.grad, ref_dw))
    setup()  # drop the gradients


def predict(shape, method, device) -> dict:
    """The planner's choice and predicted times for a logitless row (``planning.cost_model``);
    {} for peers. Off a GPU the H100 constants are used (a label, not a prediction)."""
    if method.peer or not method.name.startswith("logitless"):
        return {}
    from logitless.ops.common.validate import default_memory_budget
    from logitless.planning import plans as _plans

    from .peers import budget_bytes

    spec = method.name.split("@", 1)[1] if "@" in method.name else "default"
    itemsize = torch.empty(0, dtype=getattr(torch, shape.dtype)).element_size()
    budget = budget_bytes(spec, shape.tokens, shape.vocab, itemsize)
    dev = torch.device(device)
    budget = default_memory_budget(dev) if budget is None else budget  # the call's (3% of a GPU)
    grad = _plans.lce_strategy(shape.tokens, shape.vocab, shape.hidden, itemsize, budget, dev)
    fwd = _plans.lce_strategy(shape.tokens, shape.vocab, shape.hidden, itemsize, budget, dev, need_grad=False)
    from logitless.planning.cost_model import device_model

    return {"pred_strategy": grad.label, "pred_ms": grad.ms, "pred_fwd_ms": fwd.ms,
            "pred_memory_mib": grad.memory / 2**20, "pred_model": device_model(dev).name,
            "pred_off_device": dev.type != "cuda"}


def _safe_predict(shape, method, device) -> dict:
    try:
        return predict(shape, method, device)
    except Exception as exc:  # noqa: BLE001 - a prediction never stops the benchmark
        return {"pred_error": describe(exc)}


def prepare(shape, cfg: Config, results: report.Results):
    """Inputs, the GEMM unit and the float64 reference of one shape."""
    x, w, t = make_inputs(shape, cfg.device, cfg.seed)
    unit = timing.gemm_unit(x, w, warmup=cfg.warmup, reps=cfg.reps)
    results.record_unit(shape.name, unit)
    gemm_ms = unit.ms
    ref = None
    if cfg.errors:
        try:
            ref = reference.lce_reference(x, w, t)
        except Exception as exc:  # noqa: BLE001 - run on without the error columns
            results.note(f"{shape.name}: float64 reference failed ({describe(exc)}); no error columns")
            timing.release_memory(cfg.device)
    return x, w, t, gemm_ms, ref


def run(shapes, methods, cfg: Config, results: report.Results) -> report.Results:
    dev = cfg.device
    copy = timing.copy_unit(dev, warmup=cfg.warmup, reps=cfg.reps)
    results.record_unit(None, copy, used=False)  # not used by this suite; recorded for the record
    progress = Progress(len(shapes) * len(methods), "lce")
    for shape in shapes:
        info = {"tokens": shape.tokens, "hidden": shape.hidden, "vocab": shape.vocab, "dtype": shape.dtype,
                "label": shape.label, "gemm_ms": None, "ref_loss": None}
        x = w = t = ref = gemm_ms = None
        setup_error = None
        try:
            x, w, t, gemm_ms, ref = prepare(shape, cfg, results)
            info["gemm_ms"] = gemm_ms
            info["ref_loss"] = ref[0] if ref is not None else None
            progress.write(f"== lce {shape.label} {shape.dtype}: {report.unit_text(results.data, shape.name)}")
        except Exception as exc:  # noqa: BLE001 - e.g. the inputs do not fit: skip the shape
            setup_error = f"inputs or GEMM unit failed: {describe(exc)}"
            progress.write(f"== lce {shape.label}: {setup_error}")
            timing.release_memory(dev)
        results.set_shape(shape.name, info)

        run_methods("lce", shape, methods, cfg, results, progress,
                    lambda fn, method, row: (row.update(_safe_predict(shape, method, dev)),
                                             measure(fn, x, w, t, gemm_ms, ref, cfg, row)),  # noqa: F821 (deleted below, after use)
                    skip_reason=setup_error, extra={"gemm_ms": gemm_ms})
        del x, w, t, ref
        timing.release_memory(dev)
        results.save()  # after every shape: a killed run keeps what it measured
    progress.close()
    return results
