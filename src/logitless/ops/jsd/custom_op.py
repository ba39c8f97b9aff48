"""The torch.library custom ops of jsd: what autograd and torch.compile see.

    logitless::jsd_forward(student_logits, teacher_logits, target, <options>, budget, backend)
        -> per-token loss (N,), statistics (6, N)
    logitless::jsd_backward(grad_loss, student_logits, teacher_logits, target, stats,
                            <options>, budget, backend)
        -> d loss / d student_logits (N, V)

``<options>`` are the fields of ``JSDOptions`` under their own names (beta, temperature,
ignore_index, student_softcap, teacher_softcap, hard_label_weight). Validation and the
reduction are plain Python/torch around the ops (``api.py``), so ``fullgraph=True``
works. Double backward is not supported: differentiating the gradient raises.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from logitless.formulas.common import compute_dtype
from logitless.formulas.jsd import NUM_STATS, token_loss, upstream
from logitless.ops.common.autocast import disabled as no_autocast
from logitless.ops.common.autograd import custom_op, guard_double_backward, named, under_forward_overrides
from logitless.ops.common.dispatch import backend_module
from logitless.ops.common.validate import check_targets_in_range
from logitless.options import JSDOptions

OP = "jsd"


def _forward(
    student_logits: Tensor, teacher_logits: Tensor, target: Tensor,
    beta: float, temperature: float, ignore_index: int,
    student_softcap: Optional[float], teacher_softcap: Optional[float],
    hard_label_weight: float, budget: int, backend: str,
) -> tuple[Tensor, Tensor]:
    """(per-token loss (N,), statistics (6, N)) of 2-D logits; fp32 (fp64 for fp64)."""
    opts = JSDOptions(beta, temperature, ignore_index, student_softcap, teacher_softcap, hard_label_weight)
    n, v = student_logits.shape
    dtype = compute_dtype(student_logits.dtype, teacher_logits.dtype)
    if opts.hard_label_weight != 0.0:
        check_targets_in_range(target, v, ignore_index)  # CPU only: no sync
    if n == 0:
        stats = student_logits.new_zeros(NUM_STATS, 0, dtype=dtype)
    else:
        impl = backend_module(__package__, backend, student_logits.device, student_logits.dtype)
        with no_autocast(student_logits.device):
            stats = impl.forward(student_logits, teacher_logits, target, opts, budget)
    return token_loss(stats, target, v, opts).to(dtype), stats.to(dtype)


jsd_forward_op = custom_op("jsd_forward", _forward)


@jsd_forward_op.register_fake
def _(student_logits, teacher_logits, target, *args):
    dtype = compute_dtype(student_logits.dtype, teacher_logits.dtype)
    n = student_logits.shape[0]
    return student_logits.new_empty(n, dtype=dtype), student_logits.new_empty(NUM_STATS, n, dtype=dtype)


def _backward(
    grad_loss: Tensor, student_logits: Tensor, teacher_logits: Tensor, target: Tensor,
    stats: Tensor, beta: float, temperature: float, ignore_index: int,
    student_softcap: Optional[float], teacher_softcap: Optional[float],
    hard_label_weight: float, budget: int, backend: str,
) -> Tensor:
    """d loss / d student_logits (N, V), in the student logits' dtype."""
    opts = JSDOptions(beta, temperature, ignore_index, student_softcap, teacher_softcap, hard_label_weight)
    if student_logits.shape[0] == 0:
        return torch.zeros_like(student_logits)
    g = upstream(grad_loss, target, ignore_index)
    impl = backend_module(__package__, backend, student_logits.device, student_logits.dtype)
    with no_autocast(student_logits.device):
        return impl.backward(g, student_logits, teacher_logits, target, stats, opts, budget)


jsd_backward_op = custom_op("jsd_backward", _backward)


@jsd_backward_op.register_fake
def _(grad_loss, student_logits, *args):
    return torch.empty_like(student_logits)


def _setup_context(ctx, inputs, output):
    a = named(_forward, inputs)
    ctx.save_for_backward(a["student_logits"], a["teacher_logits"], a["target"], output[1])
    ctx.opts = JSDOptions.from_args(a)
    ctx.budget, ctx.backend, ctx.num_inputs = a["budget"], a["backend"], len(inputs)


def _autograd_backward(ctx, grad_loss, _grad_stats):
    student_logits, teacher_logits, target, stats = ctx.saved_tensors
    d_student = None
    if ctx.needs_input_grad[0]:
        d_student = jsd_backward_op(grad_loss, student_logits, teacher_logits, target, stats,
                                    *ctx.opts.args(), ctx.budget, ctx.backend)
        (d_student,) = guard_double_backward(OP, (d_student,), grad_loss, student_logits)
    return (d_student,) + (None,) * (ctx.num_inputs - 1)


# The backward plans (and reads ``override(...)``) as its forward did, on any thread.
_setup, _backward = under_forward_overrides(_setup_context, _autograd_backward)
jsd_forward_op.register_autograd(_backward, setup_context=_setup)
