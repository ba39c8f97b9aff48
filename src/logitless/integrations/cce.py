"""Drop-in replacement of cut-cross-entropy's ``linear_cross_entropy`` (Apple's CCE), on logitless.

Switching is one import:

    # from cut_cross_entropy import linear_cross_entropy
    from logitless.integrations.cce import linear_cross_entropy

The signature is CCE's current one (its repository's 25.6 line: ``bias``, ``shift`` as
a bool or an int, ``return_lse``, the ``accum_*``/``filter_*`` options, ``impl`` and
``vocab_parallel_options``); the 25.1 wheels lack ``bias`` and pass ``ignore_index``
fourth, so an int in the ``bias`` position raises ``TypeError`` saying to pass it by
keyword. ``LinearCrossEntropy`` (the module), ``LinearCrossEntropyImpl`` and
``VocabParallelOptions`` are here too.

Semantics are CCE's, which are torch's: ``F.cross_entropy((e @ c.T + bias).float(),
targets)`` with optional soft-cap ``softcap * tanh(z / softcap)``; "mean" over the
non-ignored tokens (NaN if none), "sum", or "none" (targets' shape, 0 at ignored
tokens). With ``shift = k`` (True = 1) position t of ``e`` predicts ``targets`` at
t + k: "none" and the lse then have k fewer positions along the last dimension.

What differs: logitless computes exactly (fp32 statistics and fp32 gradient
accumulation, no gradient filtering), so ``filter_eps``, ``accum_e_fp32``,
``accum_c_fp32``, ``filter_e_grad`` and ``filter_c_grad`` are accepted (and
``filter_eps`` validated as CCE does) and change nothing; every ``impl`` value is
accepted and logitless decides how to compute (an unknown one raises
``NotImplementedError``, as CCE; macOS is not refused). DTensor inputs are accepted
(logitless's tensor parallelism) where CCE refuses them. A target outside [0, V) that
is not ``ignore_index`` raises ``ValueError`` on the CPU (NaN loss on a GPU).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from enum import auto
from typing import Optional, Union

import torch
from torch import Tensor, nn

from logitless.ops.linear_cross_entropy import linear_cross_entropy as _lce

__all__ = ["linear_cross_entropy", "LinearCrossEntropy", "LinearCrossEntropyImpl", "VocabParallelOptions"]

IGNORE_INDEX = -100


class LinearCrossEntropyImpl(enum.IntEnum):
    """CCE's implementation names; all of them run on logitless."""

    CCE = auto()
    TORCH_COMPILE = auto()
    CCE_KAHAN_FULL_C = auto()
    CCE_KAHAN_FULL_E = auto()
    CCE_EXACT = auto()
    CCE_KAHAN_FULL_C_FULL_E = auto()
    CCE_KAHAN_FULL = auto()


LCE_IMPL_DEFAULT = LinearCrossEntropyImpl.CCE
_IMPLS = frozenset(v.name.lower() for v in LinearCrossEntropyImpl)


