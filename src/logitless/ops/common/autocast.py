"""Autocast as ``F.linear`` has it, for the public ops (shared by every op).

Under ``torch.autocast(device_type, dtype)`` enabled for the inputs' device, the public
function casts its floating inputs to the autocast dtype with ``Tensor.to`` (autograd
records the cast, so an fp32 parameter still gets an fp32 gradient; nothing is cached
between calls), then calls the custom op. Inside the ops' implementations autocast is
switched off (``disabled``), so that the fp32 statistics stay fp32.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch
from torch import Tensor

#: Dtypes autocast casts (as torch's autocast: float64 is left alone).
_CASTABLE = (torch.float16, torch.bfloat16, torch.float32)


def autocast_dtype(device: torch.device) -> Optional[torch.dtype]:
    """The autocast dtype when autocast is enabled for this device type, else None."""
    device_type = device.type
    if device_type not in ("cuda", "cpu", "xpu", "mps", "hpu", "xla"):
        return None
    if not torch.is_autocast_enabled(device_type):
        return None
    return torch.get_autocast_dtype(device_type)


def cast(t: Optional[Tensor], dtype: Optional[torch.dtype]) -> Optional[Tensor]:
    """``t.to(dtype)`` for a castable floating tensor (a no-op for others and None)."""
    if t is None or dtype is None or t.dtype not in _CASTABLE or t.dtype == dtype:
        return t
    return t.to(dtype)


def cast_like_linear(*tensors: Optional[Tensor]) -> tuple:
    """The tensors as ``F.linear`` sees them under autocast (the device of the first
    tensor decides), unchanged outside autocast."""
    first = tensors[0] if tensors[0] is not None else next(t for t in tensors if t is not None)
    amp = autocast_dtype(first.device)
    if amp is None:  # outside autocast (the common case): no per-tensor call
        return tensors
    return tuple([cast(t, amp) for t in tensors])


def disabled(device: torch.device):
    """Context in which ops on ``device`` run in their inputs' dtypes (no autocast)."""
    if device.type in ("cuda", "cpu", "xpu", "mps", "hpu") and torch.is_autocast_enabled(device.type):
        return torch.autocast(device.type, enabled=False)
    return contextlib.nullcontext()
