"""The torch.library custom ops of cross_entropy: what autograd and torch.compile see.

    logitless::ce_forward(logits, target, class_weight, <options>, backend, budget,
                          need_argmax) -> loss, lse, argmax, w_t
    logitless::ce_backward(grad_loss, grad_lse, logits, target, class_weight, lse, w_t, <options>,
                           backend, budget)
        -> d loss / d logits (a new tensor, with the logits' strides where they are dense)

``<options>`` are the fields of ``CrossEntropyOptions`` under their own names; the ops,
their fakes and autograd are built from ``SPEC`` (``ops.common.spec``). The
per-token ``lse`` is differentiable (``grad_lse`` adds to the A coefficient).

Their implementations run eagerly, also under torch.compile (which sees only the fake
implementations), so they may branch on data: the CPU target-range check lives here.
``inplace_backward=True`` (gradient written over the logits) does not fit a functional
op: ``_InplaceCrossEntropy`` below serves it in eager mode only.
Double backward is not supported: differentiating the gradient raises.
"""

from __future__ import annotations

import torch
from torch import Tensor

from logitless.formulas.common import compute_dtype, reduce
from logitless.formulas.cross_entropy import TokenStats, grad_coefficients, token_loss, upstream_per_token
from logitless.ops.common.autocast import disabled as no_autocast
from logitless.ops.common.dispatch import load_backend
from logitless.ops.common.spec import OpSpec, build, options, scalar, tensor
from logitless.ops.common.validate import check_targets_in_range
from logitless.options import CrossEntropyOptions

OP = "cross_entropy"


def forward_impl(logits, target, class_weight, opts: CrossEntropyOptions, backend: str, budget: int,
                 need_argmax: bool):
    """loss, lse, argmax ((0,) when not asked), w_t: the eager forward of both paths."""
    n, v = logits.shape
    check_targets_in_range(target, v, opts.ignore_index)
    sd = compute_dtype(logits.dtype)
    with no_autocast(logits.device):
        if n == 0:
            empty = logits.new_empty(0, dtype=sd)
            stats = TokenStats(empty, empty, empty, target.new_empty(0, dtype=torch.int64))
        else:
            stats = load_backend(__package__, backend).forward(
                logits, target, class_weight, opts.softcap,
                need_smooth=opts.needs_smooth_sum, need_argmax=need_argmax, budget=budget,
            )
        loss_tok, w_t = token_loss(stats, target, v, class_weight, opts)
        loss = reduce(loss_tok, w_t, opts.reduction)
    argmax = stats.argmax if need_argmax else target.new_empty(0, dtype=torch.int64)
    return loss.to(sd), stats.lse.to(sd), argmax, w_t.to(sd)


def backward_impl(grad_loss, grad_lse, logits, target, class_weight, lse, w_t, opts: CrossEntropyOptions,
                  backend: str, budget: int, out: Tensor) -> None:
    """Writes d loss / d logits into ``out`` (which may be the logits themselves)."""
    n, v = logits.shape
    if n == 0:
        return
    with no_autocast(logits.device):
        g = upstream_per_token(grad_loss, w_t, opts.reduction)
        coef = grad_coefficients(lse, target, g, v, class_weight, opts)
        if grad_lse is not None:  # d lse / d z_c = p_c: the A term, at every token
            coef[0] += grad_lse.to(coef.dtype)
        load_backend(__package__, backend).backward(
            logits, target, class_weight, opts.softcap, lse, coef, out, budget=budget)


def _forward(logits, target, class_weight, opts: CrossEntropyOptions, backend: str, budget: int,
             need_argmax: bool):
    """logits (N, V), target (N,) int64 -> loss (() or (N,)), lse (N,), argmax, w_t (N,)."""
    return forward_impl(logits, target, class_weight, opts, backend, budget, need_argmax)


def _forward_fake(logits, target, class_weight, opts, backend, budget, need_argmax):
    n = logits.shape[0]
    sd = compute_dtype(logits.dtype)
    return (
        logits.new_empty((n,) if opts.reduction == "none" else (), dtype=sd),
        logits.new_empty(n, dtype=sd),
        logits.new_empty(n if need_argmax else 0, dtype=torch.int64),
        logits.new_empty(n, dtype=sd),
    )


