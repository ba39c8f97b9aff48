"""The torch.library custom ops of linear_jsd: what autograd and torch.compile see.

    logitless::linear_jsd_forward(student_x, student_weight, student_bias, teacher_x,
        teacher_weight, teacher_bias, target, <options>, reduction, budget, backend,
        grad_in_forward, need_dx, need_dw, need_db, <vocab parallel>)
        -> loss (per token (N,) for "none"), statistics (6, N), gx, gw, gb
    logitless::linear_jsd_backward(grad_loss, <the forward's tensors>, stats, <options>, reduction,
        budget, backend, need_dx, need_dw, need_db, <vocab parallel>) -> the student's dx, dW, db

``<options>`` are the fields of ``JSDOptions`` under their own names; ``<vocab
parallel>`` those of ``VocabParallelOptions`` (tp_group, vocab_size, partial_dx): with
a ``tp_group`` both weights are this rank's blocks of rows of vocab-parallel heads
(``vocab_parallel``). Validation,
autocast casts and the reduction are plain Python/torch around the ops (``api.py``),
so ``fullgraph=True`` works. ``grad_in_forward`` allows the backend's gradient-in-forward
strategy (``<backend>_grad_in_forward``; the public function allows it in eager mode for
"mean"/"sum" on one device's heads, and the strategy's planner decides): the forward then
also returns the student's gradients for grad_output = 1 (gx, gw, gb; empty otherwise)
and the backward only scales them (``OpSpec.forward_grads``). The ops, their fakes and
autograd are built from ``SPEC`` (``ops.common.spec``). Double backward is not supported.
"""

from __future__ import annotations

import torch
from torch import Tensor

from logitless.formulas.common import compute_dtype
from logitless.formulas.jsd import NUM_STATS, reduce, token_loss
from logitless.ops.common.autocast import disabled as no_autocast
from logitless.ops.common.autograd import fake_grad_outputs, grad_outputs, zero_grads
from logitless.ops.common.dispatch import LINEAR_BACKENDS, backend_module, load_backend, load_strategy, resolve_backend
from logitless.ops.common.spec import OpSpec, build, options, scalar, tensor
from logitless.ops.common.validate import check_targets_in_range
from logitless.options import JSDOptions, VocabParallelOptions

OP = "linear_jsd"


def _forward(student_x: Tensor, student_weight: Tensor, student_bias, teacher_x: Tensor, teacher_weight: Tensor,
             teacher_bias, target: Tensor, opts: JSDOptions, reduction: str, budget: int, backend: str,
             grad_in_forward: bool, need_dx: bool, need_dw: bool, need_db: bool, tp: VocabParallelOptions):
    """(loss: () for "mean"/"sum", per token (N,) for "none"; statistics (6, N); gx, gw, gb)
    for 2-D x's; fp32 (fp64 for fp64). The Triton backend computes the loss from the
    statistics in one launch (``triton_lib.jsd_epilogue``), the torch backend with the
    formulas. gx, gw, gb: when ``grad_in_forward`` allows it and the backend's planner
    picks that strategy (``<backend>_grad_in_forward``), the student's gradients for
    grad_output = 1 (gw fp32 unless one chunk covers every token), which the backward
    only scales; else (and where not asked for) empty."""
    if tp.tp_group:
        from . import vocab_parallel

        impl = backend_module(__package__, backend, student_x.device, student_x.dtype)
        with no_autocast(student_x.device):
            loss_tok, stats = vocab_parallel.forward(
                impl, student_x, student_weight, student_bias, teacher_x, teacher_weight, teacher_bias, target,
                opts, tp, budget)
        return (reduce(loss_tok, target, reduction, opts.ignore_index), stats,
                *[student_x.new_empty(0) for _ in range(3)])
    n, v = student_x.shape[0], student_weight.shape[0]
    dtype = compute_dtype(student_x.dtype)
    if opts.hard_label_weight != 0.0:
        check_targets_in_range(target, v, opts.ignore_index)  # CPU only: no sync
    if n == 0:
        stats = student_x.new_zeros(NUM_STATS, 0, dtype=dtype)
        loss = reduce(token_loss(stats, target, v, opts), target, reduction, opts.ignore_index)
        return (loss, stats, *[student_x.new_empty(0) for _ in range(3)])
    name = resolve_backend(backend, student_x.device, student_x.dtype, LINEAR_BACKENDS)
    impl = load_backend(__package__, name)
    grads = (None, None, None)
    with no_autocast(student_x.device):
        chunk = _grad_in_forward_chunk(name, student_x, student_weight, teacher_x, opts, reduction, budget,
                                       grad_in_forward)
        if chunk:  # the gradient-in-forward strategy
            stats, grads = load_strategy(__package__, name, "grad_in_forward").forward_with_grad(
                student_x, student_weight, student_bias, teacher_x, teacher_weight, teacher_bias, target, opts,
                reduction, token_chunk=chunk, need_dx=need_dx, need_dw=need_dw,
                need_db=need_db and student_bias is not None)
        else:
            stats = impl.forward(student_x, student_weight, student_bias, teacher_x, teacher_weight,
                                 teacher_bias, target, opts, budget)
        loss = impl.forward_loss(stats, target, v, opts, reduction)
    grads = [g if g is not None else student_x.new_empty(0) for g in grads]
    return (loss.to(dtype), stats.to(dtype), *grads)


def _grad_in_forward_chunk(backend: str, student_x, student_weight, teacher_x, opts, reduction: str, budget: int,
                           allowed: bool) -> int:
    """Tokens per chunk of the backend's gradient-in-forward strategy when the call allows
    it ("mean"/"sum") and its planner picks it, else 0."""
    if not allowed or reduction == "none" or student_x.shape[0] == 0:
        return 0
    strategy = load_strategy(__package__, backend, "grad_in_forward")
    if strategy is None:
        return 0
    return strategy.grad_in_forward_chunk(student_x, student_weight, teacher_x, budget, opts)


