"""PyTorch's own ``F.linear_cross_entropy`` and ``nn.LinearCrossEntropyLoss`` (torch >= 2.13) on logitless.

``logitless.patch_torch()`` replaces ``torch.nn.functional.linear_cross_entropy`` with a
function of the same signature and semantics that computes the loss with
``logitless.linear_cross_entropy`` (no (tokens x classes) logits). ``nn.LinearCrossEntropyLoss``
calls ``F.linear_cross_entropy`` at every forward, so its modules (also those created
before the patch) run on logitless too. ``logitless.unpatch_torch()`` puts torch's own
function back (the same object). ``patch_torch()`` also works as a context manager::

    with logitless.patch_torch():
        loss = F.linear_cross_entropy(hidden, lm_head.weight, labels)

Arguments keep torch's meaning: ``weight`` is the per-class weight (logitless calls it
``class_weight``), ``linear_weight``/``linear_bias`` the head, ``ignore_index=None`` means
-100 for class-index targets.

Which calls run on logitless: class-index targets (int64, the shape of ``input`` without
its last dimension), ``input`` of shape (N, H) or unbatched (H,), a 2-D
``linear_weight`` (V, H), ``linear_bias`` and ``weight`` of shape (V,), reduction
"mean"/"sum"/"none", ``label_smoothing`` in [0, 1], float16/bfloat16/float32/float64
tensors of one dtype (any of the first three under autocast) on one device. Every other
call goes to torch's own function unchanged, which computes it or raises torch's error:
probability (soft) targets, K-dimensional losses (a (V, d1.., H) ``linear_weight``),
uint8 targets, bad shapes or dtypes, a class ``weight`` that requires grad, Tensor
subclasses (DTensor among them: for a vocabulary-parallel head call
``logitless.linear_cross_entropy`` itself, docs/tensor_parallel.md). On the CPU a target
outside [0, V) that is not ``ignore_index`` is also handed to torch (its
``IndexError``); on a GPU logitless does not check (a check would stall on a host sync):
that token's loss is NaN, where torch's kernel raises a device-side assert.

Differences from torch's function on the logitless path: the loss is computed in fp32
and rounded once to the input dtype (torch's bf16/fp16 reference path rounds the logits),
so results agree within the input dtype's precision, not bitwise; ``options=``
(``nn.LinearCrossEntropyOptions``, torch's chunked path) is accepted and ignored: its
fields are knobs of torch's implementation (chunk size, accumulation policy), while
logitless sizes its chunks from ``memory_budget`` (``patch_torch(memory_budget=...)``,
default ``logitless.DEFAULT_MEMORY_BUDGET``); a second backward through the same graph is
allowed whatever ``allow_retain_graph`` says. Higher-order and forward-mode autograd and
``torch.func`` transforms are not supported on the logitless path (as on torch's chunked
path). A function imported by name before the patch (``from torch.nn.functional import
linear_cross_entropy``) keeps pointing at torch's own.

On torch without this API (< 2.13) ``patch_torch()`` raises ``RuntimeError`` saying so
(there is nothing to patch: call ``logitless.linear_cross_entropy`` directly);
``unpatch_torch()`` does nothing there.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import has_torch_function_variadic

from logitless.ops.linear_cross_entropy.api import BACKENDS
from logitless.ops.linear_cross_entropy.api import linear_cross_entropy as _logitless_lce
from logitless.options import check_memory_budget

from ._announce import announce

__all__ = ["patch_torch", "unpatch_torch", "is_patched"]

_REDUCTIONS = ("mean", "sum", "none")
_LOW = (torch.float16, torch.bfloat16, torch.float32)  # what autocast casts
_FLOATS = _LOW + (torch.float64,)
_PLAIN = (Tensor, torch.nn.Parameter)


@dataclass(frozen=True)
class _Settings:
    memory_budget: Optional[int] = None
    backend: str = "auto"


#: torch's own function, captured at the first patch (it is the same object for the process).
_original = None
#: The settings while patched; None while torch runs its own function.
_active: Optional[_Settings] = None


def _has_api() -> bool:
    return callable(getattr(F, "linear_cross_entropy", None)) and hasattr(torch.nn, "LinearCrossEntropyLoss")


def is_patched() -> bool:
    """Whether ``torch.nn.functional.linear_cross_entropy`` currently runs on logitless."""
    return _active is not None and _original is not None and F.linear_cross_entropy is _patched


def _call_original(input, linear_weight, target, linear_bias, weight, reduction, ignore_index,
                   label_smoothing, options):
    return _original(input, linear_weight, target, linear_bias=linear_bias, weight=weight,
                     reduction=reduction, ignore_index=ignore_index, label_smoothing=label_smoothing,
                     options=options)


def _autocast_on(device: torch.device) -> bool:
    try:
        return torch.is_autocast_enabled(device.type)
    except Exception:  # noqa: BLE001 - a device type autocast does not know
        return False


def _on_logitless_path(input, linear_weight, target, linear_bias, weight, reduction, ignore_index,
                       label_smoothing, options) -> bool:
    """Whether logitless computes this call with torch's semantics (else torch's own function runs)."""
    # Plain tensors only: a subclass (DTensor, which takes no __torch_function__ route,
    # among them) keeps torch's semantics through torch's own function.
    optional = tuple(t for t in (linear_bias, weight) if t is not None)
    if not all(type(t) in _PLAIN for t in (input, linear_weight, target, *optional)):
        return False
    if has_torch_function_variadic(input, linear_weight, target, linear_bias, weight):
        return False
    if weight is not None and weight.requires_grad and torch.is_grad_enabled():
        return False  # torch: "not differentiable with respect to argument 'weight'"
    if options is not None and not isinstance(options, torch.nn.LinearCrossEntropyOptions):
        return False
    if reduction not in _REDUCTIONS:
        return False
    if not isinstance(label_smoothing, (int, float)) or isinstance(label_smoothing, bool) \
            or not 0.0 <= label_smoothing <= 1.0:
        return False
    if ignore_index is not None and (not isinstance(ignore_index, int) or isinstance(ignore_index, bool)):
        return False
    if input.dim() not in (1, 2) or linear_weight.dim() != 2:
        return False
    num_classes, hidden = linear_weight.shape
    if num_classes == 0 or input.shape[-1] != hidden:
        return False
    if target.dtype != torch.int64 or target.shape != input.shape[:-1]:
        return False
    for t in optional:
        if t.shape != (num_classes,):
            return False
    device = input.device
    if any(t.device != device for t in (linear_weight, target, *optional)):
        return False
    if _autocast_on(device):
        if any(t.dtype not in _LOW for t in (input, linear_weight, *optional)):
            return False
    else:
        dtype = input.dtype
        if dtype not in _FLOATS or any(t.dtype != dtype for t in (linear_weight, *optional)):
            return False
    if device.type == "cpu" and not torch.compiler.is_compiling() and target.numel() > 0:
        ii = -100 if ignore_index is None else ignore_index
        bad = (target != ii) & ((target < 0) | (target >= num_classes))
        if bool(bad.any()):
            return False  # torch raises its IndexError
    return True


def _patched(input, linear_weight, target, *, linear_bias=None, weight=None, reduction="mean",
             ignore_index=None, label_smoothing=0.0, options=None):
    settings = _active
    if settings is None or not _on_logitless_path(input, linear_weight, target, linear_bias, weight, reduction,
                                                  ignore_index, label_smoothing, options):
        return _call_original(input, linear_weight, target, linear_bias, weight, reduction, ignore_index,
                              label_smoothing, options)
    loss = _logitless_lce(
        input, linear_weight, target, linear_bias,
        ignore_index=-100 if ignore_index is None else ignore_index,
        reduction=reduction, label_smoothing=float(label_smoothing), class_weight=weight,
        memory_budget=settings.memory_budget, backend=settings.backend,
    )
    # torch's result: the input dtype, or fp32 under autocast (cross_entropy autocasts to fp32).
    if not _autocast_on(input.device) and loss.dtype != input.dtype:
        loss = loss.to(input.dtype)
    return loss


class _Patch:
    """What ``patch_torch()`` returns: as a context manager, its exit restores the state
    before the call (unpatched, or patched with the previous settings)."""

    def __init__(self, previous: Optional[_Settings]):
        self._previous = previous

    def __enter__(self) -> _Patch:
        return self

    def __exit__(self, *exc) -> None:
        if self._previous is None:
            unpatch_torch()
        elif _has_api():
            _install(self._previous)
        return None

    def __repr__(self) -> str:
        return f"<logitless.patch_torch: {'patched' if is_patched() else 'not patched'}>"


def _install(settings: _Settings) -> None:
    global _original, _active
    current = F.linear_cross_entropy
    if current is not _patched:
        _original = current
        F.linear_cross_entropy = _patched
    _active = settings


def patch_torch(*, memory_budget: Optional[int] = None, backend: str = "auto") -> _Patch:
    """Make ``torch.nn.functional.linear_cross_entropy`` (and so ``nn.LinearCrossEntropyLoss``)
    compute on logitless, with torch's arguments and semantics (module docstring).

    Args:
        memory_budget: bytes of temporary memory for logitless (its ``memory_budget``);
            None: ``logitless.DEFAULT_MEMORY_BUDGET``. torch's ``options=`` are ignored.
        backend: logitless' backend, "auto" (Triton on CUDA, PyTorch elsewhere), "triton"
            or "torch".

    Idempotent (a second call changes only the settings). Returns a handle that is also a
    context manager: ``with logitless.patch_torch(): ...`` restores on exit (also on an
    exception) what was there before, so nested blocks unwind in order.
    ``logitless.unpatch_torch()`` restores torch's own function at any time.

    Raises:
        RuntimeError: torch has no ``F.linear_cross_entropy`` (torch < 2.13): nothing to
            patch; call ``logitless.linear_cross_entropy(x, head_weight, target, bias,
            class_weight=...)`` instead.
        ValueError / TypeError: a bad ``memory_budget`` or ``backend``.
    """
    if not _has_api():
        raise RuntimeError(
            f"logitless.patch_torch() needs torch >= 2.13, which has torch.nn.functional.linear_cross_entropy "
            f"and torch.nn.LinearCrossEntropyLoss; this is torch {torch.__version__}, which has neither, so "
            "there is nothing to patch. Call logitless.linear_cross_entropy(x, head_weight, target, bias, "
            "class_weight=...) directly (its `weight` is the head's weight, torch's `weight` is class_weight)."
        )
    if backend != "auto" and backend not in BACKENDS.entries:
        raise ValueError(f"backend must be one of {('auto', *BACKENDS.names())}, got {backend!r}")
    memory_budget = check_memory_budget(memory_budget) if memory_budget is not None else None
    previous = _active if is_patched() else None
    _install(_Settings(memory_budget, backend))
    announce("patch_torch", "torch.nn.functional.linear_cross_entropy runs on logitless")
    return _Patch(previous)


def unpatch_torch() -> None:
    """Restore torch's own ``torch.nn.functional.linear_cross_entropy`` (the original object).
    Does nothing when not patched (or on torch < 2.13)."""
    global _active
    _active = None
    if _original is not None and getattr(F, "linear_cross_entropy", None) is _patched:
        F.linear_cross_entropy = _original


def _describe() -> None:
    # The wrapper shows torch's signature and documentation (inspect.signature follows
    # __wrapped__ to torch's function), headed by a line saying that logitless runs it.
    if _has_api():
        functools.update_wrapper(_patched, F.linear_cross_entropy if F.linear_cross_entropy is not _patched
                                 else _original)
        _patched.__doc__ = ("[patched by logitless.patch_torch(): computed by logitless.linear_cross_entropy "
                            "where it applies; logitless.unpatch_torch() restores torch's]\n\n"
                            + (_patched.__wrapped__.__doc__ or ""))
        _patched.__module__ = __name__


_describe()
