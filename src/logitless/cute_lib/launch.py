"""Torch side of the CuTe DSL kernels: launch ``forward_stats`` on torch tensors.

Imported only when ``planning.cute.forward_plan`` chose the CuTe kernel (it imports
cutlass). The kernel runs on torch's current CUDA stream (CUDA-graph capture and
torch.compile'd steps see an ordinary kernel launch; the first call per configuration
compiles, ~1 s: warm up before capturing a graph). No host sync.

``ready`` is the last gate before the kernel: it compiles the configuration and launches
it once on one row (scratch outputs) the first time a configuration is planned; if the
import, the compile or that launch raises (a DSL release whose API moved, a driver that
cannot load the module), the configuration is marked failed for the process, one
``planning.cute.CuteFallbackWarning`` names the cause, and the caller runs the Triton
forward. (A fault inside the kernel on the device is asynchronous: no host-side check
short of a sync could catch it, and the context would be lost anyway.)
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch
from torch import Tensor

from logitless.planning import cute as _planning

#: compile key -> None (compiled and launched once) or the failure's text (the Triton path)
_STATE: dict = {}


def _key(x: Tensor, plan, smooth: bool, entropy: bool, keep_block: int) -> tuple:
    return (x.shape[1], str(x.dtype).removeprefix("torch."), smooth, entropy, plan.stages, plan.specialised,
            plan.group, keep_block)


def ready(plan, x: Tensor, weight: Tensor, *, smooth: bool = False, entropy: bool = False,
          keep_block: int = 0):
    """``plan`` if the kernel of this configuration compiles and launches (decided once per
    process and configuration: module docstring), else None (the Triton forward runs;
    one warning per cause). ``smooth``, ``entropy`` and ``keep_block`` as ``forward_partials``
    will get them (keep_block 0: no kept columns)."""
    key = _key(x, plan, smooth, entropy, keep_block)
    state = _STATE.get(key, False)
    if state is None:
        return plan
    if state is False:
        state = _first_launch(key, plan, x, weight, smooth, entropy, keep_block)
        _STATE[key] = state
    if state is not None:
        _planning.warn_fallback(state)
        return None
    return plan


def _first_launch(key, plan, x, weight, smooth, entropy, keep_block) -> Optional[str]:
    """Compile ``key`` and launch it on x's and W's first rows into scratch outputs; None,
    or the failure's text."""
    stage = "import"
    try:
        from . import forward_stats as fs

        stage = "compile"
        fs.compile_forward(*key)
        stage = "launch"
        f32 = dict(dtype=torch.float32, device=x.device)
        parts = torch.empty(5, 1, 1, **f32)
        target = torch.full((1,), -1, dtype=torch.int32, device=x.device)
        keep = None
        if keep_block:
            keep = (torch.empty(1, 8, dtype=x.dtype, device=x.device), torch.empty(1, 1, **f32), keep_block)
        _launch(fs, key, x[:1], weight[:1], target, tuple(parts[:3]), 1, scale=1.0,
                smooth=parts[3] if smooth else None, entropy=parts[4] if entropy else None, keep=keep)
    except Exception as e:  # noqa: BLE001  (any failure of the optional kernel: the Triton path)
        version = _planning.dsl_version()
        return (f"the kernel failed to {stage} with {_planning.DSL_DIST} {version}: "
                f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200] if str(e).strip() else ''}")
    return None


def forward_partials(op: str, x: Tensor, weight: Tensor, target: Tensor, parts, splits: int, *,
                     scale: float = 1.0, smooth: Optional[Tensor] = None, entropy: Optional[Tensor] = None,
                     stages: int = 4, specialised: bool = True, group: int = 0,
                     keep: Optional[tuple] = None) -> None:
    """Fill ``parts`` = (max, sum, target) (each (splits, N) fp32, ``triton_lib.launch.
    partials``) and the optional ``smooth`` (sum of a) and ``entropy`` (sum e (a - m))
    partials of a = scale * x W^T over ``splits`` vocabulary splits (``forward_stats``).
    x (N, H), weight (V, H): bf16/fp16, contiguous, 16-byte aligned (the planner checked).
    ``keep`` = (keep, keep_max, keep_block): the forward also keeps exp(a - m) for the
    first keep.shape[1] columns into ``keep`` ((N, keep_cols) view, unit column stride,
    x's dtype) and the maxima m into ``keep_max`` ((ceil(keep_cols / keep_block), N) fp32),
    as ``triton_lib.launch.keep_buffers`` lays them out (the Triton backward reads them)."""
    from . import forward_stats as fs

    dtype = str(x.dtype).removeprefix("torch.")
    keep_block = keep[2] if keep is not None else 0
    key = (x.shape[1], dtype, smooth is not None, entropy is not None, stages, specialised, group, keep_block)
    tgt = target if target.dtype == torch.int32 and target.is_contiguous() else target.to(torch.int32).contiguous()
    _launch(fs, key, x, weight, tgt, parts, splits, scale=scale, smooth=smooth, entropy=entropy, keep=keep, op=op)


def _launch(fs, key, x, weight, tgt, parts, splits, *, scale, smooth, entropy, keep, op=None) -> None:
    """One launch of the compiled ``key``; ``op``: the op that launches it (None: ``ready``'s
    first launch on one row). Tests wrap this function to see which launches ran."""
    n, h = x.shape
    v = weight.shape[0]
    dtype = key[1]
    compiled = fs.compile_forward(*key)
    part_max, part_sum, part_tgt = parts
    addrs = [p.data_ptr() for p in (part_max, part_sum, part_tgt,
                                    smooth if smooth is not None else part_max,
                                    entropy if entropy is not None else part_max)]
    cuda = x.device.type == "cuda"  # (False only in CPU tests of ``ready`` with a fake kernel module)
    stream = torch.cuda.current_stream(x.device).cuda_stream if cuda else 0
    with torch.cuda.device(x.device) if cuda else contextlib.nullcontext():
        kept = (0, 0, 0, 0)
        if keep is not None:
            kbuf, kmax, _ = keep
            kept = (kbuf.data_ptr(), kmax.data_ptr(), kbuf.shape[1], kbuf.stride(0))
        fs.launch(compiled, x.data_ptr(), weight.data_ptr(), tgt.data_ptr(), addrs, float(scale), n, v, splits,
                  stream, dtype, kept)
