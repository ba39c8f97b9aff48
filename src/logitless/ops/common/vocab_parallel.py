"""The end of every op's backward over a vocab-parallel head (``ops/<op>/vocab_parallel.py``):
the gradients of a rank that holds no real class, and this rank's gradients finished
(x's partial gradient all-reduced over the group unless ``partial_dx``, then cast once;
padding rows' gradients zero)."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from logitless.distributed import VocabShard, all_reduce_
from logitless.formulas.common import compute_dtype


def no_class_grads(x: Tensor, w: Tensor, b: Optional[Tensor], need_dx: bool, need_dw: bool,
                   need_db: bool) -> tuple[Optional[Tensor], Optional[Tensor], Optional[Tensor]]:
    """(dx, dW, db) of a rank whose rows ``w`` (and ``b``) hold no real class: zeros (dx in
    the compute dtype, a partial sum like the backends'), None where not needed."""
    dx = torch.zeros(x.shape, dtype=compute_dtype(x.dtype), device=x.device) if need_dx else None
    dw = w.new_zeros(w.shape) if need_dw else None
    db = b.new_zeros(b.shape) if need_db and b is not None else None
    return dx, dw, db


def rank_grads(shard: VocabShard, x: Tensor, dx: Optional[Tensor], dw: Optional[Tensor], db: Optional[Tensor],
               partial_dx: bool) -> tuple[Optional[Tensor], Optional[Tensor], Optional[Tensor]]:
    """This rank's (dx, dW, db) from its real rows' gradients: dx (the partial sum over this
    rank's columns, in the compute dtype) all-reduced over the group unless
    ``partial_dx``, then cast to x's dtype; dW and db padded to all local rows."""
    if dx is not None:
        if not partial_dx:
            all_reduce_(dx, shard.group)
        dx = dx.to(x.dtype)
    return dx, shard.pad_rows(dw), shard.pad_rows(db)
