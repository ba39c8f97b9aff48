"""The torch.library custom ops of linear_log_probs: what autograd and torch.compile see.

    logitless::llp_forward(x, weight, bias, tokens, <options>, backend, budget, need_grad,
                           <vocab parallel>)
        -> logp, entropy ((0,) without entropy), lse, keep, keep_max, plan
    logitless::llp_backward(grad_logp, grad_entropy, x, weight, bias, tokens, lse, entropy,
                            keep (overwritten with dz), keep_max, plan, <options>, backend,
                            budget, need_dx, need_dw, need_db, <vocab parallel>) -> dx, dw, db

``<options>`` are the fields of ``LogProbOptions`` under their own names (temperature,
entropy, softcap, ignore_index); ``<vocab parallel>`` those of ``VocabParallelOptions``
(tp_group, vocab_size, partial_dx), defaulted named arguments: with a ``tp_group`` the
weight is this rank's block of rows of a vocab-parallel head and the ops merge the
statistics over the group (``vocab_parallel``); the fakes take them by name with the
same defaults (inductor drops defaulted arguments from the calls it emits).
``keep``/``keep_max``/``plan`` are the columns of exp(a - m) the Triton backend kept
for the backward and the plan that laid them out (``NOTHING_KEPT``-shaped dummies and
an empty plan when none): the first backward consumes them in place, a second one
(retain_graph=True) recomputes. Implementations run eagerly (also under torch.compile,
which sees only the fakes), so the CPU token-range check (``validate.check_targets_in_range``) lives in
them. Double backward raises.
"""

from __future__ import annotations

from typing import Optional

from torch import Tensor

from logitless.formulas.common import compute_dtype
from logitless.formulas.log_probs import grad_coefficients, token_outputs
from logitless.ops.common.autocast import disabled as no_autocast
from logitless.ops.common.autograd import (
    EagerOp,
    below_autograd,
    custom_op,
    fake_grad_outputs,
    grad_outputs,
    guard_double_backward,
    named,
    under_forward_overrides,
    zero_grads,
)
from logitless.ops.common.dispatch import load_backend
from logitless.ops.common.kept import fake_kept, fake_kept_tensors, nothing_kept
from logitless.ops.common.validate import check_targets_in_range
from logitless.options import LogProbOptions, VocabParallelOptions

OP = "linear_log_probs"


