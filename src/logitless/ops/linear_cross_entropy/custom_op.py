"""The bodies of linear_cross_entropy's custom ops (``logitless::linear_cross_entropy_forward``
and ``_backward``), written against the declared calls of ``contract`` (``LceCall`` ->
``LceOutputs``, ``LceBackwardCall`` -> dx, dw, db); ``ops.common.glue.CustomOp`` derives the
schemas, the flattening and the autograd wiring from those declarations.

The forward plans the call ONCE (``backend.plan``: the backend's frozen Config); the
forward, its gradient-in-forward strategy (the Config picks it where ``grad_in_forward``
allows it), the fake's kept shapes and the backward follow that Config: on the eager path
the object; the backward custom op plans it again (``replan``) from the call's inputs and
``contract.LcePlanned`` (the memoised planners give the forward's Config). ``keep``/``keep_max``
serve the first backward only (``_backward``: a second one, retain_graph=True, recomputes).
With ``batch_invariant`` the Config is an ``invariant.Blocked`` one: the forward runs on
row blocks of the backend's ``invariant_rows`` (the last padded with ignored zero rows:
every row's loss, lse and argmax the same bits whatever the batch), the backward once over
the whole batch under the Config's ``backward`` plan (gradients deterministic, not
batch-invariant), without kept columns. Over a vocab-parallel head (``tp.tp_group``) the
forward and backward run ``vocab_parallel``'s merges (blocked: the ranks' sums added in
rank order).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch
from torch import Tensor

from logitless.formulas.common import compute_dtype, reduce
from logitless.formulas.cross_entropy import TokenStats, token_loss
from logitless.ops.common import invariant
from logitless.ops.common.autocast import disabled as no_autocast
from logitless.ops.common.contract import BackendTable, Needs
from logitless.ops.common.glue import CustomOp, Owned, fake_grad_outputs
from logitless.ops.common.grad_in_forward import scale_grads
from logitless.ops.common.kept import Kept, fake_kept, fake_kept_tensors, linear_backward, nothing_kept, take_kept
from logitless.ops.common.validate import check_targets_in_range

from .contract import LceBackend, LceBackwardCall, LceCall, LceOutputs, LcePlanned

#: The custom ops: logitless::lce_forward, logitless::lce_backward.
NAME = "lce"
OP = "linear_cross_entropy"


def planned(call: LceCall) -> LcePlanned:
    """The scalars ``call``'s Config is planned with."""
    return LcePlanned(call.budget, call.need_argmax, call.need_grad, call.grad_in_forward, call.need.need_dw)


def _plan(impl: LceBackend, call: LceCall | LceBackwardCall, x: Tensor, p: LcePlanned, *, cute: bool = True) -> Any:
    """The backend's Config of ``call`` (the forward's, or ``replan``'s) for the rows ``x``."""
    return impl.plan(x, call.weight, call.bias, call.class_weight, call.opts, budget=p.budget, need_grad=p.need_grad,
                     need_argmax=p.need_argmax, grad_in_forward=p.grad_in_forward, need_dw=p.dw, cute=cute,
                     kept_owned=call.owned)


def replan(b: LceBackwardCall, impl: LceBackend) -> Any:
    """The Config the forward of ``b`` planned, planned again from the same inputs (the
    backward custom op's; the planners are memoised: the forward's object): ``_plan``'s,
    ``vocab_parallel.plan``'s, or under ``batch_invariant`` the backward's over the batch
    (``_backward_plan``: all the blocked backward reads)."""
    p, x = b.planned, b.x
    if x.shape[0] == 0:
        return None
    if b.batch_invariant:
        return invariant.Blocked(invariant.rows(impl, x.device), None, _backward_plan(impl, b, p))
    with no_autocast(x.device):
        if b.tp.tp_group:
            from . import vocab_parallel

            return vocab_parallel.plan(impl, x, b.weight, b.bias, b.class_weight, b.opts, b.tp, budget=p.budget,
                                       need_argmax=p.need_argmax, need_grad=p.need_grad, need_dw=p.dw,
                                       kept_owned=b.owned)
        return _plan(impl, b, x, p)