def _forward_fake(student_x, student_weight, student_bias, teacher_x, teacher_weight, teacher_bias, target, opts,
                  reduction, budget, backend, grad_in_forward, need_dx, need_dw, need_db, tp):
    dtype = compute_dtype(student_x.dtype)
    n, (v, h) = student_x.shape[0], student_weight.shape
    loss = student_x.new_empty((n,) if reduction == "none" else (), dtype=dtype)
    grads = [student_x.new_empty(0) for _ in range(3)]
    if grad_in_forward and not tp.tp_group and n > 0:  # (eager only: the public function allows it then)
        name = resolve_backend(backend, student_x.device, student_x.dtype, LINEAR_BACKENDS)
        chunk = _grad_in_forward_chunk(name, student_x, student_weight, teacher_x, opts, reduction, budget, True)
        if chunk:
            one = chunk >= n or student_weight.dtype == torch.float32
            f32 = torch.float32
            grads = [torch.empty_like(student_x) if need_dx else grads[0],
                     (torch.empty_like(student_weight) if one else student_weight.new_empty(v, h, dtype=f32))
                     if need_dw else grads[1],
                     student_weight.new_empty(v, dtype=f32) if need_db and student_bias is not None else grads[2]]
    return (loss, student_x.new_empty(NUM_STATS, n, dtype=dtype), *grads)


def _backward(grad_loss: Tensor, student_x: Tensor, student_weight: Tensor, student_bias, teacher_x: Tensor,
              teacher_weight: Tensor, teacher_bias, target: Tensor, stats: Tensor, opts: JSDOptions, reduction: str,
              budget: int, backend: str, need_dx: bool, need_dw: bool, need_db: bool, tp: VocabParallelOptions):
    """(dx, dW, db) of the student; an empty tensor for each one not asked for.
    ``grad_loss``: the gradient of the forward's (reduced) loss; the backend turns it into
    the per-token upstream gradient (Triton: one launch, ``jsd_epilogue.upstream``)."""
    need_db = need_db and student_bias is not None
    if student_x.shape[0] == 0:
        dx, dw, db = zero_grads(student_x, student_weight, student_bias)
    else:
        impl = backend_module(__package__, backend, student_x.device, student_x.dtype)
        with no_autocast(student_x.device):
            g = impl.upstream(grad_loss, target, opts.ignore_index, reduction)
            if tp.tp_group:
                from . import vocab_parallel

                dx, dw, db = vocab_parallel.backward(
                    impl, g, student_x, student_weight, student_bias, teacher_x, teacher_weight, teacher_bias,
                    target, stats, opts, tp, budget, need_dx, need_dw, need_db)
            else:
                dx, dw, db = impl.backward(
                    g, student_x, student_weight, student_bias, teacher_x, teacher_weight, teacher_bias,
                    target, stats, opts, budget, need_dx, need_dw, need_db)
    return grad_outputs(student_x, dx, dw, db, need_dx, need_dw, need_db)


def _backward_fake(grad_loss, student_x, student_weight, student_bias, teacher_x, teacher_weight, teacher_bias,
                   target, stats, opts, reduction, budget, backend, need_dx, need_dw, need_db, tp):
    return fake_grad_outputs(student_x, student_weight, student_bias, need_dx, need_dw,
                             need_db and student_bias is not None)


_HEADS = (tensor("student_x"), tensor("student_weight"), tensor("student_bias", True), tensor("teacher_x"),
          tensor("teacher_weight"), tensor("teacher_bias", True), tensor("target"))
_OPTS = options("opts", JSDOptions)
_NEED = (scalar("need_dx", bool), scalar("need_dw", bool), scalar("need_db", bool))
_TP = options("tp", VocabParallelOptions, defaulted=True)

SPEC = OpSpec(
    op=OP,
    name="linear_jsd_forward",
    # (grad_in_forward and the need flags defaulted: before the defaulted vocab-parallel group)
    forward=(*_HEADS, _OPTS, scalar("reduction", str), scalar("budget", int), scalar("backend", str),
             scalar("grad_in_forward", bool, False), scalar("need_dx", bool, False), scalar("need_dw", bool, False),
             scalar("need_db", bool, False), _TP),
    outputs=("loss", "stats", "gx", "gw", "gb"),
    forward_impl=_forward,
    forward_fake=_forward_fake,
    backward_name="linear_jsd_backward",
    backward=(tensor("grad_loss"), *_HEADS, tensor("stats"), _OPTS, scalar("reduction", str), scalar("budget", int),
              scalar("backend", str), *_NEED, _TP),
    backward_impl=_backward,
    backward_fake=_backward_fake,
    grads=("grad_loss", None, None, None, None),
    grad_inputs=("student_x", "student_weight", "student_bias"),
    need={"need_dx": "student_x", "need_dw": "student_weight", "need_db": "student_bias"},
    # Gradient-in-forward: not saved tensors, the one backward scales them in place.
    forward_grads=("gx", "gw", "gb"),
    forward_grads_when="grad_in_forward",
    skip_if_no_grads=True,
)

_built = build(SPEC)
linear_jsd_forward_op, linear_jsd_backward_op = _built.forward_op, _built.backward_op
#: What the public function calls: ``linear_jsd_forward_op``, through a plain
#: autograd.Function in eager mode (``EagerOp``: the same computation, bitwise).
linear_jsd_forward_eager = _built.eager
