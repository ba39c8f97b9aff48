"""The torch.library custom ops of linear_cross_entropy: what autograd and torch.compile see.

    logitless::lce_forward(x, weight, bias, target, class_weight, <options>, backend,
                           budget, need_argmax, need_grad, grad_in_forward, need_dx,
                           need_dw, need_db, <vocab parallel>)
        -> loss, lse, argmax, w_t, keep, keep_max, plan, gx, gw, gb
    logitless::lce_backward(grad_loss, grad_lse, x, weight, bias, target, class_weight, lse, w_t,
                            keep (overwritten with dz), keep_max, plan, <options>,
                            backend, budget, need_dx, need_dw, need_db, <vocab parallel>)
        -> dx, dw, db

``<options>`` are the fields of ``CrossEntropyOptions`` under their own names
(ignore_index, reduction, label_smoothing, softcap, z_loss); ``<vocab parallel>``
those of ``VocabParallelOptions`` (tp_group, vocab_size, partial_dx): with a
``tp_group`` the weight is this rank's block of rows of a vocab-parallel head and the
ops merge statistics over the group (``vocab_parallel``). The per-token ``lse`` is
differentiable (``grad_lse``: d lse / d z_c = p_c adds to the A coefficient), so that
``LossStats.lse`` can enter a loss of the caller's.

Their implementations run eagerly, also under torch.compile (which sees only the fake
implementations: output shapes and dtypes), so they may branch on data: the CPU
target-range check lives here. ``keep``/``keep_max`` are the columns of exp(z - m) the
Triton backend kept for the backward (``NOTHING_KEPT``-shaped dummies and an empty
``plan`` when it kept none): the backward turns
them into dz in place (declared as a mutation), so they serve one backward, with the
forward's launch plan (``plan``: its fields in a CPU int64 tensor, read without a
device sync: the plan may depend on tuned or forced tiles at the time of the forward); the
autograd glue hands them to the first backward only, a second one (retain_graph=True)
recomputes instead. Absent outputs (argmax without return_stats, gradients not
needed) are tensors of size 0. Options are plain ints/floats/strings.

Double backward is not supported: differentiating the gradients raises.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from logitless.formulas.common import compute_dtype, reduce
from logitless.formulas.cross_entropy import TokenStats, grad_coefficients, token_loss, upstream_per_token
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
from logitless.ops.common.grad_in_forward import scale_grads
from logitless.ops.common.kept import fake_kept, fake_kept_tensors, nothing_kept
from logitless.ops.common.validate import check_targets_in_range
from logitless.options import CrossEntropyOptions, VocabParallelOptions

OP = "linear_cross_entropy"


def _forward(
    x: Tensor,
    weight: Tensor,
    bias: Optional[Tensor],
    target: Tensor,
    class_weight: Optional[Tensor],
    ignore_index: int,
    reduction: str,
    label_smoothing: float,
    softcap: Optional[float],
    z_loss: float,
    backend: str,
    budget: int,
    need_argmax: bool,
    need_grad: bool,
    grad_in_forward: int,
    need_dx: bool,
    need_dw: bool,
    need_db: bool,
    tp_group: str = "",
    vocab_size: int = -1,
    partial_dx: bool = False,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """x (N, H), weight (V, H), target (N,) int64 -> loss (() or (N,)), lse (N,),
    argmax (N,) or (0,), w_t (N,), keep, keep_max, plan (see the module docstring), and
    gx, gw, gb: with ``grad_in_forward`` > 0 (tokens per chunk of the Triton backend's
    gradient-in-forward strategy) the gradients for grad_output = 1 that the backward
    scales (gx in x's dtype; gw in weight's dtype for one chunk, else fp32; gb fp32)."""
    opts = CrossEntropyOptions(ignore_index, reduction, label_smoothing, softcap, z_loss)
    tp = VocabParallelOptions(tp_group, vocab_size, partial_dx)
    n, v = x.shape[0], weight.shape[0]
    sd = compute_dtype(x.dtype)
    kept = grads = None
    if tp.parallel:
        from . import vocab_parallel

        with no_autocast(x.device):
            loss, lse, argmax, w_t, kept = vocab_parallel.forward(
                load_backend(__package__, backend), x, weight, bias, target, class_weight, opts, tp,
                budget=budget, need_argmax=need_argmax, need_grad=need_grad)
        return _outputs(x, target, loss, lse, argmax if need_argmax else None, w_t, kept, None)
    check_targets_in_range(target, v, ignore_index)
    loss = None
    with no_autocast(x.device):
        if n == 0:
            empty = x.new_empty(0, dtype=sd)
            stats = TokenStats(empty, empty, empty, target.new_empty(0, dtype=torch.int64))
        elif grad_in_forward > 0:
            stats, grads = _grad_in_forward_strategy().forward_with_grad(
                x, weight, bias, target, class_weight, opts, token_chunk=grad_in_forward,
                need_smooth=opts.needs_smooth_sum, need_argmax=need_argmax, need_dx=need_dx,
                need_dw=need_dw, need_db=need_db, budget=budget,
            )
        elif backend == "triton":  # the loss epilogue fused into one launch (ce_epilogue)
            stats, kept, loss, w_t = load_backend(__package__, backend).forward(
                x, weight, bias, target, class_weight, softcap,
                need_smooth=opts.needs_smooth_sum, need_argmax=need_argmax, budget=budget,
                need_grad=need_grad, loss_opts=opts,
            )
        else:
            stats, kept = load_backend(__package__, backend).forward(
                x, weight, bias, target, class_weight, softcap,
                need_smooth=opts.needs_smooth_sum, need_argmax=need_argmax, budget=budget,
                need_grad=need_grad,
            )
        if loss is None:
            loss_tok, w_t = token_loss(stats, target, v, class_weight, opts)
            loss = reduce(loss_tok, w_t, reduction)
    return _outputs(x, target, loss, stats.lse, stats.argmax if need_argmax else None, w_t, kept, grads)


def _outputs(x, target, loss, lse, argmax, w_t, kept, grads):
    """The forward op's outputs (module docstring) from its results."""
    sd = compute_dtype(x.dtype)
    argmax = argmax if argmax is not None else target.new_empty(0, dtype=torch.int64)
    if kept is None:
        kept = nothing_kept(x)
    grads = [g if g is not None else x.new_empty(0) for g in (grads or (None,) * 3)]
    return (loss.to(sd), lse.to(sd), argmax, w_t.to(sd), kept[0], kept[1], kept[2], *grads)