def forward(call: LceCall, impl: LceBackend) -> LceOutputs:
    """The forward op's outputs (``contract.LceOutputs``), ``config`` as the object."""
    if call.batch_invariant:
        return _blocked_forward(call, impl)
    x, weight, target, opts = call.x, call.weight, call.target, call.opts
    if call.tp.tp_group:
        from . import vocab_parallel

        with no_autocast(x.device):
            loss, lse, argmax, w_t, kept, config = vocab_parallel.forward(
                impl, x, weight, call.bias, target, call.class_weight, opts, call.tp, budget=call.budget,
                need_argmax=call.need_argmax, need_grad=call.need_grad, need_dw=call.need.need_dw,
                kept_owned=call.owned)
        return _outputs(call, loss, lse, argmax, w_t, kept, config, None)
    check_targets_in_range(target, weight.shape[0], opts.ignore_index)
    with no_autocast(x.device):
        if x.shape[0] == 0:
            empty = x.new_empty(0, dtype=compute_dtype(x.dtype))
            stats = TokenStats(empty, empty, empty, target.new_empty(0, dtype=torch.int64))
            loss_tok, w_t = token_loss(stats, target, weight.shape[0], call.class_weight, opts)
            return _outputs(call, reduce(loss_tok, w_t, opts.reduction), empty, stats.argmax, w_t, None, None, None)
        # The call's Config, once: the forward, its strategy and the backward follow it.
        config = _plan(impl, call, x, planned(call))
        need = call.need
        out = impl.forward(x, weight, call.bias, target, call.class_weight, opts, config,
                           need_argmax=call.need_argmax, need_dx=need.need_dx, need_dw=need.need_dw,
                           need_db=need.need_db)
    return _outputs(call, out.loss, out.stats.lse, out.stats.argmax, out.w_t, out.kept, config, out.grads)


def _outputs(call: LceCall, loss, lse, argmax, w_t, kept, config, grads) -> LceOutputs:
    """``LceOutputs`` from the results (size-0 tensors where absent)."""
    x = call.x
    sd = torch.float64 if x.dtype == torch.float64 else torch.float32  # (formulas.common.compute_dtype)
    if argmax is None or not call.need_argmax:
        argmax = call.target.new_empty(0, dtype=torch.int64)
    keep, keep_max = kept if kept is not None else nothing_kept(x)
    gx, gw, gb = [g if g is not None else x.new_empty(0) for g in (grads or (None,) * 3)]
    return LceOutputs(loss.to(sd), lse.to(sd), argmax, w_t.to(sd), keep, keep_max, config, gx, gw, gb)


def _blocked_forward(call: LceCall, impl: LceBackend) -> LceOutputs:
    """``forward`` with ``batch_invariant``: per-token results on blocks of the backend's
    ``invariant_rows`` rows under one Config planned for a block, the loss reduced after."""
    x, target, opts = call.x, call.target, call.opts
    block_opts = dataclasses.replace(opts, reduction="none")
    rows = invariant.rows(impl, x.device)
    block = dataclasses.replace(call, opts=block_opts, need_grad=False, grad_in_forward=False,
                                need=type(call.need)(), batch_invariant=False)
    parts, config = [], None
    for n0, n1, pad in invariant.blocks(x.shape[0], rows) or [(0, 0, 0)]:
        xb, tb = invariant.pad_rows(x, n0, n1, pad), invariant.pad_rows(target, n0, n1, pad, opts.ignore_index)
        if call.tp.tp_group:  # the ranks' statistics added in rank order
            from . import vocab_parallel

            with no_autocast(x.device):
                loss, lse, argmax, w_t, _, config = vocab_parallel.forward(
                    impl, xb, call.weight, call.bias, tb, call.class_weight, block_opts, call.tp, budget=call.budget,
                    need_argmax=call.need_argmax, need_grad=False, ordered=True, config=config)
            if argmax is None:
                argmax = tb.new_empty(0, dtype=torch.int64)
        else:
            check_targets_in_range(tb, call.weight.shape[0], opts.ignore_index)
            with no_autocast(x.device):
                if config is None and xb.shape[0]:
                    config = _plan(impl, block, xb, planned(block))  # the first block's Config serves every block
                loss, lse, argmax, w_t = _block(impl, dataclasses.replace(block, x=xb, target=tb), config)
        parts.append([t[:n1 - n0] for t in (loss, lse, argmax, w_t)])
    loss, lse, argmax, w_t = (torch.cat(c) for c in zip(*parts))
    blocked = invariant.Blocked(rows, config, _backward_plan(impl, call, planned(call)))
    sd = compute_dtype(x.dtype)
    return LceOutputs(reduce(loss, w_t, opts.reduction).to(sd), lse.to(sd), argmax, w_t.to(sd),
                      *nothing_kept(x), blocked, *[x.new_empty(0) for _ in range(3)])


