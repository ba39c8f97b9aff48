"""The torch.library custom ops of linear_jsd: what autograd and torch.compile see.

    logitless::linear_jsd_forward(student_x, student_weight, student_bias, teacher_x,
        teacher_weight, teacher_bias, target, <options>, budget, backend, <vocab parallel>)
        -> per-token loss (N,), statistics (6, N)
    logitless::linear_jsd_backward(grad_loss, <the forward's tensors>, stats, <options>,
        budget, backend, need_dx, need_dw, need_db, <vocab parallel>) -> the student's dx, dW, db

``<options>`` are the fields of ``JSDOptions`` under their own names; ``<vocab
parallel>`` those of ``VocabParallelOptions`` (tp_group, vocab_size, partial_dx): with
a ``tp_group`` both weights are this rank's blocks of rows of vocab-parallel heads
(``vocab_parallel``). Validation,
autocast casts and the reduction are plain Python/torch around the ops (``api.py``),
so ``fullgraph=True`` works. Double backward is not supported.
"""

from __future__ import annotations

from typing import Optional

from torch import Tensor

from logitless.formulas.common import compute_dtype
from logitless.formulas.jsd import NUM_STATS, reduce, token_loss
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
from logitless.ops.common.dispatch import backend_module
from logitless.ops.common.grad_in_forward import scale_grads
from logitless.ops.common.validate import check_targets_in_range
from logitless.options import JSDOptions, VocabParallelOptions

OP = "linear_jsd"


def _forward(
    student_x: Tensor, student_weight: Tensor, student_bias: Optional[Tensor],
    teacher_x: Tensor, teacher_weight: Tensor, teacher_bias: Optional[Tensor],
    target: Tensor, beta: float, temperature: float, ignore_index: int,
    student_softcap: Optional[float], teacher_softcap: Optional[float],
    hard_label_weight: float, reduction: str, budget: int, backend: str,
    tp_group: str = "", vocab_size: int = -1, partial_dx: bool = False,
) -> tuple[Tensor, Tensor]:
    """(loss: () for "mean"/"sum", per token (N,) for "none"; statistics (6, N)) for 2-D
    x's; fp32 (fp64 for fp64). The Triton backend computes the loss from the statistics
    in one launch (``triton_lib.jsd_epilogue``), the torch backend with the formulas."""
    opts = JSDOptions(beta, temperature, ignore_index, student_softcap, teacher_softcap, hard_label_weight)
    if tp_group:
        from logitless.formulas.jsd import reduce as _reduce

        from . import vocab_parallel

        impl = backend_module(__package__, backend, student_x.device, student_x.dtype)
        with no_autocast(student_x.device):
            loss_tok, stats = vocab_parallel.forward(
                impl, student_x, student_weight, student_bias, teacher_x, teacher_weight, teacher_bias, target,
                opts, VocabParallelOptions(tp_group, vocab_size, partial_dx), budget)
        return _reduce(loss_tok, target, reduction, ignore_index), stats
    n, v = student_x.shape[0], student_weight.shape[0]
    dtype = compute_dtype(student_x.dtype)
    if opts.hard_label_weight != 0.0:
        check_targets_in_range(target, v, ignore_index)  # CPU only: no sync
    if n == 0:
        stats = student_x.new_zeros(NUM_STATS, 0, dtype=dtype)
        return reduce(token_loss(stats, target, v, opts), target, reduction, ignore_index), stats
    impl = backend_module(__package__, backend, student_x.device, student_x.dtype)
    with no_autocast(student_x.device):
        stats = impl.forward(student_x, student_weight, student_bias, teacher_x, teacher_weight,
                             teacher_bias, target, opts, budget)
        loss = impl.forward_loss(stats, target, v, opts, reduction)
    return loss.to(dtype), stats.to(dtype)


linear_jsd_forward_op = custom_op("linear_jsd_forward", _forward)


@linear_jsd_forward_op.register_fake
def _(student_x, student_weight, student_bias, teacher_x, teacher_weight, teacher_bias, target, beta,
      temperature, ignore_index, student_softcap, teacher_softcap, hard_label_weight, reduction, *args):
    dtype = compute_dtype(student_x.dtype)
    n = student_x.shape[0]
    loss = student_x.new_empty((n,) if reduction == "none" else (), dtype=dtype)
    return loss, student_x.new_empty(NUM_STATS, n, dtype=dtype)


