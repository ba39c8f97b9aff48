"""Suite ``precision``: fp32 inputs and autocast, the ways users call the loss in training.

Per LM-head shape three modes, each its own case (and its own GEMM unit):

    fp32-highest   x, W fp32, torch.set_float32_matmul_precision("highest") (torch's
                   default): unit = one cuBLAS fp32 GEMM (no TF32)
    fp32-high      the same at "high" (TF32 allowed, as most training scripts set it):
                   unit = one cuBLAS GEMM at "high" (TF32)
    autocast-bf16  fp32 W and fp32 hidden state called under torch.autocast(bf16), as a
                   Llama under HF Trainer(bf16=True) calls its head: unit = one bf16 GEMM

Methods: ``logitless`` (the public API, no casts), ``logitless-tf32-in-kernel``
(fp32-high rows only: rounding in the kernels' registers, as before issue 23 item 2) and ``torch-eager``
(``F.cross_entropy(x @ W.T, y)``; under autocast ``F.cross_entropy(head(h).float(), y)``).
Rows have the lce suite's columns (``lce.measure``: fwd and fwd+bwd time and their
ratios to 1 and 3 GEMMs of the case's unit, peak extra memory, errors against one
float64 reference per shape), so the report formats them alike.
"""

from __future__ import annotations

import contextlib
import fnmatch
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import lce, reference, report, timing
from .peers import Method, Skip
from .runner import Config, Progress, describe, run_methods
from .shapes import LceShape

MODES = ("fp32-highest", "fp32-high", "autocast-bf16")


@dataclass(frozen=True)
class PrecisionCase:
    shape: str  # a name for the LM-head shape
    tokens: int
    hidden: int
    vocab: int
    mode: str  # one of MODES
    dtype: str = "float32"  # the inputs' dtype (fp32 in every mode)

    @property
    def name(self) -> str:
        return f"{self.shape}-{self.mode}"

    @property
    def label(self) -> str:
        return f"{self.shape} ({self.tokens}, {self.hidden}, {self.vocab}) {self.mode}"

    @property
    def matmul_precision(self):
        return {"fp32-highest": "highest", "fp32-high": "high"}.get(self.mode)


GPU_SHAPES = (("2048x2048x32000", 2048, 2048, 32000), ("4096x2048x128256", 4096, 2048, 128256),
              ("llama3.1-8b", 4096, 4096, 128256))
CPU_SHAPES = (("cpu-tiny", 256, 64, 1000),)


def cases(cpu: bool, patterns=(), quick: bool = False):
    """Every (shape, mode) of the machine, those matching --shapes patterns if given."""
    out = [PrecisionCase(s, n, h, v, m) for s, n, h, v in (CPU_SHAPES if cpu else GPU_SHAPES) for m in MODES]
    if patterns:
        out = [c for c in out if any(fnmatch.fnmatchcase(c.name, p) or fnmatch.fnmatchcase(c.shape, p)
                                     for p in patterns)]
    return out[: len(MODES)] if quick else out


@contextlib.contextmanager
def matmul_precision(setting):
    """torch.set_float32_matmul_precision(setting) for the block (None: unchanged)."""
    if setting is None:
        yield
        return
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(setting)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


def _autocast(case, device):
    if case.mode != "autocast-bf16":
        return contextlib.nullcontext()
    return torch.autocast(torch.device(device).type, dtype=torch.bfloat16)


def _logitless(case, device):
    from logitless import linear_cross_entropy

    def fn(x, w, t):
        with _autocast(case, device):
            return linear_cross_entropy(x, w, t)
    return fn


def _logitless_in_kernel(case, device):
    """The fp32-high rows only: operands rounded to TF32 in the kernels' registers (the
    path before issue 23 item 2) instead of rounded into scratch buffers beforehand."""
    if torch.device(device).type != "cuda":
        raise Skip("needs a CUDA GPU (the Triton backend)")
    if case.mode != "fp32-high":
        raise Skip("only at matmul precision 'high' (TF32)")
    from logitless import linear_cross_entropy
    from logitless.planning.overrides import override

    def fn(x, w, t):
        with override(tf32_preround=False):
            return linear_cross_entropy(x, w, t)
    return fn