lce_forward = custom_op("lce_forward", _forward)


@lce_forward.register_fake
def _(x, weight, bias, target, class_weight, ignore_index, reduction, label_smoothing,
      softcap, z_loss, backend, budget, need_argmax, need_grad, grad_in_forward, need_dx,
      need_dw, need_db, tp_group="", vocab_size=-1, partial_dx=False):
    n, (v, h) = x.shape[0], weight.shape
    sd = compute_dtype(x.dtype)
    loss = x.new_empty((n,) if reduction == "none" else (), dtype=sd)
    grads = [x.new_empty(0) for _ in range(3)]
    kept = fake_kept_tensors(x)
    if grad_in_forward > 0 and n > 0:  # (eager only: the public function passes 0 when compiling)
        f32 = torch.float32
        grads = [
            torch.empty_like(x) if need_dx else grads[0],
            (torch.empty_like(weight) if grad_in_forward >= n else weight.new_empty(v, h, dtype=f32))
            if need_dw else grads[1],
            weight.new_empty(v, dtype=f32) if need_db else grads[2],
        ]
    elif backend == "triton" and need_grad and not (tp_group and isinstance(v, int) and v == 0):
        from .triton_backend import PLAN_SIZE, kept_shapes

        kept = fake_kept(x, weight, tp_group, vocab_size, PLAN_SIZE, lambda n, v, h: kept_shapes(
            n, v, h, x.dtype, budget, x.device, softcap, need_grad))
    return (
        loss,
        x.new_empty(n, dtype=sd),
        x.new_empty(n if need_argmax else 0, dtype=torch.int64),
        x.new_empty(n, dtype=sd),
        *kept,
        *grads,
    )