def _backward(grad_loss, grad_lse, logits, target, class_weight, lse, w_t, opts: CrossEntropyOptions,
              backend: str, budget: int) -> Tensor:
    out = torch.empty_like(logits)
    backward_impl(grad_loss, grad_lse, logits, target, class_weight, lse, w_t, opts, backend, budget, out)
    return out


def _backward_fake(grad_loss, grad_lse, logits, *_):
    return torch.empty_like(logits)


def _zero_grad_loss(a: dict) -> Tensor:
    """The gradient of a loss that got none (gradients are not materialised)."""
    lse = a["lse"]
    return torch.zeros(lse.shape if a["opts"].reduction == "none" else (), dtype=lse.dtype, device=lse.device)


_EXEC = (scalar("backend", str), scalar("budget", int))
_TENSORS = (tensor("logits"), tensor("target"), tensor("class_weight", True))

SPEC = OpSpec(
    op=OP,
    name="ce_forward",
    forward=(*_TENSORS, options("opts", CrossEntropyOptions), *_EXEC, scalar("need_argmax", bool)),
    outputs=("loss", "lse", "argmax", "w_t"),
    forward_impl=_forward,
    forward_fake=_forward_fake,
    backward_name="ce_backward",
    backward=(tensor("grad_loss"), tensor("grad_lse", True), *_TENSORS, tensor("lse"), tensor("w_t"),
              options("opts", CrossEntropyOptions), *_EXEC),
    backward_impl=_backward,
    backward_fake=_backward_fake,
    grads=("grad_loss", "grad_lse", None, None),
    grad_inputs=("logits",),
    zero_if_none={"grad_loss": _zero_grad_loss},
)

_built = build(SPEC)
ce_forward, ce_backward = _built.forward_op, _built.backward_op


_SPENT = (
    "cross_entropy(..., inplace_backward=True) has already overwritten its logits with "
    "their gradient, so its backward can run only once (not again with retain_graph=True); "
    "use inplace_backward=False to backpropagate through it more than once"
)


class InplaceCrossEntropy(torch.autograd.Function):
    """inplace_backward=True (eager only): the backward writes the gradient over the
    logits and returns that buffer as their gradient."""

    @staticmethod
    def forward(ctx, logits, target, class_weight, opts, backend, budget, need_argmax):
        loss, lse, argmax, w_t = forward_impl(logits, target, class_weight, opts, backend,
                                              budget, need_argmax)
        ctx.save_for_backward(logits, target, class_weight, lse, w_t)
        ctx.opts, ctx.backend, ctx.budget, ctx.spent = opts, backend, budget, False
        ctx.mark_non_differentiable(argmax)
        ctx.set_materialize_grads(False)
        return loss, lse, argmax

    @staticmethod
    def backward(ctx, grad_loss, grad_lse, _grad_argmax):
        nones = (None,) * 6
        if not ctx.needs_input_grad[0]:
            return (None,) + nones
        if torch.is_grad_enabled():
            raise RuntimeError(
                f"logitless.{OP}: double backward (create_graph=True) is not supported, and "
                "inplace_backward=True cannot keep the logits for it")
        if ctx.spent:
            raise RuntimeError(_SPENT)
        logits, target, class_weight, lse, w_t = ctx.saved_tensors
        if grad_loss is None:  # only lse was used
            grad_loss = torch.zeros(lse.shape if ctx.opts.reduction == "none" else (), dtype=lse.dtype,
                                    device=logits.device)
        backward_impl(grad_loss, grad_lse, logits, target, class_weight, lse, w_t, ctx.opts, ctx.backend,
                      ctx.budget, logits)
        ctx.spent = True
        # Autograd nodes that saved these logits now fail loudly instead of reading
        # the gradient as if it were logits.
        torch.autograd.graph.increment_version(logits)
        return (logits.detach(),) + nones

