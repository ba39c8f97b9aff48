"""The bodies of cross_entropy's custom ops (``logitless::ce_forward`` and ``ce_backward``),
written against the declared calls of ``contract`` (``CeCall`` -> ``CeOutputs``,
``CeBackwardCall`` -> d loss / d logits, a new tensor with the logits' strides where they
are dense); ``ops.common.glue.CustomOp`` derives the schemas, the flattening and the
autograd wiring from those declarations.

The forward plans the call once (``backend.plan``); the backward follows that Config: the
object on the eager path; through the custom ops the backward op plans it again from
the forward's planning arguments (``replan``: the memoised planner's same object). The
per-token ``lse`` is differentiable (``grad_lse`` adds to the A coefficient).

Their implementations run eagerly, also under torch.compile (which sees only the fake
implementations), so they may branch on data: the CPU target-range check lives here.
``inplace_backward=True`` (gradient written over the logits) does not fit a functional
op: ``InplaceCrossEntropy`` below serves it in eager mode only, with the same bodies.
Double backward is not supported: differentiating the gradient raises.
"""

from __future__ import annotations

import torch
from torch import Tensor

from logitless.formulas.common import compute_dtype, reduce
from logitless.formulas.cross_entropy import TokenStats, grad_coefficients, token_loss, upstream_per_token
from logitless.ops.common.autocast import disabled as no_autocast
from logitless.ops.common.contract import BackendTable
from logitless.ops.common.glue import CustomOp
from logitless.ops.common.validate import check_targets_in_range

from .contract import CeBackend, CeBackwardCall, CeCall, CeOutputs

#: The custom ops: logitless::ce_forward, logitless::ce_backward.
NAME = "ce"
OP = "cross_entropy"


def forward(call: CeCall, impl: CeBackend) -> CeOutputs:
    """The forward op's outputs (``contract.CeOutputs``), ``config`` as the object (None
    without tokens): the eager forward of every path (the custom op, ``InplaceCrossEntropy``)."""
    logits, target, class_weight, opts = call.logits, call.target, call.class_weight, call.opts
    n, v = logits.shape
    check_targets_in_range(target, v, opts.ignore_index)
    sd = compute_dtype(logits.dtype)
    config = None
    with no_autocast(logits.device):
        if n == 0:
            empty = logits.new_empty(0, dtype=sd)
            stats = TokenStats(empty, empty, empty, target.new_empty(0, dtype=torch.int64))
        else:
            config = impl.plan(logits, budget=call.budget)  # once: the backward follows it
            stats = impl.forward(logits, target, class_weight, opts, config, need_argmax=call.need_argmax)
        loss_tok, w_t = token_loss(stats, target, v, class_weight, opts)
        loss = reduce(loss_tok, w_t, opts.reduction)
    argmax = stats.argmax if stats.argmax is not None else target.new_empty(0, dtype=torch.int64)  # (iff need_argmax)
    return CeOutputs(loss.to(sd), stats.lse.to(sd), argmax, w_t.to(sd), config)


def fake(call: CeCall, impl: CeBackend) -> CeOutputs:
    """Shapes and dtypes (``config`` None: the forward op has no Config output)."""
    logits = call.logits
    n = logits.shape[0]
    sd = compute_dtype(logits.dtype)
    return CeOutputs(logits.new_empty((n,) if call.opts.reduction == "none" else (), dtype=sd),
                     logits.new_empty(n, dtype=sd), logits.new_empty(n if call.need_argmax else 0, dtype=torch.int64),
                     logits.new_empty(n, dtype=sd), None)


def write_grad(b: CeBackwardCall, impl: CeBackend, out: Tensor) -> None:
    """Writes d loss / d logits of ``b`` into ``out`` (a new tensor, or the logits
    themselves: ``InplaceCrossEntropy``)."""
    logits = b.logits
    n, v = logits.shape
    if n == 0:
        return
    opts = b.opts
    with no_autocast(logits.device):
        g = upstream_per_token(b.grad_loss, b.w_t, opts.reduction)
        coef = grad_coefficients(b.lse, b.target, g, v, b.class_weight, opts)
        if b.grad_lse is not None:  # d lse / d z_c = p_c: the A term, at every token
            coef[0] += b.grad_lse.to(coef.dtype)
        impl.backward(logits, b.target, b.class_weight, opts.softcap, b.lse, coef, out, b.config)


def backward_impl(b: CeBackwardCall, impl: CeBackend) -> tuple[Tensor]:
    """(d loss / d logits,): a new tensor; ``b.config``: the forward's."""
    out = torch.empty_like(b.logits)
    write_grad(b, impl, out)
    return (out,)


