"""The bodies of linear_jsd's custom ops (``logitless::linear_jsd_forward`` and ``_backward``),
written against the declared calls of ``contract`` (``LjsdCall`` -> ``LjsdOutputs``,
``LjsdBackwardCall`` -> the student's dx, dw, db); ``ops.common.glue.CustomOp`` derives the
schemas, the flattening and the autograd wiring from those declarations.

The forward plans the call ONCE (``backend.plan``: the backend's frozen Config); the
forward, its gradient-in-forward strategy and the backward follow that Config.
``grad_in_forward`` allows the strategy of a backend that has one (the Triton backend's;
the public function allows it in eager mode for "mean"/"sum" on one device's heads; the
Config picks it or not): the forward then also returns the student's gradients for
grad_output = 1 (gx, gw, gb; size 0 otherwise), which the backward only scales (a second
backward, retain_graph=True, runs the backward op). With ``tp.tp_group`` both weights are
this rank's blocks of rows of vocab-parallel heads (``vocab_parallel``).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor

from logitless.formulas.common import compute_dtype
from logitless.formulas.jsd import NUM_STATS, reduce, token_loss
from logitless.ops.common.autocast import disabled as no_autocast
from logitless.ops.common.contract import BackendTable, Needs
from logitless.ops.common.glue import CustomOp, fake_grad_outputs, grad_outputs, zero_grads
from logitless.ops.common.grad_in_forward import scale_grads
from logitless.ops.common.kept import NOTHING_KEPT, fake_kept_tensors, nothing_kept
from logitless.ops.common.validate import check_targets_in_range

from .contract import LjsdBackend, LjsdBackwardCall, LjsdCall, LjsdOutputs, LjsdPlanned

#: The custom ops: logitless::linear_jsd_forward, logitless::linear_jsd_backward.
NAME = OP = "linear_jsd"


def forward(call: LjsdCall, impl: LjsdBackend) -> LjsdOutputs:
    """The forward op's outputs (``contract.LjsdOutputs``), ``config`` as the object."""
    xs, ws, bs, target, opts, reduction = (call.student_x, call.student_weight, call.student_bias, call.target,
                                           call.opts, call.reduction)
    if call.tp.tp_group:
        from . import vocab_parallel

        with no_autocast(xs.device):
            loss_tok, stats, config = vocab_parallel.forward(impl, xs, ws, bs, call.teacher_x, call.teacher_weight,
                                                             call.teacher_bias, target, opts, call.tp, call.budget)
        return _outputs(xs, reduce(loss_tok, target, reduction, opts.ignore_index), stats, config)
    n, v = xs.shape[0], ws.shape[0]
    if opts.hard_label_weight != 0.0:
        check_targets_in_range(target, v, opts.ignore_index)  # CPU only: no sync
    if n == 0:
        stats = xs.new_zeros(NUM_STATS, 0, dtype=compute_dtype(xs.dtype))
        loss = reduce(token_loss(stats, target, v, opts), target, reduction, opts.ignore_index)
        return _outputs(xs, loss, stats, None)
    need = call.need
    with no_autocast(xs.device):
        # The call's Config, once: the forward, its strategy and the backward follow it.
        config = _plan(impl, call, planned(call))
        out = impl.forward(xs, ws, bs, call.teacher_x, call.teacher_weight, call.teacher_bias, target, opts, config,
                           reduction=reduction, need_dx=need.need_dx, need_dw=need.need_dw,
                           need_db=need.need_db and bs is not None)
    assert out.loss is not None  # (a reduction given)
    return _outputs(xs, out.loss, out.stats, config, out.grads, out.kept)


def _outputs(x: Tensor, loss: Tensor, stats: Tensor, config, grads=None, kept=None) -> LjsdOutputs:
    """``LjsdOutputs``: gx, gw, gb (``grads``) with a size-0 tensor for each one absent, the
    kept columns or a ``NOTHING_KEPT`` dummy (a zero: every output of the op is defined)."""
    gx, gw, gb = [g if g is not None else x.new_empty(0) for g in (grads or (None,) * 3)]
    return LjsdOutputs(loss, stats, config, gx, gw, gb, kept if kept is not None else x.new_zeros(NOTHING_KEPT))


