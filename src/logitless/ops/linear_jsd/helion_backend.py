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
Without a usable Helion the Triton (CUDA) or torch (CPU) backend computes the statistics
and the backward in its place, with one warning (``ops.common.helion_choice``), decided in
``plan``; the loss and the upstream gradient stay the formulas'.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Optional

from torch import Tensor

from logitless.helion_lib import linear_jsd as kernels
from logitless.ops.common import helion_choice
from logitless.ops.common.contract import HelionKind
from logitless.options import JSDOptions

from .contract import HelionConfig, LjsdBackend, LjsdForward
from .torch_backend import forward_loss, upstream


class HelionBackend(HelionKind):
    """backend="helion" (``contract.LjsdBackend``). Its Config (``HelionConfig``) says whether
    Helion runs the call or which backend runs in its place (that backend's Config in it),
    and the budget the kernels size their chunks by. ``others``: the backends by name
    (``api.BACKENDS``). No gradient-in-forward strategy (the Triton backend's)."""

    grad_in_forward = None

    def __init__(self, others: Mapping[str, LjsdBackend]):
        self.others = others


    def plan(self, xs: Tensor, ws: Tensor, xt: Tensor, opts: JSDOptions, *, budget: int,
             grad_in_forward: bool = False, keep: bool = False, column_sums: bool = False) -> HelionConfig:
        """(The gradient-in-forward strategy is the Triton backend's: never here.)"""
        other = helion_choice.fallback_name_of_call(xs.device)
        if other is None and not column_sums:
            return HelionConfig(budget=budget)
        name = other or helion_choice.fallback_name(xs.device)  # (the column sums' backend)
        config = self.others[name].plan(xs, ws, xt, opts, budget=budget, column_sums=column_sums)
        return HelionConfig(other is None, budget, **{name: config})

    def _other(self, config: HelionConfig):
        """(the backend in Helion's place, its Config), or (None, None)."""
        if config.helion:
            return None, None
        if config.torch is not None:
            return self.others["torch"], config.torch
        return self.others["triton"], config.triton

    def _failed_over(self, xs, ws, xt, opts, config: HelionConfig):
        """After a Helion kernel failed on a GPU (``helion_choice.guarded``): the backend that
        runs this call instead and its Config (later calls choose it in ``plan``)."""
        return self._other(self.plan(xs, ws, xt, opts, budget=config.budget))

    def forward(self, xs, ws, bs, xt, wt, bt, target, opts: JSDOptions, config: HelionConfig, *,
                reduction: Optional[str] = None, need_dx: bool = False, need_dw: bool = False,
                need_db: bool = False) -> LjsdForward:
        """(6, N) statistics (``formulas.jsd``), fp32; the loss from the formulas."""
        def stats_of(impl, c):
            return impl.forward(xs, ws, bs, xt, wt, bt, target, opts, c).stats

        other, other_config = self._other(config)
        if other is not None:
            stats = stats_of(other, other_config)
        else:
            stats = helion_choice.guarded(
                xs.device, lambda: kernels.jsd_forward(xs, ws, bs, xt, wt, bt, target, opts, budget=config.budget),
                lambda: stats_of(*self._failed_over(xs, ws, xt, opts, config)))
        return LjsdForward(stats, forward_loss(stats, target, ws.shape[0], opts, reduction) if reduction else None)

    upstream = staticmethod(upstream)

    def backward(self, g, xs, ws, bs, xt, wt, bt, target, stats, opts: JSDOptions, config: HelionConfig, *,
                 need_dx: bool, need_dw: bool, need_db: bool, dx_acc: bool = False, kept=None):
        """dx, dW, db of the student (None where not needed; db in the bias dtype);
        ``dx_acc``: dx in fp32, not cast (a partial sum the caller reduces first);
        ``kept``: never given (no Config here keeps columns)."""
        def backward_of(impl, c):
            return impl.backward(g, xs, ws, bs, xt, wt, bt, target, stats, opts, c, need_dx=need_dx,
                                 need_dw=need_dw, need_db=need_db, dx_acc=dx_acc)

        other, other_config = self._other(config)
        if other is not None:
            return backward_of(other, other_config)

        def helion_path():
            if not (need_dx or need_dw or need_db):
                return None, None, None
            dx, dw, db = kernels.jsd_backward(xs, ws, bs, xt, wt, bt, target, stats, g, opts, need_dx=need_dx,
                                              need_dw=need_dw or need_db, budget=config.budget, dx_acc=dx_acc)
            if not need_db or db is None or bs is None:  # (need_db: a bias, and db came with dW)
                return dx, dw if need_dw else None, None
            return dx, dw if need_dw else None, db.to(bs.dtype)

        return helion_choice.guarded(xs.device, helion_path,
                                     lambda: backward_of(*self._failed_over(xs, ws, xt, opts, config)))

    def column_sums(self, xs, ws, bs, xt, wt, bt, target, lse_s, lse_t, opts: JSDOptions,
                    config: Optional[HelionConfig]) -> Tensor:
        """Vocabulary parallelism's second pass (0 < beta < 1): the Triton (CUDA) or torch
        backend's ``column_sums`` (no Helion kernel takes given lse's), under its Config
        (None: a rank without columns)."""
        other = self.others[helion_choice.fallback_name(xs.device)]
        return other.column_sums(xs, ws, bs, xt, wt, bt, target, lse_s, lse_t, opts,
                                 getattr(config, other.name, None))
