"""Helion backend of linear_jsd (``backend="helion"``; docs/helion.md).

forward:  per chunk of rows (the memory budget's, as the Triton backend's), cuBLAS writes
          both heads' fp32 logits, then one Helion kernel (``helion_lib.jsd_kernels.jsd_row_stats``)
          reads them twice: both heads' online log-sum-exps (and the hard-label ones), then the
          divergence sums S and K -> the (6, N) statistics of ``formulas.jsd``; the loss from
          them with the formulas (``forward_loss``, as the torch backend).
backward: the per-token upstream gradient (formulas), then per vocabulary chunk one kernel
          recomputing both heads' tiles into the student's d(logits) (``jsd_dlogits``) and
          cuBLAS GEMMs for dX, dW, db.

Every option of the op: beta in [0, 1], temperature, both soft-caps, hard_label_weight,
biases, a teacher hidden size of its own, ignore_index, reductions. Vocabulary parallelism
runs its first pass (per-rank statistics) and the backward on these kernels; its second
pass for 0 < beta < 1 (``column_sums``: sums with the merged lse's of all ranks) comes
from the torch/Triton backend; its dx stays the fp32 accumulator until the all-reduce. The
gradient-in-forward strategy is the Triton backend's: never with "helion".
Without a usable Helion the Triton (CUDA) or torch (CPU) backend runs, with one warning
(``ops.common.helion_choice``).
"""

from __future__ import annotations

from torch import Tensor

from logitless.helion_lib import linear_jsd as kernels
from logitless.ops.common.dispatch import load_backend
from logitless.ops.common.helion_choice import fallback_name, run_or_fallback
from logitless.options import JSDOptions

from .torch_backend import forward_loss, upstream  # noqa: F401  (the formulas: the same for every device)


def forward(xs, ws, bs, xt, wt, bt, target, opts: JSDOptions, budget: int) -> Tensor:
    """(6, N) statistics (``formulas.jsd``), fp32; ``budget`` sizes the row chunks."""
    return run_or_fallback(__package__, xs.device,
                           lambda: kernels.jsd_forward(xs, ws, bs, xt, wt, bt, target, opts, budget=budget),
                           lambda impl: impl.forward(xs, ws, bs, xt, wt, bt, target, opts, budget))


def backward(g, xs, ws, bs, xt, wt, bt, target, stats, opts: JSDOptions, budget: int,
             need_dx: bool, need_dw: bool, need_db: bool, dx_acc: bool = False):
    """dx, dW, db of the student (None where not needed; db in the bias dtype);
    ``dx_acc``: dx in fp32, not cast (a partial sum the caller reduces first)."""
    def helion_path():
        if not (need_dx or need_dw or need_db):
            return None, None, None
        dx, dw, db = kernels.jsd_backward(xs, ws, bs, xt, wt, bt, target, stats, g, opts, need_dx=need_dx,
                                          need_dw=need_dw or need_db, budget=budget, dx_acc=dx_acc)
        return dx, dw if need_dw else None, db.to(bs.dtype) if need_db else None

    return run_or_fallback(__package__, xs.device, helion_path,
                           lambda impl: impl.backward(g, xs, ws, bs, xt, wt, bt, target, stats, opts, budget,
                                                      need_dx, need_dw, need_db, dx_acc=dx_acc))


def column_sums(xs, ws, bs, xt, wt, bt, target, lse_s, lse_t, opts: JSDOptions, budget: int) -> Tensor:
    """Vocabulary parallelism's second pass (0 < beta < 1): the Triton (CUDA) or torch
    backend's ``column_sums`` (no Helion kernel takes given lse's)."""
    return load_backend(__package__, fallback_name(xs.device)).column_sums(
        xs, ws, bs, xt, wt, bt, target, lse_s, lse_t, opts, budget)