def replan(b: CeBackwardCall, impl: CeBackend):
    """The forward's Config of ``b`` (the backward custom op's), planned again from the same
    logits and budget (the planner is memoised: the forward's object); None without tokens."""
    if b.logits.shape[0] == 0:
        return None
    with no_autocast(b.logits.device):
        return impl.plan(b.logits, budget=b.budget)


def backward_fake(b: CeBackwardCall, impl: CeBackend) -> tuple[Tensor]:
    return (torch.empty_like(b.logits),)


def save(ctx, call: CeCall, out: CeOutputs) -> None:
    """Saved: logits, target, class_weight, lse, w_t; on ctx: the options, the backend, the
    Config. Gradients are not materialised (an unused loss or lse gets None)."""
    ctx.save_for_backward(call.logits, call.target, call.class_weight, out.lse, out.w_t)
    ctx.opts, ctx.backend, ctx.config, ctx.budget = call.opts, call.backend, out.config, call.budget
    ctx.mark_non_differentiable(out.argmax, out.w_t)
    ctx.set_materialize_grads(False)


def _zero_grad_loss(opts, lse: Tensor) -> Tensor:
    """The loss's gradient when only the lse was used (gradients are not materialised)."""
    return torch.zeros(lse.shape if opts.reduction == "none" else (), dtype=lse.dtype, device=lse.device)


def backward(ctx, grads: CeOutputs, need, run) -> tuple:
    """(d logits,): the backward op (``run``) on the saved tensors and the forward's Config."""
    logits, target, class_weight, lse, w_t = ctx.saved_tensors
    grad_loss = grads.loss if grads.loss is not None else _zero_grad_loss(ctx.opts, lse)
    # (in declared order: positional arguments cost less per call than keywords)
    return run(CeBackwardCall(grad_loss, grads.lse, logits, target, class_weight, lse, w_t, ctx.config, ctx.opts,
                              ctx.backend, ctx.budget))


def define(backends: BackendTable[CeBackend]) -> CustomOp[CeCall, CeOutputs, CeBackwardCall, CeBackend]:
    """The custom-op pair over the table of backends ``backends`` (``api.BACKENDS``)."""
    return CustomOp(NAME, CeCall, CeOutputs, CeBackwardCall, table=backends, forward=forward, fake=fake, save=save,
                    backward=backward, backward_impl=backward_impl, backward_fake=backward_fake, title=OP,
                    replan=replan)


_SPENT = (
    "cross_entropy(..., inplace_backward=True) has already overwritten its logits with "
    "their gradient, so its backward can run only once (not again with retain_graph=True); "
    "use inplace_backward=False to backpropagate through it more than once"
)


class InplaceCrossEntropy(torch.autograd.Function):
    """inplace_backward=True (eager only): the backward writes the gradient over the
    logits and returns that buffer as their gradient. ``apply(call, impl, logits)``:
    ``call`` a ``CeCall`` whose ``logits`` are ``logits`` (the Function's input, which
    gets the gradient), ``impl`` its backend; returns (loss, lse, argmax)."""

    @staticmethod
    def forward(ctx, call: CeCall, impl: CeBackend, logits: Tensor):
        out = forward(call, impl)
        ctx.save_for_backward(logits, call.target, call.class_weight, out.lse, out.w_t)
        ctx.opts, ctx.impl, ctx.config, ctx.budget, ctx.spent = call.opts, impl, out.config, call.budget, False
        ctx.mark_non_differentiable(out.argmax)
        ctx.set_materialize_grads(False)
        return out.loss, out.lse, out.argmax

    @staticmethod
    def backward(ctx, grad_loss, grad_lse, _grad_argmax):
        _call, _impl, need_logits = ctx.needs_input_grad
        if not need_logits:
            return None, None, None
        if torch.is_grad_enabled():
            raise RuntimeError(
                f"logitless.{OP}: double backward (create_graph=True) is not supported, and "
                "inplace_backward=True cannot keep the logits for it")
        if ctx.spent:
            raise RuntimeError(_SPENT)
        logits, target, class_weight, lse, w_t = ctx.saved_tensors
        if grad_loss is None:  # only lse was used
            grad_loss = _zero_grad_loss(ctx.opts, lse)
        b = CeBackwardCall(grad_loss, grad_lse, logits, target, class_weight, lse, w_t, ctx.config, ctx.opts,
                           ctx.impl.name, ctx.budget)
        write_grad(b, ctx.impl, logits)
        ctx.spent = True
        # Autograd nodes that saved these logits now fail loudly instead of reading
        # the gradient as if it were logits.
        torch.autograd.graph.increment_version(logits)
        return None, None, logits.detach()