@dataclass
class VocabParallelOptions:
    """CCE's vocabulary-parallel options: this rank holds rows [start, stop) of the
    classifier; ``group`` (None: the default group) spans the ranks; ``reduce_e_grad``
    all-reduces e's gradient (False: each rank keeps its partial one). logitless
    needs the ranks' ranges to be contiguous blocks in rank order, as
    :meth:`from_vocab` makes them."""

    start: int
    stop: int
    group: Optional[object] = None
    reduce_e_grad: bool = True

    @classmethod
    def from_vocab(cls, vocab_size: int, group=None, reduce_e_grad: bool = True) -> VocabParallelOptions:
        rank = torch.distributed.get_rank(group)
        world_size = torch.distributed.get_world_size(group)
        start = rank * (vocab_size // world_size) + min(rank, vocab_size % world_size)
        stop = start + vocab_size // world_size + (1 if rank < (vocab_size % world_size) else 0)
        return cls(start, stop, group, reduce_e_grad)


def _check_filter_eps(filter_eps) -> None:
    if filter_eps is None or isinstance(filter_eps, float) or filter_eps in ("auto", "high"):
        return
    raise RuntimeError(f"Unknown eps filter_eps={filter_eps!r}")


def linear_cross_entropy(
    e: Tensor,
    c: Tensor,
    targets: Tensor,
    bias: Optional[Tensor] = None,
    ignore_index: int = IGNORE_INDEX,
    softcap: Optional[float] = None,
    reduction: str = "mean",
    shift: Union[bool, int] = 0,
    return_lse: bool = False,
    filter_eps: Union[float, str, None] = "auto",
    accum_e_fp32: bool = False,
    accum_c_fp32: bool = False,
    filter_e_grad: bool = True,
    filter_c_grad: bool = True,
    impl: Union[str, LinearCrossEntropyImpl] = LCE_IMPL_DEFAULT,
    vocab_parallel_options: Optional[VocabParallelOptions] = None,
) -> Union[Tensor, tuple[Tensor, Tensor]]:
    """CCE's ``linear_cross_entropy`` on logitless: cross-entropy of ``e @ c.T + bias``
    (e: (..., D), c: (V, D), targets: (...)) without the logits.

    Returns the loss (fp32; a scalar, or the targets' shape for "none", shortened by
    ``shift`` along the last dimension), and with ``return_lse=True`` also the
    per-token log-sum-exp of the (soft-capped) logits in that shape, 0 at ignored
    tokens, differentiable (for a z-loss). See the module docstring for what the CCE
    tuning options mean here.
    """
    if bias is not None and not isinstance(bias, Tensor):
        raise TypeError(
            f"bias must be a tensor or None, got {type(bias).__name__}: cut-cross-entropy 25.1 took "
            "ignore_index as the fourth positional argument; pass ignore_index=... by keyword")
    if isinstance(impl, LinearCrossEntropyImpl):
        impl = impl.name.lower()
    if impl not in _IMPLS:
        raise NotImplementedError(f"{impl} is not implemented.")
    if impl != "torch_compile":
        _check_filter_eps(filter_eps)
    if isinstance(shift, bool):
        shift = int(shift)
    if not isinstance(shift, int):
        raise TypeError(f"shift must be a bool or an int, got {type(shift).__name__}")
    if shift != 0 and (targets.dim() == 0 or shift < 0 or shift >= targets.size(-1)):
        last = targets.size(-1) if targets.dim() else 0
        raise ValueError(f"Shift must be in the range [0, {last}). Got {shift}.")
    if bias is not None and bias.dim() == 1 and c.dim() == 2 and bias.size(0) != c.size(0):
        raise ValueError(f"Bias has a different number of elements than c. {bias.size(0)} vs. {c.size(0)}.")
    tp = {}
    if vocab_parallel_options is not None:
        vp = vocab_parallel_options
        if c.size(0) != vp.stop - vp.start:
            raise ValueError(f"Expected c.size(0) to be {vp.stop - vp.start}, got {c.size(0)}.")
        group = vp.group if vp.group is not None else torch.distributed.group.WORLD
        tp = dict(process_group=group, partial_dx=not vp.reduce_e_grad)

    if shift:
        # Target of position t is targets[t + shift]; the last `shift` positions
        # predict nothing (ignored). Only the targets are copied, never e.
        pad = targets.new_full(targets.shape[:-1] + (shift,), ignore_index)
        targets = torch.cat([targets[..., shift:], pad], dim=-1)
    out = _lce(e, c, targets, bias, ignore_index=ignore_index, reduction=reduction, softcap=softcap,
               return_stats=return_lse, **tp)
    loss, stats = out if return_lse else (out, None)
    keep = targets.shape[-1] - shift if targets.dim() else None
    if reduction == "none" and shift:
        loss = loss[..., :keep]
    if not return_lse:
        return loss
    lse = torch.where(targets != ignore_index, stats.lse, torch.zeros_like(stats.lse))
    if shift:
        lse = lse[..., :keep]
    return loss, lse


class LinearCrossEntropy(nn.Module):
    """CCE's module: ``loss_fn(e, c, targets, bias=None)``, options held; see
    :func:`linear_cross_entropy`."""

    def __init__(
        self,
        ignore_index: int = IGNORE_INDEX,
        softcap: Optional[float] = None,
        reduction: str = "mean",
        shift: Union[bool, int] = 0,
        filter_eps: Union[float, str, None] = "auto",
        accum_e_fp32: bool = False,
        accum_c_fp32: bool = False,
        filter_e_grad: bool = True,
        filter_c_grad: bool = True,
        impl: Union[str, LinearCrossEntropyImpl] = LCE_IMPL_DEFAULT,
        return_lse: bool = False,
    ):
        super().__init__()
        self.ignore_index = ignore_index
        self.softcap = softcap
        self.reduction = reduction
        self.filter_eps = filter_eps
        self.shift = shift
        self.accum_e_fp32 = accum_e_fp32
        self.accum_c_fp32 = accum_c_fp32
        self.filter_e_grad = filter_e_grad
        self.filter_c_grad = filter_c_grad
        self.impl = impl
        self.return_lse = return_lse

    def forward(self, e: Tensor, c: Tensor, targets: Tensor, bias: Optional[Tensor] = None):
        return linear_cross_entropy(
            e, c, targets, bias=bias, ignore_index=self.ignore_index, softcap=self.softcap,
            reduction=self.reduction, shift=self.shift, filter_eps=self.filter_eps,
            accum_e_fp32=self.accum_e_fp32, accum_c_fp32=self.accum_c_fp32,
            filter_e_grad=self.filter_e_grad, filter_c_grad=self.filter_c_grad, impl=self.impl,
            return_lse=self.return_lse,
        )