def planned(call: LjsdCall) -> LjsdPlanned:
    """The scalars ``call``'s Config is planned with."""
    return LjsdPlanned(call.budget, call.grad_in_forward, call.keep)


def _plan(impl: LjsdBackend, c: LjsdCall | LjsdBackwardCall, p: LjsdPlanned) -> Any:
    """The backend's Config of a call on one device with n > 0 tokens (the forward's, and
    ``replan``'s from the backward call: the same)."""
    return impl.plan(c.student_x, c.student_weight, c.teacher_x, c.opts, budget=p.budget,
                     grad_in_forward=p.grad_in_forward and c.reduction != "none",
                     keep=p.keeps and c.reduction != "none")


def replan(b: LjsdBackwardCall, impl: LjsdBackend) -> Any:
    """The forward's Config of ``b`` (the backward custom op's), planned again from the same
    inputs (the planners are memoised: the forward's object); None without tokens."""
    xs = b.student_x
    if xs.shape[0] == 0:
        return None
    with no_autocast(xs.device):
        if b.tp.tp_group:
            from . import vocab_parallel

            return vocab_parallel.plan(impl, xs, b.student_weight, b.teacher_x, b.opts, b.tp, b.planned.budget)
        return _plan(impl, b, b.planned)


def fake(call: LjsdCall, impl: LjsdBackend) -> LjsdOutputs:
    """Shapes and dtypes; the gradient-in-forward outputs' (eager only: the public function
    allows the strategy then) and the kept columns' from a Config planned as the forward
    would; with symbolic sizes the kept columns' are new dynamic sizes (as
    ``ops.common.kept.fake_kept``'s)."""
    xs, ws, need = call.student_x, call.student_weight, call.need
    n, (v, h) = xs.shape[0], ws.shape
    dtype = compute_dtype(xs.dtype)
    gx, gw, gb = (xs.new_empty(0) for _ in range(3))
    keep = fake_kept_tensors(xs)[0]
    planned = (call.grad_in_forward or call.keep) and call.reduction != "none" and not call.tp.tp_group
    if planned and not all(isinstance(s, int) for s in (n, v, h)):
        ctx = torch.library.get_ctx()
        keep = xs.new_empty(ctx.new_dynamic_size(), ctx.new_dynamic_size())
    elif planned and n > 0:
        config = impl.plan(xs, ws, call.teacher_x, call.opts, budget=call.budget,
                           grad_in_forward=call.grad_in_forward, keep=call.keep)
        chunk = getattr(config, "grad_in_forward", 0)
        keep_cols = getattr(config, "keep_cols", 0)
        if keep_cols:
            keep = xs.new_empty(n, -(-keep_cols // 8) * 8)
        if chunk:
            one = chunk >= n or ws.dtype == torch.float32
            if need.need_dx:
                gx = torch.empty_like(xs)
            if need.need_dw:
                gw = torch.empty_like(ws) if one else ws.new_empty(v, h, dtype=torch.float32)
            if need.need_db and call.student_bias is not None:
                gb = ws.new_empty(v, dtype=torch.float32)
    loss = xs.new_empty((n,) if call.reduction == "none" else (), dtype=dtype)
    return LjsdOutputs(loss, xs.new_empty(NUM_STATS, n, dtype=dtype), None, gx, gw, gb, keep)


def backward_impl(b: LjsdBackwardCall, impl: LjsdBackend):
    """(dx, dW, db) of the student; a size-0 tensor for each one not asked for.
    ``grad_loss``: the gradient of the forward's (reduced) loss; the backend turns it into
    the per-token upstream gradient. ``config``: the forward's (its chunks are the budget's).
    ``keep``: the "keep" strategy's columns (dz for grad_output = 1; the backend applies
    ``grad_loss``), or a ``NOTHING_KEPT`` dummy."""
    xs, ws, bs, need = b.student_x, b.student_weight, b.student_bias, b.need
    need_db = need.need_db and bs is not None
    if xs.shape[0] == 0:
        dx, dw, db = zero_grads(xs, ws, bs)
    else:
        config, opts = b.config, b.opts
        heads = (xs, ws, bs, b.teacher_x, b.teacher_weight, b.teacher_bias, b.target, b.stats, opts)
        with no_autocast(xs.device):
            g = impl.upstream(b.grad_loss, b.target, opts.ignore_index, b.reduction)
            if b.tp.tp_group:
                from . import vocab_parallel

                dx, dw, db = vocab_parallel.backward(impl, g, *heads, b.tp, config, need.need_dx, need.need_dw,
                                                     need_db)
            else:
                kept = None if b.keep.shape == NOTHING_KEPT else (b.keep, b.grad_loss)
                dx, dw, db = impl.backward(g, *heads, config, need_dx=need.need_dx, need_dw=need.need_dw,
                                           need_db=need_db, kept=kept)
    return grad_outputs(xs, dx, dw, db, need.need_dx, need.need_dw, need_db)


def backward_fake(b: LjsdBackwardCall, impl: LjsdBackend):
    need = b.need
    return fake_grad_outputs(b.student_x, b.student_weight, b.student_bias, need.need_dx, need.need_dw,
                             need.need_db and b.student_bias is not None)


def save(ctx, call: LjsdCall, out: LjsdOutputs) -> None:
    """Saved: the heads' tensors, the target and the statistics. On ctx: the options and
    execution fields the backward reads, the Config, the gradient-in-forward strategy's
    gradients when the forward used it, the kept columns (the first backward's; a second
    one, retain_graph=True, recomputes every column)."""
    ctx.save_for_backward(call.student_x, call.student_weight, call.student_bias, call.teacher_x,
                          call.teacher_weight, call.teacher_bias, call.target, out.stats)
    ctx.opts, ctx.reduction, ctx.backend, ctx.tp = call.opts, call.reduction, call.backend, call.tp
    ctx.config, ctx.planned = out.config, planned(call)  # (config: None through the custom ops: replanned)
    ctx.forward_grads = None
    ctx.kept = out.keep
    if call.grad_in_forward and (out.gx.numel() or out.gw.numel() or out.gb.numel()):
        ctx.forward_grads = (out.gx, out.gw, out.gb)
        ctx.dtypes = (call.student_x.dtype, call.student_weight.dtype)
    ctx.mark_non_differentiable(out.stats, out.gx, out.gw, out.gb, out.keep)
    ctx.set_materialize_grads(False)


def backward(ctx, grads: LjsdOutputs, need, run) -> tuple:
    """(dx, dw, db): the backward op (``run``) on the saved tensors and the forward's Config,
    or the gradient-in-forward strategy's gradients scaled by the loss's gradient (the
    first backward only: they are scaled in place)."""
    forward_grads, ctx.forward_grads = ctx.forward_grads, None
    kept, ctx.kept = ctx.kept, None
    grad_loss: Optional[Tensor] = grads.loss  # (None: not materialised)
    if grad_loss is None:
        return None, None, None
    if forward_grads is not None:
        return scale_grads([g if g.numel() else None for g in forward_grads], grad_loss, *ctx.dtypes)
    xs, ws, bs, xt, wt, bt, target, stats = ctx.saved_tensors
    return run(LjsdBackwardCall(grad_loss, xs, ws, bs, xt, wt, bt, target, stats, ctx.config, ctx.opts,
                                ctx.reduction, ctx.backend, Needs(need.student_x, need.student_weight,
                                                                  need.student_bias), ctx.tp,
                                kept if kept is not None else nothing_kept(xs)[0], ctx.planned))


def define(backends: BackendTable[LjsdBackend]) -> CustomOp[LjsdCall, LjsdOutputs, LjsdBackwardCall, LjsdBackend]:
    """The custom-op pair over the table of backends ``backends`` (``api.BACKENDS``)."""
    return CustomOp(NAME, LjsdCall, LjsdOutputs, LjsdBackwardCall, table=backends, forward=forward, fake=fake,
                    save=save, backward=backward, backward_impl=backward_impl, backward_fake=backward_fake, title=OP,
                    replan=replan)
