"""The buffers a forward custom op keeps for its backward, shared by the ops that keep
columns of exp(z - m) (linear_cross_entropy, linear_log_probs).

A forward custom op returns ``keep`` (the kept columns, in x's dtype) and ``keep_max``
(fp32 tile maxima), laid out by the call's Config (``planning.plans.LinearPlan``); when it
keeps nothing these are ``NOTHING_KEPT``-shaped dummies (the backward tells them by that
shape). ``nothing_kept`` builds the dummies (eager), ``fake_kept`` the two outputs of a
fake implementation. No device work: only allocations of the shapes the backend reports.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Optional, Union

import torch
from torch import Tensor

#: Shape of the keep buffers when nothing is kept. Not (0, 0): inductor's in-place reuse
#: of an empty 2-D buffer of dynamic size computes its size as u1 - max(1, u1) + u0 *
#: max(1, u1) = -1 (torch 2.11, "numel: integer multiplication overflow"). Never the
#: shape of real kept columns (rows padded to 8 elements).
NOTHING_KEPT = (1, 1)

#: (n, v, h) -> ((keep rows, keep row length), tile-maxima shape), or None when the
#: backend keeps nothing for these sizes.
KeptShapes = Callable[[int, int, int], Optional[tuple[tuple, tuple]]]


def nothing_kept(x: Tensor) -> tuple[Tensor, Tensor]:
    """(keep, keep_max) when the forward kept nothing: dummies of ``NOTHING_KEPT`` shape
    on x's device (x's dtype, fp32)."""
    return x.new_empty(NOTHING_KEPT), x.new_empty(NOTHING_KEPT, dtype=torch.float32)


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
