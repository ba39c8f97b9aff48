"""The bodies of jsd's custom ops (``logitless::jsd_forward`` and ``jsd_backward``), written
against the declared calls of ``contract`` (``JsdCall`` -> ``JsdOutputs``,
``JsdBackwardCall`` -> d loss / d student logits (N, V)); ``ops.common.glue.CustomOp``
derives the schemas, the flattening and the autograd wiring from those declarations.

The forward plans the call once (``backend.plan``); the backward follows that Config: the
object on the eager path; through the custom ops the backward op plans it again from
the forward's planning arguments (``replan``: the memoised planner's same object).
Validation and the reduction are plain Python/torch around the ops (``api.py``), so
``fullgraph=True`` works. Double backward is not supported: differentiating the gradient
raises.
"""

from __future__ import annotations

import torch
from torch import Tensor

from logitless.formulas.common import compute_dtype
from logitless.formulas.jsd import NUM_STATS, token_loss, upstream
from logitless.ops.common.autocast import disabled as no_autocast
from logitless.ops.common.contract import BackendTable
from logitless.ops.common.glue import CustomOp
from logitless.ops.common.validate import check_targets_in_range

from .contract import JsdBackend, JsdBackwardCall, JsdCall, JsdOutputs

#: The custom ops: logitless::jsd_forward, logitless::jsd_backward.
NAME = "jsd"
OP = "jsd"


def forward(call: JsdCall, impl: JsdBackend) -> JsdOutputs:
    """The per-token loss (N,), the statistics (6, N) (fp32, fp64 for fp64) and the Config
    as the object (None without tokens) of 2-D logits."""
    zs, zt, target, opts = call.student_logits, call.teacher_logits, call.target, call.opts
    n, v = zs.shape
    dtype = compute_dtype(zs.dtype, zt.dtype)
    if opts.hard_label_weight != 0.0:
        check_targets_in_range(target, v, opts.ignore_index)  # CPU only: no sync
    config = None
    if n == 0:
        stats = zs.new_zeros(NUM_STATS, 0, dtype=dtype)
    else:
        with no_autocast(zs.device):
            config = impl.plan(zs, zt, budget=call.budget)  # once: the backward follows it
            stats = impl.forward(zs, zt, target, opts, config)
    return JsdOutputs(token_loss(stats, target, v, opts).to(dtype), stats.to(dtype), config)


def fake(call: JsdCall, impl: JsdBackend) -> JsdOutputs:
    """Shapes and dtypes (``config`` None: the forward op has no Config output)."""
    zs = call.student_logits
    dtype = compute_dtype(zs.dtype, call.teacher_logits.dtype)
    n = zs.shape[0]
    return JsdOutputs(zs.new_empty(n, dtype=dtype), zs.new_empty(NUM_STATS, n, dtype=dtype), None)


def backward_impl(b: JsdBackwardCall, impl: JsdBackend) -> tuple[Tensor]:
    """(d loss / d student logits,) (N, V), in the student logits' dtype; ``b.config``: the
    forward's."""
    zs = b.student_logits
    if zs.shape[0] == 0:
        return (torch.zeros_like(zs),)
    g = upstream(b.grad_loss, b.target, b.opts.ignore_index)
    with no_autocast(zs.device):
        return (impl.backward(g, zs, b.teacher_logits, b.target, b.stats, b.opts, b.config),)


def replan(b: JsdBackwardCall, impl: JsdBackend):
    """The forward's Config of ``b`` (the backward custom op's), planned again from the same
    logits and budget (the planner is memoised: the forward's object); None without tokens."""
    zs = b.student_logits
    if zs.shape[0] == 0:
        return None
    with no_autocast(zs.device):
        return impl.plan(zs, b.teacher_logits, budget=b.budget)


def backward_fake(b: JsdBackwardCall, impl: JsdBackend) -> tuple[Tensor]:
    return (torch.empty_like(b.student_logits),)


def save(ctx, call: JsdCall, out: JsdOutputs) -> None:
    """Saved: the logits, target, stats; on ctx: the options, the backend, the Config.
    Gradients are materialised (an unused loss gets a zero gradient)."""
    ctx.save_for_backward(call.student_logits, call.teacher_logits, call.target, out.stats)
    ctx.opts, ctx.backend, ctx.config, ctx.budget = call.opts, call.backend, out.config, call.budget
    ctx.mark_non_differentiable(out.stats)


def backward(ctx, grads: JsdOutputs, need, run) -> tuple:
    """(d student_logits,): the backward op (``run``) on the saved tensors and the forward's Config."""
    student_logits, teacher_logits, target, stats = ctx.saved_tensors
    # (in declared order: positional arguments cost less per call than keywords)
    return run(JsdBackwardCall(grads.loss, student_logits, teacher_logits, target, stats, ctx.config, ctx.opts,
                               ctx.backend, ctx.budget))


def define(backends: BackendTable[JsdBackend]) -> CustomOp[JsdCall, JsdOutputs, JsdBackwardCall, JsdBackend]:
    """The custom-op pair over the table of backends ``backends`` (``api.BACKENDS``)."""
    return CustomOp(NAME, JsdCall, JsdOutputs, JsdBackwardCall, table=backends, forward=forward, fake=fake,
                    save=save, backward=backward, backward_impl=backward_impl, backward_fake=backward_fake, title=OP,
                    replan=replan)
