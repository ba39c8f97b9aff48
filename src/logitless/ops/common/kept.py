"""The buffers a forward custom op keeps for its backward, shared by the ops that keep
columns of exp(z - m) (linear_cross_entropy, linear_log_probs, linear_topk_kl).

A forward custom op returns ``keep`` (the kept columns, in x's dtype) and ``keep_max``
(fp32 tile maxima), laid out by the call's Config (``planning.plans.LinearPlan``); when it
keeps nothing these are ``NOTHING_KEPT``-shaped dummies (the backward tells them by that
shape). ``nothing_kept`` builds the dummies (eager), ``fake_kept`` the two outputs of a
fake implementation. No device work: only allocations of the shapes the backend reports.
``linear_backward`` is what these ops' backward custom ops share around their own gradients:
no tokens, no gradient needed, the Config decoded, the kept columns (``Kept``) or None.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, Optional, Protocol, Union

import torch
from torch import Tensor

from logitless.ops.common.contract import Needs
from logitless.ops.common.glue import Owned, grad_outputs, zero_grads

#: Shape of the keep buffers when nothing is kept. Not (0, 0): inductor's in-place reuse
#: of an empty 2-D buffer of dynamic size computes its size as u1 - max(1, u1) + u0 *
#: max(1, u1) = -1 (torch 2.11, "numel: integer multiplication overflow"). Never the
#: shape of real kept columns (rows padded to 8 elements).
NOTHING_KEPT = (1, 1)

#: (n, v, h) -> ((keep rows, keep row length), tile-maxima shape), or None when the
#: backend keeps nothing for these sizes.
KeptShapes = Callable[[int, int, int], Optional[tuple[tuple, tuple]]]


class Kept(NamedTuple):
    """The kept columns as a backend's backward receives them: ``keep`` (e = exp(z - m), x's
    dtype) and ``keep_max`` (fp32 tile maxima), laid out by the forward's Config, and ``dz``,
    where the backward writes those columns' dz: ``keep`` itself (in place, where the body
    owns the buffers: the eager path), or None (through the custom ops, which cannot write
    their inputs: into the backward's dz chunk buffer, ``plan.kept_dz_chunk`` columns at a
    time, so that keep and dz together stay within the call's budget)."""

    keep: Tensor
    keep_max: Tensor
    dz: Optional[Tensor]

    @staticmethod
    def of(keep: Tensor, keep_max: Tensor, owned: bool) -> Kept:
        """The forward's kept columns for a backward that owns them (dz over them) or not."""
        return Kept(keep, keep_max, keep if owned else None)


def nothing_kept(x: Tensor) -> tuple[Tensor, Tensor]:
    """(keep, keep_max) when the forward kept nothing: dummies of ``NOTHING_KEPT`` shape
    on x's device (x's dtype, fp32)."""
    return x.new_empty(NOTHING_KEPT), x.new_empty(NOTHING_KEPT, dtype=torch.float32)


def take_kept(ctx, x: Tensor) -> tuple[Tensor, Tensor]:
    """(keep, keep_max) for an autograd backward: the forward's kept columns (``ctx.kept``,
    set by the op's ``save``), taken by the first backward (which overwrites them with dz);
    a second backward gets the ``nothing_kept`` dummies (the columns are spent)."""
    kept, ctx.kept = ctx.kept, None
    return kept if kept is not None else nothing_kept(x)


def fake_kept(x: Tensor, weight: Tensor, tp_group: str, vocab_size: int,
              kept_shapes: KeptShapes) -> tuple[Tensor, Tensor]:
    """The fake (keep, keep_max) of a forward whose backend may keep columns.

    With concrete sizes (and no padded vocab-parallel head) ``kept_shapes(n, v, h)``
    gives the shapes (None: nothing kept); with symbolic sizes, or a padded
    vocab-parallel head (``tp_group`` and ``vocab_size >= 0``: this rank's real rows
    are only known at run time), every size is a new dynamic size."""
    n, (v, h) = x.shape[0], weight.shape
    keep_shape: tuple[Union[int, torch.SymInt], ...] = NOTHING_KEPT
    max_shape: tuple[Union[int, torch.SymInt], ...] = NOTHING_KEPT
    if all(isinstance(s, int) for s in (n, v, h)) and not (tp_group and vocab_size >= 0):
        shapes = kept_shapes(n, v, h)
        if shapes is not None:
            keep_shape, max_shape = shapes
    else:
        ctx = torch.library.get_ctx()
        keep_shape = (ctx.new_dynamic_size(), ctx.new_dynamic_size())
        max_shape = (ctx.new_dynamic_size(), ctx.new_dynamic_size())
    return fake_kept_tensors(x, keep_shape, max_shape)


def fake_kept_tensors(x: Tensor, keep_shape=NOTHING_KEPT, max_shape=NOTHING_KEPT) -> tuple[Tensor, Tensor]:
    """Fake (keep, keep_max) of the given shapes (defaults: nothing kept)."""
    return x.new_empty(keep_shape), x.new_empty(max_shape, dtype=torch.float32)


class KeptBackwardCall(Protocol):
    """What ``linear_backward`` reads of a backward call (``glue.Call``) of an op that keeps
    columns: the student/model head, which gradients it needs, the forward's Config (the
    object), its kept columns and whether it owns them (``glue.Owned``)."""

    @property
    def x(self) -> Tensor: ...
    @property
    def weight(self) -> Tensor: ...
    @property
    def bias(self) -> Optional[Tensor]: ...
    @property
    def need(self) -> Needs: ...
    @property
    def config(self) -> Any: ...
    @property
    def keep(self) -> Tensor: ...
    @property
    def keep_max(self) -> Tensor: ...
    @property
    def owned(self) -> Owned: ...


#: (the forward's Config, its kept columns or None) -> (dx, dw, db), None where not computed.
GradsOf = Callable[[Any, Optional[Kept]], tuple[Optional[Tensor], Optional[Tensor], Optional[Tensor]]]


def linear_backward(b: KeptBackwardCall, grads: GradsOf) -> tuple[Optional[Tensor], Optional[Tensor], Optional[Tensor]]:
    """The (dx, dw, db) outputs of a backward custom op (``glue.grad_outputs``): zeros on no
    tokens, nothing computed where no gradient is needed, else ``grads(config, kept)`` on
    the forward's Config and the kept columns (``Kept``: their dz over them where the call
    owns them, ``b.owned``, else into the dz chunk buffer; None for the ``NOTHING_KEPT`` dummies)."""
    x, weight, bias, need = b.x, b.weight, b.bias, b.need
    dx = dw = db = None
    if x.shape[0] == 0:
        dx, dw, db = zero_grads(x, weight, bias)
    elif need.need_dx or need.need_dw or need.need_db:
        kept = None
        if b.keep.shape != NOTHING_KEPT:
            kept = Kept.of(b.keep, b.keep_max, b.owned)
        dx, dw, db = grads(b.config, kept)
    return grad_outputs(x, dx, dw, db, need.need_dx, need.need_dw, need.need_db)
