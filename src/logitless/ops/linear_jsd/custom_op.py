"""The torch.library custom ops of linear_jsd: what autograd and torch.compile see.

    logitless::linear_jsd_forward(student_x, student_weight, student_bias, teacher_x,
        teacher_weight, teacher_bias, target, <options>, reduction, budget, backend,
        grad_in_forward, need_dx, need_dw, need_db, <vocab parallel>)
        -> loss (per token (N,) for "none"), statistics (6, N), config, gx, gw, gb
    logitless::linear_jsd_backward(grad_loss, <the forward's tensors>, stats, config, <options>,
        reduction, backend, need_dx, need_dw, need_db, <vocab parallel>)
        -> the student's dx, dW, db

(the schemas, written out: ``FORWARD_SCHEMA``, ``BACKWARD_SCHEMA``). ``<options>`` are the
fields of ``JSDOptions`` under their own names; ``<vocab parallel>`` those of
``VocabParallelOptions`` (tp_group, vocab_size, partial_dx): with a ``tp_group`` both
weights are this rank's blocks of rows of vocab-parallel heads (``vocab_parallel``).
``backend`` names an entry of the table ``api.BACKENDS`` (given here by ``use_backends``),
a ``LjsdBackend`` (``contract``). Validation, autocast casts and the reshapes are plain
Python/torch around the ops (``api.py``), so ``fullgraph=True`` works.

The forward plans the call ONCE (``backend.plan``: the backend's frozen Config); the
forward, its gradient-in-forward strategy and the backward follow that Config.
``config`` is the object on the eager fast path and the backend's encoding
(``backend.codec``: a CPU int64 tensor) through the custom ops. ``grad_in_forward``
allows the Triton backend's gradient-in-forward strategy (the public function allows it
in eager mode for "mean"/"sum" on one device's heads; the Config picks it or not): the
forward then also returns the student's gradients for grad_output = 1 (gx, gw, gb; empty
otherwise), which the backward only scales (a second backward, retain_graph=True, runs
the backward op). Double backward raises.

The autograd (``_setup_context``, ``_backward``) is written out below: what is saved and
what the backward op receives; ``ops.common.contract.register_autograd`` wires it and the
eager fast path.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Optional

import torch
from torch import Tensor

from logitless.formulas.common import compute_dtype
from logitless.formulas.jsd import NUM_STATS, reduce, token_loss
from logitless.ops.common.autocast import disabled as no_autocast
from logitless.ops.common.autograd import (
    below_autograd,
    custom_op,
    fake_grad_outputs,
    grad_outputs,
    guard_double_backward,
    zero_grads,
)
from logitless.ops.common.contract import register_autograd
from logitless.ops.common.grad_in_forward import scale_grads
from logitless.ops.common.validate import check_targets_in_range
from logitless.options import JSDOptions, VocabParallelOptions

from .contract import LjsdBackend

OP = "linear_jsd"

HEADS_SCHEMA = ("Tensor student_x, Tensor student_weight, Tensor? student_bias, Tensor teacher_x, "
                "Tensor teacher_weight, Tensor? teacher_bias, Tensor target")
OPTIONS_SCHEMA = ("float beta, float temperature, SymInt ignore_index, float? student_softcap, "
                  "float? teacher_softcap, float hard_label_weight, str reduction")
TP_SCHEMA = 'str tp_group="", SymInt vocab_size=-1, bool partial_dx=False'
FORWARD_SCHEMA = (
    f"({HEADS_SCHEMA}, {OPTIONS_SCHEMA}, SymInt budget, str backend, bool grad_in_forward=False, "
    f"bool need_dx=False, bool need_dw=False, bool need_db=False, {TP_SCHEMA}) "
    "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)"
)
BACKWARD_SCHEMA = (
    f"(Tensor grad_loss, {HEADS_SCHEMA}, Tensor stats, Tensor config, {OPTIONS_SCHEMA}, str backend, "
    f"bool need_dx, bool need_dw, bool need_db, {TP_SCHEMA}) -> (Tensor, Tensor, Tensor)"
)
#: The forward's arguments: 16, then 7 defaulted ones (grad_in_forward, the need flags,
#: ``<vocab parallel>``), which a compiled graph may leave out.
_NUM_INPUTS = 23
_DEFAULTS = (False, False, False, False, "", -1, False)

#: backend name -> LjsdBackend: ``api.BACKENDS``, given once at import (``use_backends``).
BACKENDS: Mapping[str, LjsdBackend] = {}


def use_backends(table: Mapping[str, LjsdBackend]) -> None:
    """The table of backends the custom ops run (``api.BACKENDS``)."""
    global BACKENDS
    BACKENDS = table


def _forward(student_x: Tensor, student_weight: Tensor, student_bias: Optional[Tensor], teacher_x: Tensor,
             teacher_weight: Tensor, teacher_bias: Optional[Tensor], target: Tensor, beta: float,
             temperature: float, ignore_index: int, student_softcap: Optional[float],
             teacher_softcap: Optional[float], hard_label_weight: float, reduction: str, budget: int, backend: str,
             grad_in_forward: bool = False, need_dx: bool = False, need_dw: bool = False, need_db: bool = False,
             tp_group: str = "", vocab_size: int = -1, partial_dx: bool = False):
    """2-D x's -> the forward op's outputs (module docstring), ``config`` as the object:
    loss (() for "mean"/"sum", (N,) for "none") and statistics fp32 (fp64 for fp64); gx,
    gw, gb the gradient-in-forward strategy's (gw fp32 unless one chunk covers every
    token), else empty."""
    opts = JSDOptions(beta, temperature, ignore_index, student_softcap, teacher_softcap, hard_label_weight)
    impl = BACKENDS[backend]
    xs, ws = student_x, student_weight
    if tp_group:
        from . import vocab_parallel

        with no_autocast(xs.device):
            loss_tok, stats, config = vocab_parallel.forward(
                impl, xs, ws, student_bias, teacher_x, teacher_weight, teacher_bias, target, opts,
                VocabParallelOptions(tp_group, vocab_size, partial_dx), budget)
        return (reduce(loss_tok, target, reduction, opts.ignore_index), stats, config, *_empty(xs, None))
    n, v = xs.shape[0], ws.shape[0]
    if opts.hard_label_weight != 0.0:
        check_targets_in_range(target, v, opts.ignore_index)  # CPU only: no sync
    if n == 0:
        stats = xs.new_zeros(NUM_STATS, 0, dtype=compute_dtype(xs.dtype))
        loss = reduce(token_loss(stats, target, v, opts), target, reduction, opts.ignore_index)
        return (loss, stats, None, *_empty(xs, None))
    with no_autocast(xs.device):
        # The call's Config, once: the forward, its strategy and the backward follow it.
        config = impl.plan(xs, ws, teacher_x, opts, budget=budget,
                           grad_in_forward=grad_in_forward and reduction != "none")
        out = impl.forward(xs, ws, student_bias, teacher_x, teacher_weight, teacher_bias, target, opts, config,
                           reduction=reduction, need_dx=need_dx, need_dw=need_dw,
                           need_db=need_db and student_bias is not None)
    return (out.loss, out.stats, config, *_empty(xs, out.grads))


def _empty(x: Tensor, grads) -> list:
    """gx, gw, gb: ``grads`` with a size-0 tensor for each one absent."""
    return [g if g is not None else x.new_empty(0) for g in (grads or (None,) * 3)]


def _forward_op(*args):
    """The custom op's implementation: ``_forward`` with the Config encoded by its backend."""
    out = _forward(*args)
    return (*out[:2], BACKENDS[args[15]].codec.encode(out[2]), *out[3:])