def _forward(
    x: Tensor,
    weight: Tensor,
    bias: Optional[Tensor],
    tokens: Tensor,
    temperature: float,
    entropy: bool,
    softcap: Optional[float],
    ignore_index: int,
    backend: str,
    budget: int,
    need_grad: bool,
    tp_group: str = "",
    vocab_size: int = -1,
    partial_dx: bool = False,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """x (N, H), weight (V, H), tokens (N,) int64 -> logp (N,), entropy (N,) or (0,),
    lse (N,), keep, keep_max, plan."""
    opts = LogProbOptions(temperature, entropy, softcap, ignore_index)
    tp = VocabParallelOptions(tp_group, vocab_size, partial_dx)
    n, v = x.shape[0], weight.shape[0]
    sd = compute_dtype(x.dtype)
    kept = None
    if not tp.parallel:
        check_targets_in_range(tokens, v, ignore_index, name="tokens")
    with no_autocast(x.device):
        if tp.parallel:
            from . import vocab_parallel

            logp, ent, lse, kept = vocab_parallel.forward(
                load_backend(__package__, backend), x, weight, bias, tokens, opts, tp, budget=budget,
                need_grad=need_grad)
        elif n == 0:
            logp, lse = x.new_empty(0, dtype=sd), x.new_empty(0, dtype=sd)
            ent = x.new_empty(0, dtype=sd) if entropy else None
        elif backend == "triton":  # merge + token_outputs in one launch (log_probs_epilogue)
            (logp, ent, lse), kept = load_backend(__package__, backend).forward(
                x, weight, bias, tokens, opts, budget=budget, need_grad=need_grad, outputs=True)
        else:
            stats, kept = load_backend(__package__, backend).forward(
                x, weight, bias, tokens, opts, budget=budget, need_grad=need_grad)
            logp, ent = token_outputs(stats, tokens, v, opts)
            lse = stats.lse
    ent = ent.to(sd) if ent is not None else x.new_empty(0, dtype=sd)
    if kept is None:
        kept = nothing_kept(x)
    return logp.to(sd), ent, lse.to(sd), kept[0], kept[1], kept[2]


llp_forward = custom_op("llp_forward", _forward)


@llp_forward.register_fake
def _(x, weight, bias, tokens, temperature, entropy, softcap, ignore_index, backend, budget, need_grad,
      tp_group="", vocab_size=-1, partial_dx=False):
    n = x.shape[0]
    sd = compute_dtype(x.dtype)
    kept = fake_kept_tensors(x)
    if backend == "triton" and need_grad:
        from .triton_backend import PLAN_SIZE, kept_shapes

        opts = LogProbOptions(temperature, entropy, softcap, ignore_index)
        kept = fake_kept(x, weight, tp_group, vocab_size, PLAN_SIZE, lambda n, v, h: kept_shapes(
            n, v, h, x.dtype, budget, x.device, opts, need_grad))
    return (
        x.new_empty(n, dtype=sd),
        x.new_empty(n if entropy else 0, dtype=sd),
        x.new_empty(n, dtype=sd),
        *kept,
    )


def _backward(
    grad_logp: Optional[Tensor],
    grad_entropy: Optional[Tensor],
    x: Tensor,
    weight: Tensor,
    bias: Optional[Tensor],
    tokens: Tensor,
    lse: Tensor,
    entropy_out: Tensor,
    keep: Tensor,
    keep_max: Tensor,
    plan: Tensor,
    temperature: float,
    entropy: bool,
    softcap: Optional[float],
    ignore_index: int,
    backend: str,
    budget: int,
    need_dx: bool,
    need_dw: bool,
    need_db: bool,
    tp_group: str = "",
    vocab_size: int = -1,
    partial_dx: bool = False,
) -> tuple[Tensor, Tensor, Tensor]:
    """dx, dw, db (size 0 where not needed). Overwrites ``keep`` (when not empty) with dz."""
    opts = LogProbOptions(temperature, entropy, softcap, ignore_index)
    tp = VocabParallelOptions(tp_group, vocab_size, partial_dx)
    n, v = x.shape[0], weight.shape[0]
    dx = dw = db = None
    if n == 0:
        dx, dw, db = zero_grads(x, weight, bias)
    elif need_dx or need_dw or need_db:
        with no_autocast(x.device):
            impl = load_backend(__package__, backend)
            extra = {}
            if plan.numel():
                extra = dict(kept=(keep, keep_max), plan=impl.plan_from_tensor(plan))
            if tp.parallel:
                from . import vocab_parallel

                dx, dw, db = vocab_parallel.backward(
                    impl, grad_logp, grad_entropy, x, weight, bias, tokens, lse, entropy_out, opts, tp,
                    budget=budget, need_dx=need_dx, need_dw=need_dw, need_db=need_db, extra=extra)
            else:
                if backend == "triton":  # the same coefficients in one launch (log_probs_epilogue)
                    coef = impl.grad_coefficients(entropy_out if entropy else None, tokens, grad_logp,
                                                  grad_entropy if entropy else None, v, opts)
                else:
                    coef = grad_coefficients(entropy_out if entropy else None, tokens, grad_logp,
                                             grad_entropy if entropy else None, v, opts, lse)
                dx, dw, db = impl.backward(x, weight, bias, tokens, opts, lse, coef, need_dx=need_dx,
                                           need_dw=need_dw, need_db=need_db, budget=budget, **extra)
    return grad_outputs(x, dx, dw, db, need_dx, need_dw, need_db)


llp_backward = custom_op("llp_backward", _backward, mutates_args=("keep",))
_eager_backward = below_autograd(_backward)  # what llp_backward runs, for the eager fast path


@llp_backward.register_fake
def _(grad_logp, grad_entropy, x, weight, bias, tokens, lse, entropy_out, keep, keep_max, plan,
      temperature, entropy, softcap, ignore_index, backend, budget, need_dx, need_dw, need_db,
      tp_group="", vocab_size=-1, partial_dx=False):
    return fake_grad_outputs(x, weight, bias, need_dx, need_dw, need_db)


def _setup_context(ctx, inputs, output):
    a = named(_forward, inputs)
    _, ent, lse, keep, keep_max, plan = output
    ctx.save_for_backward(a["x"], a["weight"], a["bias"], a["tokens"], lse, ent)
    ctx.opts = LogProbOptions.from_args(a)
    ctx.tp = VocabParallelOptions.from_args(a)
    ctx.backend, ctx.budget, ctx.num_inputs = a["backend"], a["budget"], len(inputs)
    ctx.kept = (keep, keep_max, plan)  # not saved: the first backward consumes them
    ctx.mark_non_differentiable(lse, keep, keep_max, plan)
    ctx.set_materialize_grads(False)


def _autograd_backward(ctx, grad_logp, grad_entropy, *_):
    x, weight, bias, tokens, lse, ent = ctx.saved_tensors
    keep, keep_max, plan = ctx.kept
    ctx.kept = nothing_kept(keep)
    need_dx, need_dw, need_db = ctx.needs_input_grad[:3]
    if not (need_dx or need_dw or need_db) or (grad_logp is None and grad_entropy is None):
        return (None,) * ctx.num_inputs
    op = _eager_backward if getattr(ctx, "eager", False) else llp_backward  # (EagerOp: the same computation)
    grads = op(grad_logp, grad_entropy, x, weight, bias, tokens, lse, ent, keep, keep_max, plan,
                         *ctx.opts.args(), ctx.backend, ctx.budget, need_dx, need_dw, need_db,
                         *ctx.tp.args())
    grads = (grads[0] if need_dx else None, grads[1] if need_dw else None, grads[2] if need_db else None)
    grads = guard_double_backward(OP, grads, grad_logp, grad_entropy, x, weight, bias)
    return grads + (None,) * (ctx.num_inputs - 3)


# The backward plans (and reads ``override(...)``) as its forward did, on any thread.
_setup, _backward_of_ctx = under_forward_overrides(_setup_context, _autograd_backward)
llp_forward.register_autograd(_backward_of_ctx, setup_context=_setup)
#: What the public function calls: ``llp_forward``, through a plain autograd.Function in eager mode.
llp_forward_eager = EagerOp(llp_forward, _forward, _setup, _backward_of_ctx)
