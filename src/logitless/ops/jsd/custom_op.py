"""The torch.library custom ops of jsd: what autograd and torch.compile see.

    logitless::jsd_forward(student_logits, teacher_logits, target, <options>, budget, backend)
        -> per-token loss (N,), statistics (6, N), config
    logitless::jsd_backward(grad_loss, student_logits, teacher_logits, target, stats, config,
                            <options>, backend)
        -> d loss / d student_logits (N, V)

(the schemas, written out: ``FORWARD_SCHEMA``, ``BACKWARD_SCHEMA``). ``<options>`` are the
fields of ``JSDOptions`` (beta, temperature, ignore_index, student_softcap,
teacher_softcap, hard_label_weight); ``backend`` names an entry of the table
``api.BACKENDS`` (given here by ``use_backends``), a ``JsdBackend`` (``contract``). The
forward plans the call once (``backend.plan``); the backward follows that Config: the
object on the eager fast path, the backend's encoding (``backend.codec``, a CPU int64
tensor) through the custom ops. Validation and the reduction are plain Python/torch
around the ops (``api.py``), so ``fullgraph=True`` works. Double backward is not
supported: differentiating the gradient raises.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from logitless.formulas.common import compute_dtype
from logitless.formulas.jsd import NUM_STATS, token_loss, upstream
from logitless.ops.common.autocast import disabled as no_autocast
from logitless.ops.common.autograd import below_autograd, custom_op, guard_double_backward
from logitless.ops.common.contract import register_autograd
from logitless.ops.common.validate import check_targets_in_range
from logitless.options import JSDOptions

from .contract import JsdBackend

OP = "jsd"

OPTIONS_SCHEMA = ("float beta, float temperature, SymInt ignore_index, float? student_softcap, "
                  "float? teacher_softcap, float hard_label_weight")
FORWARD_SCHEMA = (
    f"(Tensor student_logits, Tensor teacher_logits, Tensor target, {OPTIONS_SCHEMA}, SymInt budget, "
    "str backend) -> (Tensor, Tensor, Tensor)"
)
BACKWARD_SCHEMA = (
    "(Tensor grad_loss, Tensor student_logits, Tensor teacher_logits, Tensor target, Tensor stats, "
    f"Tensor config, {OPTIONS_SCHEMA}, str backend) -> Tensor"
)
#: The forward's arguments.
_NUM_INPUTS = 11

#: backend name -> JsdBackend: ``api.BACKENDS``, given once at import (``use_backends``).
BACKENDS: Mapping[str, JsdBackend] = {}


def use_backends(table: Mapping[str, JsdBackend]) -> None:
    """The table of backends the custom ops run (``api.BACKENDS``)."""
    global BACKENDS
    BACKENDS = table


def _forward(student_logits: Tensor, teacher_logits: Tensor, target: Tensor, beta, temperature, ignore_index,
             student_softcap, teacher_softcap, hard_label_weight, budget: int, backend: str):
    """(per-token loss (N,), statistics (6, N), the Config as the object) of 2-D logits;
    fp32 (fp64 for fp64)."""
    opts = JSDOptions(beta, temperature, ignore_index, student_softcap, teacher_softcap, hard_label_weight)
    n, v = student_logits.shape
    dtype = compute_dtype(student_logits.dtype, teacher_logits.dtype)
    if opts.hard_label_weight != 0.0:
        check_targets_in_range(target, v, opts.ignore_index)  # CPU only: no sync
    config = None
    if n == 0:
        stats = student_logits.new_zeros(NUM_STATS, 0, dtype=dtype)
    else:
        impl = BACKENDS[backend]
        with no_autocast(student_logits.device):
            config = impl.plan(student_logits, teacher_logits, budget=budget)  # once: the backward follows it
            stats = impl.forward(student_logits, teacher_logits, target, opts, config)
    return token_loss(stats, target, v, opts).to(dtype), stats.to(dtype), config


def _forward_op(*args):
    """The custom op's implementation: ``_forward`` with the Config encoded by its backend."""
    loss, stats, config = _forward(*args)
    return loss, stats, BACKENDS[args[10]].codec.encode(config)


def _forward_fake(student_logits, teacher_logits, target, beta, temperature, ignore_index, student_softcap,
                  teacher_softcap, hard_label_weight, budget, backend):
    dtype = compute_dtype(student_logits.dtype, teacher_logits.dtype)
    n = student_logits.shape[0]
    return (student_logits.new_empty(n, dtype=dtype), student_logits.new_empty(NUM_STATS, n, dtype=dtype),
            BACKENDS[backend].codec.fake())


def _backward_impl(grad_loss: Tensor, student_logits: Tensor, teacher_logits: Tensor, target: Tensor, stats: Tensor,
                   config, beta, temperature, ignore_index, student_softcap, teacher_softcap, hard_label_weight,
                   backend: str) -> Tensor:
    """d loss / d student_logits (N, V), in the student logits' dtype; ``config``: the
    forward's (the object, or its encoding)."""
    if student_logits.shape[0] == 0:
        return torch.zeros_like(student_logits)
    opts = JSDOptions(beta, temperature, ignore_index, student_softcap, teacher_softcap, hard_label_weight)
    g = upstream(grad_loss, target, opts.ignore_index)
    impl = BACKENDS[backend]
    with no_autocast(student_logits.device):
        return impl.backward(g, student_logits, teacher_logits, target, stats, opts, impl.codec.decode(config))


def _backward_fake(grad_loss, student_logits, *_):
    return torch.empty_like(student_logits)


jsd_forward_op = custom_op("jsd_forward", _forward_op, schema=FORWARD_SCHEMA)
jsd_forward_op.register_fake(_forward_fake)
jsd_backward_op = custom_op("jsd_backward", _backward_impl, schema=BACKWARD_SCHEMA)
jsd_backward_op.register_fake(_backward_fake)


def _setup_context(ctx, inputs, output):
    """Saved: the logits, target, stats. On ctx: the options and the backend, the Config.
    Gradients are materialised (an unused loss gets a zero gradient)."""
    student_logits, teacher_logits, target = inputs[:3]
    loss, stats, config = output
    ctx.save_for_backward(student_logits, teacher_logits, target, stats)
    ctx.options = inputs[3:9]
    ctx.backend = inputs[10]
    ctx.config = config
    if isinstance(config, Tensor):
        ctx.mark_non_differentiable(stats, config)
    else:  # (the eager fast path's Config is the object)
        ctx.mark_non_differentiable(stats)


def _backward(ctx, grad_loss, *_):
    """(d student_logits, None...): the backward op on the saved tensors and the forward's Config."""
    nones = (None,) * (_NUM_INPUTS - 1)
    if not ctx.needs_input_grad[0]:
        return (None, *nones)
    student_logits, teacher_logits, target, stats = ctx.saved_tensors
    args = (grad_loss, student_logits, teacher_logits, target, stats, ctx.config, *ctx.options, ctx.backend)
    if getattr(ctx, "eager", False):
        # The eager fast path calls the implementation, recording no autograd history (as the
        # dispatcher runs a custom op's: a backward with create_graph=True runs in grad mode).
        with below_autograd():
            dz = _backward_impl(*args)
    else:
        dz = jsd_backward_op(*args)
    (dz,) = guard_double_backward(OP, (dz,), grad_loss, student_logits)
    return (dz, *nones)


#: What the public function calls: ``jsd_forward`` with its autograd, through a plain
#: autograd.Function in eager mode (``autograd.EagerOp``: ``.runner(inputs)(*inputs)``).
jsd_forward_eager = register_autograd(jsd_forward_op, _forward, _setup_context, _backward)