def _forward_fake(student_x, student_weight, student_bias, teacher_x, teacher_weight, teacher_bias, target, beta,
                  temperature, ignore_index, student_softcap, teacher_softcap, hard_label_weight, reduction, budget,
                  backend, grad_in_forward=False, need_dx=False, need_dw=False, need_db=False, tp_group="",
                  vocab_size=-1, partial_dx=False):
    """Shapes and dtypes; the gradient-in-forward outputs' from a Config planned as the
    forward would (eager only: the public function allows the strategy then)."""
    xs, ws = student_x, student_weight
    n, (v, h) = xs.shape[0], ws.shape
    dtype = compute_dtype(xs.dtype)
    impl = BACKENDS[backend]
    grads = _empty(xs, None)
    if grad_in_forward and reduction != "none" and not tp_group and n > 0:
        opts = JSDOptions(beta, temperature, ignore_index, student_softcap, teacher_softcap, hard_label_weight)
        chunk = getattr(impl.plan(xs, ws, teacher_x, opts, budget=budget, grad_in_forward=True), "grad_in_forward", 0)
        if chunk:
            one = chunk >= n or ws.dtype == torch.float32
            f32 = torch.float32
            grads = [torch.empty_like(xs) if need_dx else grads[0],
                     (torch.empty_like(ws) if one else ws.new_empty(v, h, dtype=f32)) if need_dw else grads[1],
                     ws.new_empty(v, dtype=f32) if need_db and student_bias is not None else grads[2]]
    loss = xs.new_empty((n,) if reduction == "none" else (), dtype=dtype)
    return (loss, xs.new_empty(NUM_STATS, n, dtype=dtype), impl.codec.fake(), *grads)