def _backward(
    grad_loss: Tensor, student_x: Tensor, student_weight: Tensor, student_bias: Optional[Tensor],
    teacher_x: Tensor, teacher_weight: Tensor, teacher_bias: Optional[Tensor],
    target: Tensor, stats: Tensor, beta: float, temperature: float, ignore_index: int,
    student_softcap: Optional[float], teacher_softcap: Optional[float],
    hard_label_weight: float, reduction: str, budget: int, backend: str,
    need_dx: bool, need_dw: bool, need_db: bool,
    tp_group: str = "", vocab_size: int = -1, partial_dx: bool = False,
) -> tuple[Tensor, Tensor, Tensor]:
    """(dx, dW, db) of the student; an empty tensor for each one not asked for.
    ``grad_loss``: the gradient of the forward's (reduced) loss; the backend turns it into
    the per-token upstream gradient (Triton: one launch, ``jsd_epilogue.upstream``)."""
    opts = JSDOptions(beta, temperature, ignore_index, student_softcap, teacher_softcap, hard_label_weight)
    need_db = need_db and student_bias is not None
    if student_x.shape[0] == 0:
        dx, dw, db = zero_grads(student_x, student_weight, student_bias)
    else:
        impl = backend_module(__package__, backend, student_x.device, student_x.dtype)
        with no_autocast(student_x.device):
            g = impl.upstream(grad_loss, target, ignore_index, reduction)
            if tp_group:
                from . import vocab_parallel

                dx, dw, db = vocab_parallel.backward(
                    impl, g, student_x, student_weight, student_bias, teacher_x, teacher_weight, teacher_bias,
                    target, stats, opts, VocabParallelOptions(tp_group, vocab_size, partial_dx), budget,
                    need_dx, need_dw, need_db)
            else:
                dx, dw, db = impl.backward(
                    g, student_x, student_weight, student_bias, teacher_x, teacher_weight, teacher_bias,
                    target, stats, opts, budget, need_dx, need_dw, need_db)
    return grad_outputs(student_x, dx, dw, db, need_dx, need_dw, need_db)


linear_jsd_backward_op = custom_op("linear_jsd_backward", _backward)
_eager_backward = below_autograd(_backward)  # what linear_jsd_backward_op runs, for the eager fast path


@linear_jsd_backward_op.register_fake
def _(grad_loss, student_x, student_weight, student_bias, teacher_x, teacher_weight, teacher_bias, target, stats,
      beta, temperature, ignore_index, student_softcap, teacher_softcap, hard_label_weight, reduction, budget,
      backend, need_dx, need_dw, need_db, tp_group="", vocab_size=-1, partial_dx=False):
    # Named, with the defaults: a compiled graph leaves defaulted arguments out of the call.
    return fake_grad_outputs(student_x, student_weight, student_bias, need_dx, need_dw,
                             need_db and student_bias is not None)


_TENSORS = ("student_x", "student_weight", "student_bias", "teacher_x", "teacher_weight", "teacher_bias", "target")


def _setup_context(ctx, inputs, output):
    a = named(_forward, inputs)
    ctx.save_for_backward(*(a[k] for k in _TENSORS), output[1])
    ctx.opts = JSDOptions.from_args(a)
    ctx.tp = VocabParallelOptions.from_args(a)
    ctx.budget, ctx.backend, ctx.num_inputs = a["budget"], a["backend"], len(inputs)
    ctx.reduction = a["reduction"]
    ctx.mark_non_differentiable(output[1])
    ctx.set_materialize_grads(False)  # (no zero-filled gradient of the statistics)


def _autograd_backward(ctx, grad_loss, _grad_stats):
    xs, ws, bs, xt, wt, bt, target, stats = ctx.saved_tensors
    need_dx, need_dw, need_db = ctx.needs_input_grad[:3]
    grads = (None, None, None)
    if grad_loss is not None and (need_dx or need_dw or need_db):
        op = _eager_backward if getattr(ctx, "eager", False) else linear_jsd_backward_op  # (EagerOp: the same)
        dx, dw, db = op(
            grad_loss, xs, ws, bs, xt, wt, bt, target, stats, *ctx.opts.args(), ctx.reduction, ctx.budget,
            ctx.backend, need_dx, need_dw, need_db, *ctx.tp.args())
        grads = (dx if need_dx else None, dw if need_dw else None, db if need_db else None)
        grads = guard_double_backward(OP, grads, grad_loss, xs, ws, bs)
    return grads + (None,) * (ctx.num_inputs - 3)


# The backward plans (and reads ``override(...)``) as its forward did, on any thread.
_setup, _backward_of_ctx = under_forward_overrides(_setup_context, _autograd_backward)
linear_jsd_forward_op.register_autograd(_backward_of_ctx, setup_context=_setup)
#: What the public function calls: ``linear_jsd_forward_op``, through a plain
#: autograd.Function in eager mode (``EagerOp``: the same computation, bitwise).
linear_jsd_forward_eager = EagerOp(linear_jsd_forward_op, _forward, _setup, _backward_of_ctx)


# --------------------------------------------------------------------------- gradient in the forward
#
#    logitless::linear_jsd_gif_forward(<the forward's tensors>, <options>, reduction, budget,
#        token_chunk, need_dx, need_dw, need_db) -> loss (reduced), statistics (6, N), gx, gw, gb
#
# The Triton backend's gradient-in-forward strategy (``triton_grad_in_forward``): the
# forward also computes the student's gradients for grad_output = 1 ("mean"/"sum"), the
# backward only scales them. Eager only: the public function never picks it under
# torch.compile, with vocabulary parallelism or for reduction="none".


