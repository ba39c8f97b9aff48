"""The torch.library custom ops of jsd: what autograd and torch.compile see.

    logitless::jsd_forward(student_logits, teacher_logits, target, <options>, budget, backend)
        -> per-token loss (N,), statistics (6, N)
    logitless::jsd_backward(grad_loss, student_logits, teacher_logits, target, stats,
                            <options>, budget, backend)
        -> d loss / d student_logits (N, V)

``<options>`` are the fields of ``JSDOptions`` under their own names (beta, temperature,
ignore_index, student_softcap, teacher_softcap, hard_label_weight). Validation and the
reduction are plain Python/torch around the ops (``api.py``), so ``fullgraph=True``
works. The ops, their fakes and autograd are built from ``SPEC`` (``ops.common.spec``).
Double backward is not supported: differentiating the gradient raises.
"""

from __future__ import annotations

import torch
from torch import Tensor

from logitless.formulas.common import compute_dtype
from logitless.formulas.jsd import NUM_STATS, token_loss, upstream
from logitless.ops.common.autocast import disabled as no_autocast
from logitless.ops.common.dispatch import backend_module
from logitless.ops.common.spec import OpSpec, build, options, scalar, tensor
from logitless.ops.common.validate import check_targets_in_range
from logitless.options import JSDOptions

OP = "jsd"


def _forward(student_logits: Tensor, teacher_logits: Tensor, target: Tensor, opts: JSDOptions, budget: int,
             backend: str):
    """(per-token loss (N,), statistics (6, N)) of 2-D logits; fp32 (fp64 for fp64)."""
    n, v = student_logits.shape
    dtype = compute_dtype(student_logits.dtype, teacher_logits.dtype)
    if opts.hard_label_weight != 0.0:
        check_targets_in_range(target, v, opts.ignore_index)  # CPU only: no sync
    if n == 0:
        stats = student_logits.new_zeros(NUM_STATS, 0, dtype=dtype)
    else:
        impl = backend_module(__package__, backend, student_logits.device, student_logits.dtype)
        with no_autocast(student_logits.device):
            stats = impl.forward(student_logits, teacher_logits, target, opts, budget)
    return token_loss(stats, target, v, opts).to(dtype), stats.to(dtype)


def _forward_fake(student_logits, teacher_logits, *_):
    dtype = compute_dtype(student_logits.dtype, teacher_logits.dtype)
    n = student_logits.shape[0]
    return student_logits.new_empty(n, dtype=dtype), student_logits.new_empty(NUM_STATS, n, dtype=dtype)


def _backward(grad_loss: Tensor, student_logits: Tensor, teacher_logits: Tensor, target: Tensor, stats: Tensor,
              opts: JSDOptions, budget: int, backend: str) -> Tensor:
    """d loss / d student_logits (N, V), in the student logits' dtype."""
    if student_logits.shape[0] == 0:
        return torch.zeros_like(student_logits)
    g = upstream(grad_loss, target, opts.ignore_index)
    impl = backend_module(__package__, backend, student_logits.device, student_logits.dtype)
    with no_autocast(student_logits.device):
        return impl.backward(g, student_logits, teacher_logits, target, stats, opts, budget)


def _backward_fake(grad_loss, student_logits, *_):
    return torch.empty_like(student_logits)


_TENSORS = (tensor("student_logits"), tensor("teacher_logits"), tensor("target"))
_EXEC = (scalar("budget", int), scalar("backend", str))

SPEC = OpSpec(
    op=OP,
    name="jsd_forward",
    forward=(*_TENSORS, options("opts", JSDOptions), *_EXEC),
    outputs=("loss", "stats"),
    forward_impl=_forward,
    forward_fake=_forward_fake,
    backward_name="jsd_backward",
    backward=(tensor("grad_loss"), *_TENSORS, tensor("stats"), options("opts", JSDOptions), *_EXEC),
    backward_impl=_backward,
    backward_fake=_backward_fake,
    grads=("grad_loss", None),
    grad_inputs=("student_logits",),
    materialize_grads=True,  # (an unused loss gets a zero gradient)
)

_built = build(SPEC)
jsd_forward_op, jsd_backward_op = _built.forward_op, _built.backward_op
