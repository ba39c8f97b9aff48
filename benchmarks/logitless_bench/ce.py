"""Suite ``ce``: cross-entropy on materialised (N, V) logits (issue 4), a memory-bound op.

The unit is the device's copy bandwidth measured in the same run. The bytes a method
must move: forward reads the logits once (N*V*s bytes); forward+backward also reads
them once more and writes the gradient once (3*N*V*s in all). Achieved bandwidth =
those bytes / time, also given as a fraction of the copy bandwidth.
"""

from __future__ import annotations

import torch

from . import reference, report, timing
from .runner import Config, Progress, describe, memory_and_loss, phase, run_methods


def measure(fn, logits, t, clobbers: bool, copy_bps: float, ref_loss, cfg: Config, row: dict) -> None:
    """Fills ``row`` with the metrics of loss function ``fn(logits, t)``."""
    dev, tm = cfg.device, dict(warmup=cfg.warmup, reps=cfg.reps)
    nbytes = logits.numel() * logits.element_size()

    def restore():  # untimed: methods that write into the logits get them back
        reference.fill_logits(logits, cfg.seed)

    restore()  # the previous method may have overwritten them
    maybe_restore = restore if clobbers else None

    def forward():
        with torch.no_grad():
            return timing.time_ms(lambda: fn(logits, t), device=dev, setup=maybe_restore, **tm)

    row["fwd_ms"] = phase(row, "forward", dev, forward)
    if row["fwd_ms"] is None:
        return  # what broke the forward (or ran out of memory) breaks the rest too
    _bandwidth(row, "fwd", nbytes, copy_bps)

    lg = logits.detach().requires_grad_(True)  # same storage, a leaf that wants a gradient

    def setup():
        lg.grad = None
        if clobbers:
            restore()

    def step():
        loss = fn(lg, t)
        loss.backward()
        return loss

    row["fwdbwd_ms"] = phase(row, "forward+backward", dev, lambda: timing.time_ms(step, device=dev, setup=setup, **tm))
    if row["fwdbwd_ms"] is None:
        lg.grad = None
        return
    _bandwidth(row, "fwdbwd", 3 * nbytes, copy_bps)

    if memory_and_loss(row, step, setup, dev, nbytes) and ref_loss is not None:
        row["loss_abs_err"] = abs(row["loss"] - ref_loss)
        if lg.grad is None:
            row["errors"].append("errors: the method gave no gradient")
        else:
            row["grad_rel_err"] = phase(row, "grad error", dev,
                                        lambda: reference.ce_grad_rel_err(lg.grad, cfg.seed, t))
    lg.grad = None


def _bandwidth(row: dict, key: str, moved: int, copy_bps: float) -> None:
    """Achieved bandwidth of phase ``key`` ("fwd"/"fwdbwd"), which must move ``moved`` bytes."""
    bps = moved / (row[f"{key}_ms"] * 1e-3)
    row[f"{key}_GBps"] = bps / 1e9
    row[f"{key}_frac_copy"] = bps / copy_bps


def run(cases, methods, cfg: Config, results: report.Results) -> report.Results:
    dev = cfg.device
    copy = timing.copy_unit(dev, warmup=cfg.warmup, reps=cfg.reps)
    results.record_unit(None, copy)
    copy_bps = copy.rate
    progress = Progress(len(cases) * len(methods), "ce")
    progress.write(f"== ce: device-to-device copy: {report.unit_text(results.data, None)}")
    if not timing.is_cuda(dev):
        results.note("on one CPU thread cross-entropy is bound by its exp, not by memory (an exp of the logits alone "
                     "takes longer than their copy), so the % of copy columns compare compute here; the peak MiB "
                     "and error columns hold on any device. The bandwidth-bound kernels are measured on a GPU.")
    for case in cases:
        dtype = getattr(torch, case.dtype)
        nbytes = case.tokens * case.vocab * torch.empty(0, dtype=dtype).element_size()
        info = {"tokens": case.tokens, "vocab": case.vocab, "dtype": case.dtype, "label": case.label,
                "logits_mib": nbytes / 2**20, "ref_loss": None}
        skip_reason = None
        if timing.is_cuda(dev):
            free, _ = torch.cuda.mem_get_info(dev)
            if 2 * nbytes > 0.9 * free:  # the logits and their gradient
                skip_reason = f"logits + gradient need {2 * nbytes / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free"
        logits = t = None
        if skip_reason is None:
            try:
                logits = torch.empty(case.tokens, case.vocab, dtype=dtype, device=dev)
                reference.fill_logits(logits, cfg.seed)
                g = torch.Generator(device=dev)
                g.manual_seed(cfg.seed + 1)
                t = torch.randint(0, case.vocab, (case.tokens,), generator=g, device=dev)
                if cfg.errors:
                    info["ref_loss"] = reference.ce_reference_loss(case.tokens, case.vocab, dtype, dev, cfg.seed, t)
            except Exception as exc:  # noqa: BLE001 - skip the case, not the run
                skip_reason = f"inputs or reference failed: {describe(exc)}"
                logits = t = None
                timing.release_memory(dev)
        results.set_shape(case.name, info)
        progress.write(f"== ce {case.label}: logits {nbytes / 2**20:.0f} MiB")

        run_methods("ce", case, methods, cfg, results, progress,
                    lambda fn, method, row: measure(fn, logits, t, method.clobbers_input, copy_bps,  # noqa: F821 (deleted below, after use)
                                                    info["ref_loss"], cfg, row),
                    skip_reason=skip_reason, extra={"logits_mib": nbytes / 2**20})
        del logits, t
        timing.release_memory(dev)
        results.save()
    progress.close()
    return results
