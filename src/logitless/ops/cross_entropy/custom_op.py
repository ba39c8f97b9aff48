"""The torch.library custom ops of cross_entropy: what autograd and torch.compile see.

    logitless::ce_forward(logits, target, class_weight, <options>, backend, budget,
                          need_argmax) -> loss, lse, argmax, w_t, config
    logitless::ce_backward(grad_loss, grad_lse, logits, target, class_weight, lse, w_t, config,
                           <options>, backend)
        -> d loss / d logits (a new tensor, with the logits' strides where they are dense)

(the schemas, written out: ``FORWARD_SCHEMA``, ``BACKWARD_SCHEMA``). ``<options>`` are the
fields of ``CrossEntropyOptions`` (ignore_index, reduction, label_smoothing, softcap,
z_loss); ``backend`` names an entry of the table ``api.BACKENDS`` (given here by
``use_backends``), a ``CeBackend`` (``contract``). The forward plans the call once
(``backend.plan``); the backward follows that Config: the object on the eager fast path,
the backend's encoding (``backend.codec``, a CPU int64 tensor) through the custom ops.
The per-token ``lse`` is differentiable (``grad_lse`` adds to the A coefficient).

Their implementations run eagerly, also under torch.compile (which sees only the fake
implementations), so they may branch on data: the CPU target-range check lives here.
``inplace_backward=True`` (gradient written over the logits) does not fit a functional
op: ``InplaceCrossEntropy`` below serves it in eager mode only.
Double backward is not supported: differentiating the gradient raises.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from logitless.formulas.common import compute_dtype, reduce
from logitless.formulas.cross_entropy import TokenStats, grad_coefficients, token_loss, upstream_per_token
from logitless.ops.common.autocast import disabled as no_autocast
from logitless.ops.common.autograd import below_autograd, custom_op, guard_double_backward
from logitless.ops.common.contract import register_autograd
from logitless.ops.common.validate import check_targets_in_range
from logitless.options import CrossEntropyOptions

from .contract import CeBackend

OP = "cross_entropy"

OPTIONS_SCHEMA = "SymInt ignore_index, str reduction, float label_smoothing, float? softcap, float z_loss"
FORWARD_SCHEMA = (
    f"(Tensor logits, Tensor target, Tensor? class_weight, {OPTIONS_SCHEMA}, str backend, SymInt budget, "
    "bool need_argmax) -> (Tensor, Tensor, Tensor, Tensor, Tensor)"
)
BACKWARD_SCHEMA = (
    "(Tensor grad_loss, Tensor? grad_lse, Tensor logits, Tensor target, Tensor? class_weight, Tensor lse, "
    f"Tensor w_t, Tensor config, {OPTIONS_SCHEMA}, str backend) -> Tensor"
)
#: The forward's arguments.
_NUM_INPUTS = 11

#: backend name -> CeBackend: ``api.BACKENDS``, given once at import (``use_backends``).
BACKENDS: Mapping[str, CeBackend] = {}


def use_backends(table: Mapping[str, CeBackend]) -> None:
    """The table of backends the custom ops run (``api.BACKENDS``)."""
    global BACKENDS
    BACKENDS = table


def forward(logits: Tensor, target: Tensor, class_weight, opts: CrossEntropyOptions, impl: CeBackend, budget: int,
            need_argmax: bool):
    """loss, lse, argmax ((0,) when not asked), w_t, the Config (None without tokens): the
    eager forward of both paths (the custom op, ``InplaceCrossEntropy``)."""
    n, v = logits.shape
    check_targets_in_range(target, v, opts.ignore_index)
    sd = compute_dtype(logits.dtype)
    config = None
    with no_autocast(logits.device):
        if n == 0:
            empty = logits.new_empty(0, dtype=sd)
            stats = TokenStats(empty, empty, empty, target.new_empty(0, dtype=torch.int64))
        else:
            config = impl.plan(logits, budget=budget)  # once: the backward follows it
            stats = impl.forward(logits, target, class_weight, opts, config, need_argmax=need_argmax)
        loss_tok, w_t = token_loss(stats, target, v, class_weight, opts)
        loss = reduce(loss_tok, w_t, opts.reduction)
    argmax = stats.argmax if need_argmax else target.new_empty(0, dtype=torch.int64)
    return loss.to(sd), stats.lse.to(sd), argmax, w_t.to(sd), config


def backward(grad_loss, grad_lse, logits, target, class_weight, lse, w_t, config, opts: CrossEntropyOptions,
             impl: CeBackend, out: Tensor) -> None:
    """Writes d loss / d logits into ``out`` (which may be the logits themselves);
    ``config``: the forward's (the object)."""
    n, v = logits.shape
    if n == 0:
        return
    with no_autocast(logits.device):
        g = upstream_per_token(grad_loss, w_t, opts.reduction)
        coef = grad_coefficients(lse, target, g, v, class_weight, opts)
        if grad_lse is not None:  # d lse / d z_c = p_c: the A term, at every token
            coef[0] += grad_lse.to(coef.dtype)
        impl.backward(logits, target, class_weight, opts.softcap, lse, coef, out, config)


