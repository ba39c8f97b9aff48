"""``memory_budget=None`` of the JAX ops: the device's default budget, the PyTorch ops' rule.

On a GPU, ``options.GPU_BUDGET_SHARE`` (3%) of the device's total memory, in whole MiB and
at least ``options.DEFAULT_MEMORY_BUDGET`` (256 MiB); on every other device (CPU, TPU)
``DEFAULT_MEMORY_BUDGET``. Resolved once per call, at trace time (a static int, part of
the call's one plan), never from free memory: the plan and every bit of the result are the
same in every run.

The total memory of a JAX GPU: JAX exposes no physical size (a GPU device's attributes
are its kind, compute capability, core count and shared memory), so the total is
``device.memory_stats()["bytes_limit"]``: the memory JAX's allocator may use on the device,
fixed when the backend starts (the device's total memory times ``XLA_CLIENT_MEM_FRACTION``,
formerly ``XLA_PYTHON_CLIENT_MEM_FRACTION``; 75% by default, whose 3% is 1.8 GiB on an
H100 80 GB), never what is free. Read once per device. A GPU whose allocator reports no
limit (no stats, as may be the case with ``XLA_PYTHON_CLIENT_ALLOCATOR=platform``) gets
``DEFAULT_MEMORY_BUDGET``.

The device: ``jax.devices()[0]``, the one the automatic backend choice looks at
(``ops/common/choice.py``): under ``jax.jit`` the arrays are tracers that name no device.
Sharded calls (a sharded ``jax.jit``, an Explicit mesh, ``jax.shard_map``) resolve it once
for the call and each device plans its own shard under that budget: the budget is per
device.

TPU: ``DEFAULT_MEMORY_BUDGET``. Its automatic backend, "mosaic_tpu", sizes VMEM tiles from
min(budget, 48 MiB) (``mosaic_tpu_lib.VMEM_LIMIT``), the same as for its own None, so a
larger default would change nothing there; the "xla" backend on a TPU keeps 256 MiB (the
GPU share was measured on GPUs only).
"""

from __future__ import annotations

from typing import Any, Optional

import jax

from logitless.options import DEFAULT_MEMORY_BUDGET, budget_of_total_memory, check_memory_budget

__all__ = ["default_memory_budget", "resolve_memory_budget", "total_memory"]

#: (platform, device id) -> the device's total memory in bytes, or None where it reports
#: none (a device property: read once per device).
_TOTAL_MEMORY: dict = {}


def _default_device() -> Optional[Any]:
    try:
        return jax.devices()[0]
    except RuntimeError:  # no backend initialises
        return None


def total_memory(device) -> Optional[int]:
    """The memory JAX may use on ``device``, in bytes (``memory_stats()["bytes_limit"]``,
    read once per device); None where the device reports none."""
    key = (device.platform, device.id)
    if key not in _TOTAL_MEMORY:
        try:
            stats = device.memory_stats()
        except (RuntimeError, NotImplementedError):
            stats = None
        limit = (stats or {}).get("bytes_limit")
        _TOTAL_MEMORY[key] = int(limit) if limit else None
    return _TOTAL_MEMORY[key]


def default_memory_budget(device=None) -> int:
    """``memory_budget=None`` of ``linear_cross_entropy`` and ``linear_log_probs`` on
    ``device`` (None: ``jax.devices()[0]``): ``GPU_BUDGET_SHARE`` of a GPU's total memory
    (``total_memory``; whole MiB, at least ``DEFAULT_MEMORY_BUDGET``);
    ``DEFAULT_MEMORY_BUDGET`` on other devices and on a GPU that reports no total."""
    if device is None:
        device = _default_device()
    if device is None or device.platform != "gpu":
        return DEFAULT_MEMORY_BUDGET
    total = total_memory(device)
    return DEFAULT_MEMORY_BUDGET if total is None else budget_of_total_memory(total)


def resolve_memory_budget(value: Optional[int]) -> int:
    """A JAX op's ``memory_budget=``: a positive int as given (else ValueError), None the
    device's default (``default_memory_budget``)."""
    return default_memory_budget() if value is None else check_memory_budget(value)
