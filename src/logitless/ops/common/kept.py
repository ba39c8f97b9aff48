"""The buffers a forward custom op keeps for its backward, shared by the ops that keep
columns of exp(z - m) (linear_cross_entropy, linear_log_probs).

A forward custom op returns ``keep`` (the kept columns, in x's dtype), ``keep_max``
(fp32 tile maxima) and ``plan`` (the launch plan's fields, a CPU int64 tensor); when it
keeps nothing these are ``NOTHING_KEPT``-shaped dummies and an empty plan. ``nothing_kept``
builds the dummies (eager), ``fake_kept`` the three outputs of a fake implementation.
No device work: only allocations of the shapes the backend reports.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Optional

import torch
from torch import Tensor

#: Shape of the keep buffers when nothing is kept (the plan output is then empty). Not
#: (0, 0): inductor's in-place reuse of an empty 2-D buffer of dynamic size computes its
#: size as u1 - max(1, u1) + u0 * max(1, u1) = -1 (torch 2.11, "numel: integer
#: multiplication overflow").
NOTHING_KEPT = (1, 1)

#: (n, v, h) -> ((keep rows, keep row length), tile-maxima shape), or None when the
#: backend keeps nothing for these sizes.
KeptShapes = Callable[[int, int, int], Optional[tuple[tuple, tuple]]]


def nothing_kept(x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(keep, keep_max, plan) when the forward kept nothing: dummies of ``NOTHING_KEPT``
    shape on x's device (x's dtype, fp32) and an empty CPU int64 plan."""
    return (x.new_empty(NOTHING_KEPT), x.new_empty(NOTHING_KEPT, dtype=torch.float32),
            torch.empty(0, dtype=torch.int64))


def fake_kept(x: Tensor, weight: Tensor, tp_group: str, vocab_size: int, plan_size: int,
              kept_shapes: KeptShapes) -> tuple[Tensor, Tensor, Tensor]:
    """The fake (keep, keep_max, plan) of a forward whose backend may keep columns.

    With concrete sizes (and no padded vocab-parallel head) ``kept_shapes(n, v, h)``
    gives the shapes (None: nothing kept) and the plan has ``plan_size`` fields; with symbolic sizes, or a padded
    vocab-parallel head (``tp_group`` and ``vocab_size >= 0``: this rank's real rows
    are only known at run time), every size is a new dynamic size."""
    n, (v, h) = x.shape[0], weight.shape
    keep_shape = max_shape = NOTHING_KEPT
    if all(isinstance(s, int) for s in (n, v, h)) and not (tp_group and vocab_size >= 0):
        shapes = kept_shapes(n, v, h)
        if shapes is None:
            plan_size = 0
        else:
            keep_shape, max_shape = shapes
    else:
        ctx = torch.library.get_ctx()
        keep_shape = (ctx.new_dynamic_size(), ctx.new_dynamic_size())
        max_shape = (ctx.new_dynamic_size(), ctx.new_dynamic_size())
        plan_size = ctx.new_dynamic_size()
    return fake_kept_tensors(x, keep_shape, max_shape, plan_size)


def fake_kept_tensors(x: Tensor, keep_shape=NOTHING_KEPT, max_shape=NOTHING_KEPT,
                      plan_size=0) -> tuple[Tensor, Tensor, Tensor]:
    """Fake (keep, keep_max, plan) of the given shapes (defaults: nothing kept)."""
    return (x.new_empty(keep_shape), x.new_empty(max_shape, dtype=torch.float32),
            torch.empty(plan_size, dtype=torch.int64, device="cpu"))