def _grad_in_forward_strategy():
    from . import triton_grad_in_forward

    return triton_grad_in_forward


def grad_in_forward_chunk(backend: str, student_x: Tensor, student_weight: Tensor, teacher_x: Tensor,
                          budget: int, opts: JSDOptions) -> int:
    """Tokens per chunk when the Triton planner picks gradient-in-forward, else 0."""
    from logitless.ops.common.dispatch import resolve_backend

    if student_x.shape[0] == 0 or resolve_backend(backend, student_x.device, student_x.dtype) != "triton":
        return 0
    return _grad_in_forward_strategy().grad_in_forward_chunk(student_x, student_weight, teacher_x, budget, opts)


def _gif_forward(
    student_x: Tensor, student_weight: Tensor, student_bias: Optional[Tensor],
    teacher_x: Tensor, teacher_weight: Tensor, teacher_bias: Optional[Tensor],
    target: Tensor, beta: float, temperature: float, ignore_index: int,
    student_softcap: Optional[float], teacher_softcap: Optional[float],
    hard_label_weight: float, reduction: str, budget: int, token_chunk: int,
    need_dx: bool, need_dw: bool, need_db: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(reduced loss, statistics (6, N), gx, gw, gb); the gradients for grad_output = 1
    (empty where not asked for; gw fp32 unless one chunk covers every token)."""
    opts = JSDOptions(beta, temperature, ignore_index, student_softcap, teacher_softcap, hard_label_weight)
    v = student_weight.shape[0]
    dtype = compute_dtype(student_x.dtype)
    if opts.hard_label_weight != 0.0:
        check_targets_in_range(target, v, ignore_index)  # CPU only: no sync
    need_db = need_db and student_bias is not None
    strategy = _grad_in_forward_strategy()
    with no_autocast(student_x.device):
        stats, grads = strategy.forward_with_grad(
            student_x, student_weight, student_bias, teacher_x, teacher_weight, teacher_bias, target, opts,
            reduction, token_chunk=token_chunk, need_dx=need_dx, need_dw=need_dw, need_db=need_db)
        loss = strategy.forward_loss(stats, target, v, opts, reduction)
    grads = [g if g is not None else student_x.new_empty(0) for g in grads]
    return (loss.to(dtype), stats.to(dtype), *grads)


linear_jsd_gif_forward_op = custom_op("linear_jsd_gif_forward", _gif_forward)


@linear_jsd_gif_forward_op.register_fake
def _(student_x, student_weight, student_bias, teacher_x, teacher_weight, teacher_bias, target, beta,
      temperature, ignore_index, student_softcap, teacher_softcap, hard_label_weight, reduction, budget,
      token_chunk, need_dx, need_dw, need_db):
    import torch

    dtype = compute_dtype(student_x.dtype)
    n, (v, h) = student_x.shape[0], student_weight.shape
    one = token_chunk >= n or student_weight.dtype == torch.float32
    return (student_x.new_empty((), dtype=dtype), student_x.new_empty(NUM_STATS, n, dtype=dtype),
            torch.empty_like(student_x) if need_dx else student_x.new_empty(0),
            (torch.empty_like(student_weight) if one else student_weight.new_empty(v, h, dtype=torch.float32))
            if need_dw else student_x.new_empty(0),
            student_weight.new_empty(v, dtype=torch.float32) if need_db and student_bias is not None
            else student_x.new_empty(0))


def _gif_setup_context(ctx, inputs, output):
    a = named(_gif_forward, inputs)
    _, stats, gx, gw, gb = output
    ctx.x_dtype, ctx.w_dtype = a["student_x"].dtype, a["student_weight"].dtype
    ctx.num_inputs = len(inputs)
    ctx.grads = (gx, gw, gb)  # not saved tensors: the one backward scales them in place
    ctx.mark_non_differentiable(stats, gx, gw, gb)
    ctx.set_materialize_grads(False)


def _gif_backward(ctx, grad_loss, *_):
    grads, ctx.grads = ctx.grads, None
    need_dx, need_dw, need_db = ctx.needs_input_grad[:3]
    if grad_loss is None or grads is None or not (need_dx or need_dw or need_db):
        return (None,) * ctx.num_inputs
    present = [g if g.numel() else None for g in grads]
    dx, dw, db = scale_grads(present, grad_loss, ctx.x_dtype, ctx.w_dtype)
    out = (dx if need_dx else None, dw if need_dw else None, db if need_db else None)
    out = guard_double_backward(OP, out, grad_loss)
    return out + (None,) * (ctx.num_inputs - 3)


# The backward plans (and reads ``override(...)``) as its forward did, on any thread.
_gif_setup, _gif_backward_of_ctx = under_forward_overrides(_gif_setup_context, _gif_backward)
linear_jsd_gif_forward_op.register_autograd(_gif_backward_of_ctx, setup_context=_gif_setup)
linear_jsd_gif_forward_eager = EagerOp(linear_jsd_gif_forward_op, _gif_forward, _gif_setup, _gif_backward_of_ctx)