def _block(impl: LceBackend, block: LceCall, config: Any) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(loss per token, lse, argmax or (0,), w_t) of one block, under ``config``."""
    x, target, opts = block.x, block.target, block.opts
    if x.shape[0] == 0:
        empty = x.new_empty(0, dtype=compute_dtype(x.dtype))
        none = target.new_empty(0, dtype=torch.int64)
        loss, w_t = token_loss(TokenStats(empty, empty, empty, none), target, block.weight.shape[0],
                               block.class_weight, opts)
        return loss, empty, none if block.need_argmax else target.new_empty(0, dtype=torch.int64), w_t
    out = impl.forward(x, block.weight, block.bias, target, block.class_weight, opts, config,
                       need_argmax=block.need_argmax)
    assert out.loss is not None and out.w_t is not None  # (loss=True)
    argmax = out.stats.argmax
    if argmax is None or not block.need_argmax:  # (as ``_outputs``)
        argmax = target.new_empty(0, dtype=torch.int64)
    return out.loss, out.stats.lse, argmax, out.w_t


def _backward_plan(impl: LceBackend, call: LceCall | LceBackwardCall, p: LcePlanned) -> Any:
    """A blocked call's Config of the backward over the whole batch (nothing kept), or None
    (no tokens or rows, or no gradient wanted)."""
    x, weight, bias, class_weight = call.x, call.weight, call.bias, call.class_weight
    if not p.need_grad:
        return None
    if call.tp.tp_group:  # this rank's real rows (the vocab-parallel backward plans for them)
        from logitless.distributed import vocab_shard

        from . import vocab_parallel

        shard = vocab_shard(call.tp.tp_group, weight.shape[0], x.device, call.tp.vocab_size)
        weight, bias = shard.real_rows(weight), shard.real_rows(bias)
        class_weight = shard.class_slice(vocab_parallel.full_class_weight(class_weight, shard))
    if x.shape[0] == 0 or weight.shape[0] == 0:
        return None
    with no_autocast(x.device):
        return impl.plan(x, weight, bias, class_weight, dataclasses.replace(call.opts, reduction="none"),
                         budget=p.budget, need_grad=False, need_argmax=False, need_dw=p.dw, cute=False)


def fake(call: LceCall, impl: LceBackend) -> LceOutputs:
    """Shapes and dtypes; the kept columns' shapes from a Config planned as the forward
    would (concrete sizes only, at most once; without the CuTe choice: no memory here)."""
    x, weight, need = call.x, call.weight, call.need
    n, (v, h) = x.shape[0], weight.shape
    sd = compute_dtype(x.dtype)
    loss = x.new_empty((n,) if call.opts.reduction == "none" else (), dtype=sd)
    grads = [x.new_empty(0) for _ in range(3)]
    kept = fake_kept_tensors(x)
    memo: list[Any] = []

    def config():
        if not memo:
            memo.append(_plan(impl, call, x, planned(call), cute=False))
        return memo[0]

    if call.batch_invariant:
        pass  # nothing kept, no gradient in the forward
    elif call.grad_in_forward and n > 0 and getattr(config(), "grad_in_forward", None):  # (eager only)
        gif, f32 = config().grad_in_forward, torch.float32
        dx, dw, db = grads
        grads = [
            torch.empty_like(x) if need.need_dx else dx,
            (torch.empty_like(weight) if gif >= n else weight.new_empty(v, h, dtype=f32)) if need.need_dw else dw,
            weight.new_empty(v, dtype=f32) if need.need_db else db,
        ]
    elif call.need_grad and not (call.tp.tp_group and isinstance(v, int) and v == 0):
        kept = fake_kept(x, weight, call.tp.tp_group, call.tp.vocab_size,
                         lambda n, v, h: impl.kept_shapes(config(), n))
    return LceOutputs(loss, x.new_empty(n, dtype=sd), x.new_empty(n if call.need_argmax else 0, dtype=torch.int64),
                      x.new_empty(n, dtype=sd), *kept, None, *grads)


def backward_impl(b: LceBackwardCall, impl: LceBackend):
    """dx, dw, db (size 0 where not needed). Turns ``keep`` (when not a dummy) into dz, over
    itself where the call owns it (``linear_backward``)."""
    x, weight, bias, need = b.x, b.weight, b.bias, b.need

    def grads(config, kept: Optional[Kept]):
        opts, grad_loss = b.opts, b.grad_loss
        if b.batch_invariant:  # the per-token gradient of the reduction, as autograd gives it
            config = config.backward
            if grad_loss is None:
                grad_loss = torch.zeros_like(b.lse)
            elif opts.reduction == "sum":
                grad_loss = grad_loss.expand(b.lse.shape)
            elif opts.reduction == "mean":
                grad_loss = (grad_loss / b.w_t.sum()).expand(b.lse.shape)
            opts = dataclasses.replace(opts, reduction="none")
        assert grad_loss is not None  # (``backward`` fills it but under batch_invariant)
        with no_autocast(x.device):
            if b.tp.tp_group:
                from . import vocab_parallel

                return vocab_parallel.backward(
                    impl, grad_loss, b.grad_lse, x, weight, bias, b.target, b.class_weight, b.lse, b.w_t, opts,
                    b.tp, need_dx=need.need_dx, need_dw=need.need_dw, need_db=need.need_db, config=config, kept=kept)
            coef = impl.grad_coefficients(grad_loss, b.grad_lse, b.lse, b.w_t, b.target, b.class_weight, opts,
                                          weight.shape[0])
            return impl.backward(x, weight, bias, b.target, b.class_weight, opts.softcap, b.lse, coef, config,
                                 kept=kept, need_dx=need.need_dx, need_dw=need.need_dw, need_db=need.need_db)

    return linear_backward(b, grads)


def backward_fake(b: LceBackwardCall, impl: LceBackend):
    return fake_grad_outputs(b.x, b.weight, b.bias, b.need.need_dx, b.need.need_dw, b.need.need_db)


def save(ctx, call: LceCall, out: LceOutputs) -> None:
    """Saved: x, weight, bias, target, class_weight, lse, w_t; on ctx: the options and
    execution fields the backward reads, the Config, the kept columns (the first
    backward's), the gradient-in-forward strategy's gradients when the forward used them."""
    ctx.save_for_backward(call.x, call.weight, call.bias, call.target, call.class_weight, out.lse, out.w_t)
    ctx.opts, ctx.backend, ctx.tp, ctx.batch_invariant = call.opts, call.backend, call.tp, call.batch_invariant
    ctx.config, ctx.planned = out.config, planned(call)  # (config: None through the custom ops: replanned)
    ctx.kept = (out.keep, out.keep_max)
    ctx.forward_grads = None
    if call.grad_in_forward and (out.gx.numel() or out.gw.numel() or out.gb.numel()):
        ctx.forward_grads = (out.gx, out.gw, out.gb)
        ctx.dtypes = (call.x.dtype, call.weight.dtype)
    ctx.mark_non_differentiable(out.argmax, out.w_t, out.keep, out.keep_max, out.gx, out.gw, out.gb)
    ctx.set_materialize_grads(False)


def backward(ctx, grads: LceOutputs, need, run) -> tuple:
    """(dx, dw, db): the backward op (``run``) on the saved tensors and the forward's Config,
    or the gradient-in-forward strategy's gradients scaled by the loss's gradient."""
    forward_grads, ctx.forward_grads = ctx.forward_grads, None
    x, weight, bias, target, class_weight, lse, w_t = ctx.saved_tensors
    kept = take_kept(ctx, x)
    grad_loss: Optional[Tensor] = grads.loss  # (None: not materialised)
    if grad_loss is None and not ctx.batch_invariant:
        shape = lse.shape if ctx.opts.reduction == "none" else ()
        grad_loss = torch.zeros(shape, dtype=lse.dtype, device=lse.device)
    needs = Needs(need.x, need.weight, need.bias)

    def backward_call(grad_loss: Optional[Tensor], grad_lse: Optional[Tensor],
                      kept: tuple[Tensor, Tensor]) -> LceBackwardCall:
        keep, keep_max = kept
        return LceBackwardCall(grad_loss, grad_lse, x, weight, bias, target, class_weight, lse, w_t, keep, keep_max,
                               ctx.config, ctx.opts, ctx.backend, ctx.batch_invariant, needs, ctx.tp, ctx.planned,
                               Owned(ctx.eager))

    if forward_grads is None:
        return run(backward_call(grad_loss, grads.lse, kept))
    assert grad_loss is not None  # (the gradient-in-forward strategy: never batch_invariant)
    # Gradient-in-forward: scale the forward's gradients by the upstream gradient, in
    # place; a gradient of the lse (rare) comes on top through the backward op.
    out = scale_grads([g if g.numel() else None for g in forward_grads], grad_loss, *ctx.dtypes)
    if grads.lse is not None:
        extra = run(backward_call(torch.zeros_like(grad_loss), grads.lse, nothing_kept(x)))
        out = tuple(g + e if g is not None else None for g, e in zip(out, extra))
    return out


def define(backends: BackendTable[LceBackend], *, name: str = NAME, call: type[LceCall] = LceCall,
           backward_call: type[LceBackwardCall] = LceBackwardCall,
           ) -> CustomOp[LceCall, LceOutputs, LceBackwardCall, LceBackend]:
    """The custom-op pair over the table of backends ``backends`` (``api.BACKENDS``);
    ``call``/``backward_call``: the declarations its schemas derive from (tests declare one
    with a new option field)."""
    return CustomOp(name, call, LceOutputs, backward_call, table=backends, forward=forward, fake=fake,
                    save=save, backward=backward, backward_impl=backward_impl, backward_fake=backward_fake,
                    title=OP, replan=replan)