def _torch_eager(case, device):
    def fn(x, w, t):
        with _autocast(case, device):
            # Under autocast F.linear runs in bf16; users upcast the logits for the loss.
            return F.cross_entropy(F.linear(x, w).float(), t)
    return fn


def methods():
    return [
        Method("logitless", _logitless, peer=False,
               description="logitless.linear_cross_entropy(h, W, y) on the fp32 tensors, no casts "
                           "(under autocast in the autocast rows)"),
        Method("logitless-tf32-in-kernel", _logitless_in_kernel, peer=False, gpu_only=True,
               description="fp32-high rows: logitless rounding the operands to TF32 in the kernels' registers "
                           "(before issue 23 item 2) instead of into scratch buffers first"),
        Method("torch-eager", _torch_eager,
               description="F.cross_entropy(F.linear(h, W).float(), y): fp32 logits at the matmul precision "
                           "setting; under autocast bf16 logits upcast to fp32"),
    ]


def _unit(case, x, w, cfg: Config) -> timing.Unit:
    """One GEMM of the case's kind: fp32 at its precision setting, or bf16 for autocast."""
    if case.mode == "autocast-bf16":
        xb, wb = x.bfloat16(), w.bfloat16()
        try:
            return timing.gemm_unit(xb, wb, warmup=cfg.warmup, reps=cfg.reps)
        finally:
            del xb, wb
    return timing.gemm_unit(x, w, warmup=cfg.warmup, reps=cfg.reps)


def run(all_cases, method_list, cfg: Config, results: report.Results) -> report.Results:
    dev = cfg.device
    progress = Progress(len(all_cases) * len(method_list), "precision")
    by_shape: dict = {}
    for c in all_cases:
        by_shape.setdefault(c.shape, []).append(c)
    for shape_cases in by_shape.values():
        first = shape_cases[0]
        x = w = t = ref = None
        setup_error = None
        try:
            shape = LceShape(first.shape, first.tokens, first.hidden, first.vocab, "float32")
            x, w, t = lce.make_inputs(shape, dev, cfg.seed)
            if cfg.errors:
                try:
                    ref = reference.lce_reference(x, w, t)
                except Exception as exc:  # noqa: BLE001
                    results.note(f"{first.shape}: float64 reference failed ({describe(exc)}); no error columns")
                    timing.release_memory(dev)
        except Exception as exc:  # noqa: BLE001 - the inputs do not fit: skip the shape
            setup_error = f"inputs failed: {describe(exc)}"
            timing.release_memory(dev)
        for case in shape_cases:
            info = {"tokens": case.tokens, "hidden": case.hidden, "vocab": case.vocab, "dtype": "float32",
                    "mode": case.mode, "label": case.label, "gemm_ms": None,
                    "ref_loss": ref[0] if ref is not None else None}
            err = setup_error
            gemm_ms = None
            with matmul_precision(case.matmul_precision):
                if err is None:
                    try:
                        unit = _unit(case, x, w, cfg)
                        gemm_ms = info["gemm_ms"] = unit.ms
                        results.record_unit(case.name, unit)
                        progress.write(f"== precision {case.label}: {report.unit_text(results.data, case.name)}")
                    except Exception as exc:  # noqa: BLE001
                        err = f"GEMM unit failed: {describe(exc)}"
                        timing.release_memory(dev)
                results.set_shape(case.name, info)
                run_methods("precision", case, method_list, cfg, results, progress,
                            lambda fn, method, row: lce.measure(fn, x, w, t, gemm_ms, ref, cfg, row),  # noqa: F821 (deleted below, after use)
                            skip_reason=err, extra={"gemm_ms": gemm_ms, "mode": case.mode})
            results.save()  # after every case: a killed run keeps what it measured
        del x, w, t, ref
        timing.release_memory(dev)
    progress.close()
    return results


__all__ = ["PrecisionCase", "MODES", "cases", "methods", "run", "Skip"]
