"""linear_cross_entropy with ``batch_invariant=True``: the op on fixed-size row blocks
(``ops.common.invariant``), each under activation checkpointing.

Per block the op runs with reduction="none" (and the stats when asked) on the block's
rows, the last block padded with zero rows of ignored targets; ``torch.utils.checkpoint``
keeps only the block's inputs, and the backward re-runs that block's forward (bitwise
the same) before its own backward, so the memory stays one block's budget. The
per-token loss, lse and argmax of a row are then the same bits whatever the batch. The
reductions ("mean", "sum") add the per-token losses afterwards (their bits may follow
the batch; the per-token values do not). Cost: up to one block of padding rows, one
more forward per block (the recompute) and one dW add per block.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from logitless.formulas.cross_entropy import LossStats
from logitless.ops.common.dispatch import resolve_backend
from logitless.ops.common.invariant import blocks, invariant_rows, pad_rows


def blocked(op, x: Tensor, weight: Tensor, target: Tensor, bias: Optional[Tensor], *, ignore_index: int,
            reduction: str, class_weight: Optional[Tensor], shift: bool, return_stats: bool, backend: str,
            kwargs: dict):
    """``op`` (the public linear_cross_entropy) on blocks; the same outputs as one call."""
    if not isinstance(x, Tensor) or not isinstance(target, Tensor) or x.dim() < 1:
        raise TypeError("x and target must be tensors, x of shape (..., H)")
    if shift:
        if x.dim() < 2:
            raise ValueError("shift=True needs x of shape (..., T, H) with a sequence dimension")
        if target.shape[-1] > 0:
            pad = target.new_full(target.shape[:-1] + (1,), ignore_index)
            target = torch.cat([target[..., 1:], pad], dim=-1)
    if target.shape != x.shape[:-1]:
        raise ValueError(f"target has shape {tuple(target.shape)}, expected {tuple(x.shape[:-1])} "
                         "(the leading dimensions of x)")
    out_shape = target.shape
    x2d = x.reshape(-1, x.shape[-1])
    flat = target.reshape(-1)
    n = x2d.shape[0]
    impl = resolve_backend(backend, x.device, x.dtype if x.is_floating_point() else torch.float32)
    block = invariant_rows(impl, x.device)

    def run(xb, w, b, tb):
        out = op(xb, w, tb, b, ignore_index=ignore_index, reduction="none", class_weight=class_weight,
                 return_stats=return_stats, backend=backend, **kwargs)
        if return_stats:
            loss, st = out
            return loss, st.lse, st.correct, st.argmax
        return (out,)

    parts = []
    for n0, n1, pad in blocks(n, block):
        xb, tb = pad_rows(x2d, n0, n1, pad), pad_rows(flat, n0, n1, pad, ignore_index)
        if torch.is_grad_enabled():
            out = checkpoint(run, xb, weight, bias, tb, use_reentrant=False)
        else:
            out = run(xb, weight, bias, tb)
        parts.append(tuple(t[:n1 - n0] for t in out))
    if n == 0:
        parts = [run(x2d, weight, bias, flat)]
    cols = [torch.cat(c) for c in zip(*parts)]
    loss = cols[0]
    valid = flat != ignore_index

    def per_token(t: Tensor) -> Tensor:
        t = t.reshape(out_shape)
        return t[..., :-1] if shift else t

    if reduction == "none":
        out = per_token(loss)
    elif reduction == "sum":
        out = loss.sum()
    else:
        if class_weight is not None:
            den = torch.where(valid, class_weight[torch.where(valid, flat, 0).long()].to(loss.dtype),
                              torch.zeros((), dtype=loss.dtype, device=loss.device)).sum()
        else:
            den = valid.sum().to(loss.dtype)
        out = loss.sum() / den
    if not return_stats:
        return out
    return out, LossStats(per_token(cols[1]), per_token(cols[2]), valid.sum(), per_token(cols[3]))