def _backward_impl(grad_loss: Tensor, student_x: Tensor, student_weight: Tensor, student_bias: Optional[Tensor],
                   teacher_x: Tensor, teacher_weight: Tensor, teacher_bias: Optional[Tensor], target: Tensor,
                   stats: Tensor, config, beta: float, temperature: float, ignore_index: int,
                   student_softcap: Optional[float], teacher_softcap: Optional[float], hard_label_weight: float,
                   reduction: str, backend: str, need_dx: bool, need_dw: bool, need_db: bool,
                   tp_group: str = "", vocab_size: int = -1, partial_dx: bool = False):
    """(dx, dW, db) of the student; a size-0 tensor for each one not asked for.
    ``grad_loss``: the gradient of the forward's (reduced) loss; the backend turns it into
    the per-token upstream gradient. ``config``: the forward's (the object, or its encoding;
    its chunks are the budget's)."""
    xs, ws, bs = student_x, student_weight, student_bias
    need_db = need_db and bs is not None
    if xs.shape[0] == 0:
        dx, dw, db = zero_grads(xs, ws, bs)
    else:
        impl = BACKENDS[backend]
        if isinstance(config, Tensor):  # (through the custom op; the eager fast path passes the object)
            config = impl.codec.decode(config)
        opts = JSDOptions(beta, temperature, ignore_index, student_softcap, teacher_softcap, hard_label_weight)
        heads = (xs, ws, bs, teacher_x, teacher_weight, teacher_bias, target, stats, opts)
        with no_autocast(xs.device):
            g = impl.upstream(grad_loss, target, opts.ignore_index, reduction)
            if tp_group:
                from . import vocab_parallel

                dx, dw, db = vocab_parallel.backward(impl, g, *heads, VocabParallelOptions(tp_group, vocab_size,
                                                                                           partial_dx),
                                                     config, need_dx, need_dw, need_db)
            else:
                dx, dw, db = impl.backward(g, *heads, config, need_dx=need_dx, need_dw=need_dw, need_db=need_db)
    return grad_outputs(xs, dx, dw, db, need_dx, need_dw, need_db)


def _backward_fake(grad_loss, student_x, student_weight, student_bias, *rest):
    need_dx, need_dw, need_db = rest[14:17]
    return fake_grad_outputs(student_x, student_weight, student_bias, need_dx, need_dw,
                             need_db and student_bias is not None)


linear_jsd_forward_op = custom_op("linear_jsd_forward", _forward_op, schema=FORWARD_SCHEMA)
linear_jsd_forward_op.register_fake(_forward_fake)
linear_jsd_backward_op = custom_op("linear_jsd_backward", _backward_impl, schema=BACKWARD_SCHEMA)
linear_jsd_backward_op.register_fake(_backward_fake)


def _setup_context(ctx, inputs, output):
    """Saved: the heads' tensors, the target and the statistics. On ctx: the options and
    execution arguments, the Config, the gradient-in-forward strategy's gradients when the
    forward used it."""
    if len(inputs) < _NUM_INPUTS:  # (a compiled graph may leave the defaulted ones out)
        inputs = (*inputs, *_DEFAULTS[len(inputs) - 16:])
    loss, stats, config, gx, gw, gb = output
    ctx.save_for_backward(*inputs[:7], stats)
    ctx.options = (*inputs[7:14], inputs[15])  # <options>, reduction, backend
    ctx.tp = inputs[20:]
    ctx.config = config
    ctx.forward_grads = None
    if inputs[16] and (gx.numel() or gw.numel() or gb.numel()):  # grad_in_forward allowed and used
        ctx.forward_grads = (gx, gw, gb)
        ctx.dtypes = (inputs[0].dtype, inputs[1].dtype)
    if isinstance(config, Tensor):
        ctx.mark_non_differentiable(stats, config, gx, gw, gb)
    else:  # (the eager fast path's Config is the object)
        ctx.mark_non_differentiable(stats, gx, gw, gb)
    ctx.set_materialize_grads(False)


def _backward(ctx, grad_loss, *_):
    """(dx, dw, db, None...): the backward op on the saved tensors and the forward's Config,
    or the gradient-in-forward strategy's gradients scaled by ``grad_loss`` (the first
    backward only: they are scaled in place)."""
    forward_grads, ctx.forward_grads = ctx.forward_grads, None
    needs = ctx.needs_input_grad
    need_dx, need_dw, need_db = needs[0], needs[1], needs[2]
    nones = (None,) * (_NUM_INPUTS - 3)
    if not (need_dx or need_dw or need_db) or grad_loss is None:
        return (None, None, None, *nones)
    saved = ctx.saved_tensors
    if forward_grads is not None:
        out = scale_grads([g if g.numel() else None for g in forward_grads], grad_loss, *ctx.dtypes)
    else:
        args = (grad_loss, *saved, ctx.config, *ctx.options, need_dx, need_dw, need_db, *ctx.tp)
        if getattr(ctx, "eager", False):  # the implementation, as the dispatcher runs a custom op's
            with below_autograd():
                out = _backward_impl(*args)
        else:
            out = linear_jsd_backward_op(*args)
    out = guard_double_backward(OP, (out[0] if need_dx else None, out[1] if need_dw else None,
                                     out[2] if need_db else None), grad_loss, *saved[:3])
    return (*out, *nones)


#: What the public function calls: ``linear_jsd_forward_op`` with its autograd, through a
#: plain autograd.Function in eager mode (``autograd.EagerOp``: ``.runner(inputs)(*inputs)``).
linear_jsd_forward_eager = register_autograd(linear_jsd_forward_op, _forward, _setup_context, _backward)