def _backward(
    grad_loss: Tensor,
    grad_lse: Optional[Tensor],
    x: Tensor,
    weight: Tensor,
    bias: Optional[Tensor],
    target: Tensor,
    class_weight: Optional[Tensor],
    lse: Tensor,
    w_t: Tensor,
    keep: Tensor,
    keep_max: Tensor,
    plan: Tensor,
    ignore_index: int,
    reduction: str,
    label_smoothing: float,
    softcap: Optional[float],
    z_loss: float,
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
    opts = CrossEntropyOptions(ignore_index, reduction, label_smoothing, softcap, z_loss)
    tp = VocabParallelOptions(tp_group, vocab_size, partial_dx)
    n, v = x.shape[0], weight.shape[0]
    dx = dw = db = None
    if n == 0:
        dx, dw, db = zero_grads(x, weight, bias)
    elif need_dx or need_dw or need_db:
        impl = load_backend(__package__, backend)
        extra = {}
        if plan.numel():  # the forward kept columns: its buffers, and its plan (which laid them out)
            extra = dict(kept=(keep, keep_max), plan=impl.plan_from_tensor(plan))
        with no_autocast(x.device):
            if tp.parallel:
                from . import vocab_parallel

                dx, dw, db = vocab_parallel.backward(
                    impl, grad_loss, grad_lse, x, weight, bias, target, class_weight, lse, w_t, opts, tp,
                    budget=budget, need_dx=need_dx, need_dw=need_dw, need_db=need_db, extra=extra)
            else:
                if backend == "triton":  # the same coefficients in one launch (ce_epilogue)
                    coef = impl.grad_coefficients(grad_loss, grad_lse, lse, w_t, target, class_weight, opts, v)
                else:
                    g = upstream_per_token(grad_loss, w_t, reduction)
                    coef = grad_coefficients(lse, target, g, v, class_weight, opts)
                    if grad_lse is not None:  # d lse / d z_c = p_c: the A term, at every token
                        coef[0] += grad_lse.to(coef.dtype)
                dx, dw, db = impl.backward(
                    x, weight, bias, target, class_weight, softcap, lse, coef,
                    need_dx=need_dx, need_dw=need_dw, need_db=need_db, budget=budget, **extra,
                )
    return grad_outputs(x, dx, dw, db, need_dx, need_dw, need_db)


lce_backward = custom_op("lce_backward", _backward, mutates_args=("keep",))
_eager_backward = below_autograd(_backward)  # what lce_backward runs, for the eager fast path


@lce_backward.register_fake
def _(grad_loss, grad_lse, x, weight, bias, target, class_weight, lse, w_t, keep, keep_max, plan,
      ignore_index, reduction, label_smoothing, softcap, z_loss, backend, budget,
      need_dx, need_dw, need_db, tp_group="", vocab_size=-1, partial_dx=False):
    return fake_grad_outputs(x, weight, bias, need_dx, need_dw, need_db)


def _grad_in_forward_strategy():
    """The Triton backend's gradient-in-forward strategy (its own module beside it)."""
    from . import triton_grad_in_forward

    return triton_grad_in_forward


def grad_in_forward_chunk(backend: str, x: Tensor, weight: Tensor, budget: int, opts: CrossEntropyOptions) -> int:
    """Tokens per chunk when the Triton planner picks gradient-in-forward for this call
    (the forward also computes the gradients), else 0. Eager only: the public function
    never asks under torch.compile."""
    if backend != "triton" or x.shape[0] == 0:
        return 0
    return _grad_in_forward_strategy().grad_in_forward_chunk(x, weight, budget, opts, opts.softcap) or 0


def _setup_context(ctx, inputs, output):
    a = named(_forward, inputs)
    _, lse, argmax, w_t, keep, keep_max, plan, gx, gw, gb = output
    ctx.save_for_backward(a["x"], a["weight"], a["bias"], a["target"], a["class_weight"], lse, w_t)
    ctx.opts = CrossEntropyOptions.from_args(a)
    ctx.tp = VocabParallelOptions.from_args(a)
    ctx.backend, ctx.budget, ctx.num_inputs = a["backend"], a["budget"], len(inputs)
    # Not saved tensors: the first backward consumes them (in place) and drops them.
    ctx.kept = (keep, keep_max, plan)
    ctx.grads_in_forward = (gx, gw, gb) if a["grad_in_forward"] > 0 else None
    ctx.mark_non_differentiable(argmax, w_t, keep, keep_max, plan, gx, gw, gb)
    # Otherwise autograd hands the backward a zero-filled gradient for each of these
    # outputs: a memset as large as the kept columns (1 GB at llama3 with a logits-sized
    # budget) and the fp32 dW of gradient-in-forward, allocated on top of them.
    ctx.set_materialize_grads(False)


def _autograd_backward(ctx, grad_loss, grad_lse, *_):
    x, weight, bias, target, class_weight, lse, w_t = ctx.saved_tensors
    keep, keep_max, plan = ctx.kept
    if grad_loss is None:  # gradients are not materialised: the loss got none
        grad_loss = torch.zeros(lse.shape if ctx.opts.reduction == "none" else (), dtype=lse.dtype, device=x.device)
    ctx.kept = nothing_kept(keep)
    forward_grads, ctx.grads_in_forward = ctx.grads_in_forward, None
    need_dx, need_dw, need_db = ctx.needs_input_grad[:3]
    if not (need_dx or need_dw or need_db):
        return (None,) * ctx.num_inputs

    op = _eager_backward if getattr(ctx, "eager", False) else lce_backward  # (EagerOp: the same computation)

    def backward(g_loss, g_lse, kept):
        return op(g_loss, g_lse, x, weight, bias, target, class_weight, lse, w_t, *kept,
                            *ctx.opts.args(), ctx.backend, ctx.budget, need_dx, need_dw, need_db,
                            *ctx.tp.args())

    if forward_grads is not None and x.shape[0] > 0:
        # Gradient-in-forward (eager): scale the forward's gradients by grad_output, in place;
        # a gradient of lse (rare: the caller's own use of stats.lse) comes on top.
        present = [g if g.numel() else None for g in forward_grads]
        grads = scale_grads(present, grad_loss, x.dtype, weight.dtype)
        if grad_lse is not None:
            extra = backward(torch.zeros_like(grad_loss), grad_lse, ctx.kept)
            grads = tuple(g + e if g is not None else None for g, e in zip(grads, extra))
    else:
        grads = backward(grad_loss, grad_lse, (keep, keep_max, plan))
    grads = (grads[0] if need_dx else None, grads[1] if need_dw else None, grads[2] if need_db else None)
    grads = guard_double_backward(OP, grads, grad_loss, grad_lse, x, weight, bias)
    return grads + (None,) * (ctx.num_inputs - 3)


# The backward plans (and reads ``override(...)``) as its forward did, on any thread.
_setup, _backward_of_ctx = under_forward_overrides(_setup_context, _autograd_backward)
lce_forward.register_autograd(_backward_of_ctx, setup_context=_setup)
#: What the public function calls: ``lce_forward``, through a plain autograd.Function in eager mode.
lce_forward_eager = EagerOp(lce_forward, _forward, _setup, _backward_of_ctx)
