"""When the forward statistics run on the CuTe DSL Hopper kernel (``cute_lib``), and how.

``forward_plan(x, weight, ...)`` returns a ``CutePlan`` (vocabulary splits, pipeline) or
None (the Triton kernel runs). It says "CuTe" only when all of these hold:

  * not turned off: ``override(cute=False)``, or the environment variable
    ``LOGITLESS_CUTE=0`` (read per call; ``override(cute=True)`` ignores it), or an
    override aimed at the Triton plan (tiles, plan, kernel_options, strategy);
  * a CUDA device of compute capability 9.x (sm_90a: wgmma, TMA, setmaxnreg);
  * the DSL is importable (``cutlass.cute``, from the optional ``nvidia-cutlass-dsl``
    4.2.1: ``pip install logitless[hopper]``), checked lazily once per process, never
    at ``import logitless``; ``override(cute_available=...)`` replaces the check (tests);
  * x and W of one dtype, bfloat16 or float16, row-major with unit last stride and
    16-byte aligned, H % 8 == 0 (TMA's 16-byte stride rule), N >= 1, V >= 1;
  * options the kernel computes: no bias, no soft-cap, no argmax, no class weights
    inside the kernel (the weighted smoothing sum), and no kept columns (the plan's
    ``keep_cols`` == 0: no gradient to come, or a budget below one kept tile).

Splits: the kernel runs one CTA per (128-row block, split) and one CTA per SM (193 KiB of
shared memory), without a persistent scheduler. Measured on the H100 (2026-11-23,
``benchmarks/gpu/cute_forward.sh``): about two full waves is best, 4096 x 4096 x 128256
splits 8 (256 CTAs) 0.96-0.98x cuBLAS vs splits 4 and 16 worse, 8192 x 7168 x 128256
splits 4 (256 CTAs) 0.98x vs splits 8 (512 CTAs) 1.41x, splits 1 1.5-2.9x (too few
CTAs). So splits = floor(2 * SMs / row blocks), at least 1, at most the vocabulary's
256-column tiles.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
from dataclasses import dataclass
from typing import Optional

from logitless.planning.overrides import current as _overrides

ENV = "LOGITLESS_CUTE"
TILE_M, TILE_N = 128, 256
WAVES = 2


@dataclass(frozen=True)
class CutePlan:
    splits: int
    stages: int = 4
    specialised: bool = True


@functools.cache
def dsl_importable() -> bool:
    """Whether ``cutlass.cute`` and the CUDA driver bindings import (once per process)."""
    if importlib.util.find_spec("cutlass") is None:
        return False
    try:
        importlib.import_module("cutlass.cute")
        importlib.import_module("cuda.bindings.driver")
    except Exception:  # noqa: BLE001  (a broken or partial install means: not available)
        return False
    return True


def splits_for(n: int, v: int, num_sms: int) -> int:
    """Vocabulary splits for N rows and V columns on ``num_sms`` SMs: about WAVES full
    waves of CTAs (module docstring), at least 1, at most ceil(V / 256)."""
    row_blocks = -(-n // TILE_M)
    v_tiles = -(-v // TILE_N)
    return max(1, min(v_tiles, (WAVES * num_sms) // row_blocks))


def unsupported(*, capability: tuple, available: bool, dtype: str, n: int, v: int, h: int,
                layout_ok: bool, bias: bool = False, softcap: bool = False, argmax: bool = False,
                weighted_smooth: bool = False, keep_cols: int = 0) -> Optional[str]:
    """Why the CuTe kernel cannot run this call (a short reason), or None when it can.
    Pure: every fact is an argument (tests call it without a GPU or the DSL)."""
    if capability is None or capability[0] != 9:
        return f"needs compute capability 9.x, got {capability}"
    if not available:
        return "nvidia-cutlass-dsl (cutlass.cute) not importable"
    if dtype not in ("bfloat16", "float16"):
        return f"dtype {dtype} (bfloat16 or float16 only)"
    if n < 1 or v < 1:
        return "empty input"
    if h < 8 or h % 8:
        return f"hidden size {h} not a multiple of 8"
    if not layout_ok:
        return "x or weight not row-major contiguous and 16-byte aligned"
    for flag, what in ((bias, "bias"), (softcap, "softcap"), (argmax, "argmax"),
                       (weighted_smooth, "class-weighted label smoothing")):
        if flag:
            return f"{what} not in the CuTe kernel"
    if keep_cols:
        return "the plan keeps columns for the backward"
    return None


def env_off() -> bool:
    """``LOGITLESS_CUTE=0`` (or false/off/no) in the environment."""
    return os.environ.get(ENV, "").strip().lower() in ("0", "false", "off", "no")


def enabled(ov, env_is_off: bool) -> bool:
    """The switch alone: ``override(cute=...)`` first; unset, the environment variable, and
    an override that shapes the Triton plan (tiles, plan, kernel_options, strategy: a
    test or probe aimed at the Triton kernel) keeps the Triton kernel."""
    if ov.cute is not None:
        return bool(ov.cute)
    if env_is_off:
        return False
    return ov.tiles is None and ov.plan is None and ov.kernel_options is None and ov.strategy is None


def choose(*, capability, available: bool, num_sms: int, dtype: str, n: int, v: int, h: int, layout_ok: bool,
           ov=None, env_is_off: bool = False, **options) -> Optional[CutePlan]:
    """The decision from explicit facts (``unsupported``'s, the SM count, the overrides
    ``ov`` and the environment switch): a ``CutePlan`` or None. Pure (tests)."""
    ov = ov if ov is not None else _overrides()
    if not enabled(ov, env_is_off):
        return None
    if ov.cute_available is not None:
        available = ov.cute_available
    if unsupported(capability=capability, available=available, dtype=dtype, n=n, v=v, h=h, layout_ok=layout_ok,
                   **options) is not None:
        return None
    return CutePlan(splits=splits_for(n, v, num_sms))


def forward_plan(x, weight, *, keep_cols: int = 0, bias=None, softcap=None, need_argmax: bool = False,
                 weighted_smooth: bool = False) -> Optional[CutePlan]:
    """The CuTe plan of one forward (module docstring), or None: the Triton kernel runs."""
    ov = _overrides()
    if x.device.type != "cuda" or not enabled(ov, env_off()):  # cheap exits first
        return None
    import torch

    capability = tuple(torch.cuda.get_device_capability(x.device))
    if capability[0] != 9:  # no DSL import off Hopper
        return None
    available = ov.cute_available if ov.cute_available is not None else dsl_importable()
    n, h = x.shape
    v = weight.shape[0]
    layout_ok = (x.dtype == weight.dtype and x.stride() == (h, 1) and weight.stride() == (h, 1)
                 and x.data_ptr() % 16 == 0 and weight.data_ptr() % 16 == 0)
    from logitless.planning.plans import num_sms

    return choose(capability=capability, available=available, num_sms=num_sms(x.device),
                  dtype=str(x.dtype).removeprefix("torch."), n=n, v=v, h=h, layout_ok=layout_ok, ov=ov,
                  bias=bias is not None, softcap=softcap is not None, argmax=need_argmax,
                  weighted_smooth=weighted_smooth, keep_cols=keep_cols)
