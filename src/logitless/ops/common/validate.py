"""Input checks shared by every public op: clear errors instead of wrong numbers, and
which backend of an op's table runs a call (``resolve_backend``).

Checks here never synchronise with a GPU. The one data-dependent check (targets in
range) runs only on CPU tensors, where it is cheap; on GPUs an out-of-range target
yields NaN for that token instead (see ``formulas.cross_entropy``). The checks of the
scalar options are in ``logitless.options``.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Optional

import torch
from torch import Tensor

from logitless.distributed.dtensor import dtensor_type as _dtensor_type
from logitless.options import (
    _CHECK_TARGETS_ON_GPU,  # (a list read in place: no call on the hot path)
    DEFAULT_MEMORY_BUDGET,
    budget_of_total_memory,
    check_memory_budget,
)

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
TARGET_DTYPES = (torch.int64, torch.int32)


#: Whether triton is installed (decided once, at import).
HAS_TRITON = importlib.util.find_spec("triton") is not None


def resolve_backend(name: str, device: torch.device, dtype: torch.dtype, table) -> str:
    """The backend of a call, from the op's table (``contract.BackendTable``), or a clear error.

    "auto": the first backend, in the table's order, that the automatic choice may pick on
    this device (its ``automatic_on``) and whose ``unsupported(device, dtype)`` is None
    (Triton for CUDA tensors of 16/32-bit floats when triton is installed, else PyTorch).
    An explicit name runs as asked, or raises its backend's ``unsupported`` error (e.g.
    "triton" without the triton package, on float64, or on CPU tensors without
    TRITON_INTERPRET=1)."""
    entries = table.entries
    if name == "auto":
        for candidate, entry in entries.items():
            kind = getattr(entry, "kind", entry)  # (a ``contract.Lazy`` entry, or the class)
            if kind.automatic_on is not None and device.type not in kind.automatic_on:
                continue
            if kind.unsupported(device, dtype) is None:
                return candidate
        raise RuntimeError(f"no backend of {table.names()} runs {device} tensors of {dtype}")
    entry = entries.get(name) if isinstance(name, str) else None
    if entry is None:
        raise ValueError(f"backend must be one of {('auto', *table.names())}, got {name!r}")
    why = getattr(entry, "kind", entry).unsupported(device, dtype)
    if why is not None:
        raise why
    return name


def triton_unsupported(device: torch.device, dtype: torch.dtype) -> Optional[Exception]:
    """Every Triton backend's ``unsupported`` (``contract.TritonKind``): None when its kernels
    run on such tensors, else the error to raise."""
    if not HAS_TRITON:
        return ModuleNotFoundError(
            "backend='triton' needs the triton package: pip install triton (on a CPU, then set "
            "TRITON_INTERPRET=1 for its interpreter); or use backend='torch' (or 'auto')", name="triton")
    if dtype == torch.float64:
        return TypeError("backend='triton' supports float16, bfloat16 and float32; use backend='torch' for float64")
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return ValueError(
            f"backend='triton' needs CUDA tensors (got {device}); set "
            "TRITON_INTERPRET=1 to run the kernels on the CPU interpreter (slow: tests only), "
            "or use backend='torch'")
    return None


#: The tensor types of a call that needs no vocab-parallel preparation (``plain``).
_PLAIN_TYPES = (Tensor, torch.nn.Parameter)


def plain(*tensors: Optional[Tensor]) -> bool:
    """Whether every one is a plain tensor (or None): no DTensor or other subclass, so a
    call without ``process_group``/``vocab_size``/``partial_dx`` needs nothing from
    ``distributed.api.prepare`` (the common case, decided with no call into it)."""
    for t in tensors:  # (a loop, not all(<generator>): this runs per call)
        if t is not None and type(t) not in _PLAIN_TYPES:
            return False
    return True


def check_float(name: str, t: Tensor) -> None:
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be float16, bfloat16, float32 or float64, got {t.dtype}")


def check_target(target: Tensor, expected_shape: torch.Size, what: str) -> None:
    if not isinstance(target, Tensor):
        raise TypeError(f"target must be a torch.Tensor, got {type(target).__name__}")
    if target.dtype not in TARGET_DTYPES:
        raise TypeError(f"target must be int64 or int32, got {target.dtype}")
    if target.shape != expected_shape:
        raise ValueError(
            f"target has shape {tuple(target.shape)}, expected {tuple(expected_shape)} ({what})"
        )


def check_same_device(**tensors: Optional[Tensor]) -> None:
    named = [(n, t) for n, t in tensors.items() if t is not None]
    first_name, first = named[0]
    for name, t in named[1:]:
        if t.device != first.device:
            raise ValueError(
                f"{name} is on {t.device} but {first_name} is on {first.device}; "
                "all inputs must be on one device"
            )


def check_class_vector(name: str, t: Optional[Tensor], num_classes: int) -> None:
    if t is None:
        return
    check_float(name, t)
    if t.shape != (num_classes,):
        raise ValueError(f"{name} must have shape ({num_classes},), got {tuple(t.shape)}")


def check_targets_in_range(target: Tensor, num_classes: int, ignore_index: int, name: str = "target") -> None:
    """ValueError (naming ``name``: "target", "tokens", the value and its flat position)
    for a class index outside [0, num_classes) that is not ignore_index. CPU tensors, and
    GPU tensors when ``logitless.options.check_targets_on_gpu()`` is on: by default a GPU
    is not checked, the check being a host sync (the token's outputs are NaN there, as
    the ops document)."""
    if target.numel() == 0 or (target.device.type != "cpu" and not _CHECK_TARGETS_ON_GPU[0]):
        return
    bad = (target != ignore_index) & ((target < 0) | (target >= num_classes))
    if bool(bad.any()):
        position = int(bad.reshape(-1).nonzero()[0])
        value = int(target.reshape(-1)[position])
        raise ValueError(f"{name} contains {value}, outside [0, {num_classes}) and not "
                         f"ignore_index={ignore_index}, at position {position} (flat index)")


def check_not_dtensor(op: str, **tensors: Optional[Tensor]) -> None:
    """One clear error for DTensor inputs (e.g. an FSDP2 parameter outside its forward)."""
    dtensor = _dtensor_type()
    if dtensor is None:
        return
    for name, t in tensors.items():
        if isinstance(t, dtensor):
            raise TypeError(
                f"{op}: {name} is a DTensor (placements {tuple(t.placements)}), e.g. a parameter "
                "sharded by FSDP2's fully_shard, used outside the module's forward. Call "
                f"{op} inside the forward of the module that owns it (FSDP2 unshards its "
                "parameters there into plain tensors), or register the method that calls it "
                "with torch.distributed.fsdp.register_fsdp_forward_method(module, 'method'). "
                "DTensor inputs (tensor parallelism) are not supported."
            )


def check_teacher_frozen(**tensors: Optional[Tensor]) -> None:
    """The teacher receives no gradient: refuse teacher tensors that would want one."""
    if not torch.is_grad_enabled():
        return
    for name, t in tensors.items():
        if t is not None and t.requires_grad:
            raise ValueError(
                f"{name} requires grad, but the distillation loss gives the teacher no "
                f"gradient; pass {name}.detach() (or compute the teacher under torch.no_grad())"
            )


def check_linear_operands(op: str, x: Tensor, weight: Tensor, bias: Optional[Tensor], *,
                          allow_empty: bool = False) -> tuple[int, int]:
    """x (..., H), weight (V, H) with V >= 1 (V >= 0 with ``allow_empty``: a rank's
    block of a vocab-parallel head), bias (V,) or None, x and weight of one dtype
    (after autocast's casts): (V, H), or a clear error."""
    if x.dim() < 1:
        raise ValueError("x must have at least one dimension (..., H)")
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D (V, H), got shape {tuple(weight.shape)}")
    num_classes, hidden = weight.shape
    if num_classes == 0 and not allow_empty:
        raise ValueError("weight has no rows: the vocabulary is empty")
    if x.shape[-1] != hidden:
        hint = ""
        if num_classes == x.shape[-1]:  # an (H, V) kernel (flax, a transposed nn.Linear weight)
            hint = (f"; it looks transposed: an (H, V) = {tuple(weight.shape)} head, where the op takes "
                    f"(V, H) as nn.Linear.weight stores it: pass weight.T")
        raise ValueError(f"x has hidden size {x.shape[-1]} but weight is {tuple(weight.shape)} (V, H){hint}")
    if x.dtype != weight.dtype:
        raise TypeError(
            f"x is {x.dtype} but weight is {weight.dtype}; they must match (or call under "
            "torch.autocast, which casts both as it does for F.linear)"
        )
    check_class_vector("bias", bias, num_classes)
    if bias is not None and bias.dtype != weight.dtype:
        raise TypeError(f"bias is {bias.dtype} but weight is {weight.dtype}; they must match")
    return num_classes, hidden


def torch_weight_hint(fn):
    """Decorates an op whose second argument is the LM-head ``weight``: a call that also
    passes ``weight=`` (torch's name for class weights, ``F.cross_entropy(weight=)``) gets
    a TypeError naming ``class_weight=`` instead of Python's "multiple values"."""
    import functools

    @functools.wraps(fn)
    def op(*args, **kwargs):
        if "weight" in kwargs and len(args) >= 2:
            raise TypeError(
                f"{fn.__name__}() got weight= besides the LM-head weight (its second argument): "
                "class weights, F.cross_entropy's weight=, are class_weight= here")
        return fn(*args, **kwargs)

    return op



#: The default's rule (``options.GPU_BUDGET_SHARE``, ``options.budget_of_total_memory``) is
#: shared with the JAX ops (``logitless.jax.budget``).
#: CUDA device index -> total memory in bytes (a device property: read once).
_TOTAL_MEMORY: dict = {}


def default_memory_budget(device: torch.device) -> int:
    """``memory_budget=None`` of ``linear_cross_entropy``, ``linear_jsd`` and
    ``linear_log_probs`` on ``device``: ``options.GPU_BUDGET_SHARE`` of a GPU's total memory (whole
    MiB, at least ``DEFAULT_MEMORY_BUDGET``); ``DEFAULT_MEMORY_BUDGET`` on other devices."""
    if device.type != "cuda":
        return DEFAULT_MEMORY_BUDGET
    index = device.index if device.index is not None else torch.cuda.current_device()
    total = _TOTAL_MEMORY.get(index)
    if total is None:
        total = _TOTAL_MEMORY[index] = torch.cuda.get_device_properties(index).total_memory
    return budget_of_total_memory(total)


def memory_budget(value: Optional[int], device: torch.device) -> int:
    """A fused linear op's ``memory_budget=``: a positive int as given, None the device's
    default (``default_memory_budget``)."""
    return default_memory_budget(device) if value is None else check_memory_budget(value)