def _forward(logits, target, class_weight, ignore_index, reduction, label_smoothing, softcap, z_loss, backend,
             budget, need_argmax):
    """logits (N, V), target (N,) int64 -> loss (() or (N,)), lse (N,), argmax, w_t (N,),
    the Config as the object."""
    opts = CrossEntropyOptions(ignore_index, reduction, label_smoothing, softcap, z_loss)
    return forward(logits, target, class_weight, opts, BACKENDS[backend], budget, need_argmax)


def _forward_op(*args):
    """The custom op's implementation: ``_forward`` with the Config encoded by its backend."""
    out = _forward(*args)
    return (*out[:4], BACKENDS[args[8]].codec.encode(out[4]))


def _forward_fake(logits, target, class_weight, ignore_index, reduction, label_smoothing, softcap, z_loss, backend,
                  budget, need_argmax):
    n = logits.shape[0]
    sd = compute_dtype(logits.dtype)
    return (
        logits.new_empty((n,) if reduction == "none" else (), dtype=sd),
        logits.new_empty(n, dtype=sd),
        logits.new_empty(n if need_argmax else 0, dtype=torch.int64),
        logits.new_empty(n, dtype=sd),
        BACKENDS[backend].codec.fake(),
    )


def _backward_impl(grad_loss, grad_lse, logits, target, class_weight, lse, w_t, config, ignore_index, reduction,
                   label_smoothing, softcap, z_loss, backend) -> Tensor:
    """d loss / d logits; ``config``: the forward's (the object, or its encoding)."""
    impl = BACKENDS[backend]
    out = torch.empty_like(logits)
    backward(grad_loss, grad_lse, logits, target, class_weight, lse, w_t, impl.codec.decode(config),
             CrossEntropyOptions(ignore_index, reduction, label_smoothing, softcap, z_loss), impl, out)
    return out


def _backward_fake(grad_loss, grad_lse, logits, *_):
    return torch.empty_like(logits)


ce_forward = custom_op("ce_forward", _forward_op, schema=FORWARD_SCHEMA)
ce_forward.register_fake(_forward_fake)
ce_backward = custom_op("ce_backward", _backward_impl, schema=BACKWARD_SCHEMA)
ce_backward.register_fake(_backward_fake)



def _setup_context(ctx, inputs, output):
    """Saved: logits, target, class_weight, lse, w_t. On ctx: the options and the backend,
    the Config."""
    logits, target, class_weight = inputs[:3]
    loss, lse, argmax, w_t, config = output
    ctx.save_for_backward(logits, target, class_weight, lse, w_t)
    ctx.options = inputs[3:9]  # <options>, backend
    ctx.config = config
    if isinstance(config, Tensor):
        ctx.mark_non_differentiable(argmax, w_t, config)
    else:  # (the eager fast path's Config is the object)
        ctx.mark_non_differentiable(argmax, w_t)
    ctx.set_materialize_grads(False)


def _backward(ctx, grad_loss, grad_lse, *_):
    """(d logits, None...): the backward op on the saved tensors and the forward's Config."""
    nones = (None,) * (_NUM_INPUTS - 1)
    if not ctx.needs_input_grad[0]:
        return (None, *nones)
    logits, target, class_weight, lse, w_t = ctx.saved_tensors
    if grad_loss is None:  # (gradients are not materialised)
        grad_loss = torch.zeros(lse.shape if ctx.options[1] == "none" else (), dtype=lse.dtype, device=lse.device)
    args = (grad_loss, grad_lse, logits, target, class_weight, lse, w_t, ctx.config, *ctx.options)
    # The eager fast path calls the implementation, recording no autograd history (as the
    # dispatcher runs a custom op's: a backward with create_graph=True runs in grad mode).
    if getattr(ctx, "eager", False):
        with below_autograd():
            dz = _backward_impl(*args)
    else:
        dz = ce_backward(*args)
    (dz,) = guard_double_backward(OP, (dz,), grad_loss, grad_lse, logits)
    return (dz, *nones)


#: What the public function calls: ``ce_forward`` with its autograd, through a plain
#: autograd.Function in eager mode (``autograd.EagerOp``: ``.runner(inputs)(*inputs)``).
ce_forward_eager = register_autograd(ce_forward, _forward, _setup_context, _backward)


_SPENT = (
    "cross_entropy(..., inplace_backward=True) has already overwritten its logits with "
    "their gradient, so its backward can run only once (not again with retain_graph=True); "
    "use inplace_backward=False to backpropagate through it more than once"
)


class InplaceCrossEntropy(torch.autograd.Function):
    """inplace_backward=True (eager only): the backward writes the gradient over the
    logits and returns that buffer as their gradient. ``impl``: a ``CeBackend``."""

    @staticmethod
    def forward(ctx, logits, target, class_weight, opts, impl, budget, need_argmax):
        loss, lse, argmax, w_t, config = forward(logits, target, class_weight, opts, impl, budget, need_argmax)
        ctx.save_for_backward(logits, target, class_weight, lse, w_t)
        ctx.opts, ctx.impl, ctx.config, ctx.spent = opts, impl, config, False
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
        backward(grad_loss, grad_lse, logits, target, class_weight, lse, w_t, ctx.config, ctx.opts, ctx.impl,
                 logits)
        ctx.spent = True
        # Autograd nodes that saved these logits now fail loudly instead of reading
        # the gradient as if it were logits.
        torch.autograd.graph.increment_version(logits)
        return (logits.detach(),) + nones
