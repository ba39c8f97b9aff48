"""linear_cross_entropy with ``batch_invariant=True``: the forward on fixed-size row
blocks (``ops.common.invariant``), the backward once over the whole batch.

The forward runs the op's forward implementation (``custom_op._forward``, reduction
"none", no gradient planned: nothing kept, no gradient-in-forward; the first block's
Config serves every block) on blocks of
``invariant_rows`` rows, the last block padded with zero rows of ignored targets, so
every GEMM, plan and reduction of a row has the same shape whatever the batch: the
per-token loss, lse and argmax of a row are the same bits whatever the batch size, the
row's position and its neighbours (with or without a gradient to follow). The
reductions ("mean", "sum") add the per-token losses afterwards (their bits may follow
the batch; the per-token values do not).

The backward is the default op's (``custom_op._backward_impl``: the backend's
``grad_coefficients`` and ``backward``, under a Config of the whole batch planned there)
run once over the whole batch with the blocked forward's lse, the gradients of the
per-token losses and of the lse (``grad_lse``): one dW, no forward re-run. Gradients are
deterministic run to run, not batch-invariant (as linear_log_probs'). Cost against the
default op: up to one block of padding rows in the forward, and no kept columns for the
backward (one recomputed GEMM more than the default path when its budget keeps columns);
memory as the default op's.

Over a vocab-parallel head (``vocab_parallel``) each block's statistics are merged with
the SUM added in rank order after an all-gather (``distributed.sum_in_rank_order``: an
all-reduce's order may follow the message size); the backward is the vocab-parallel one.

The forward and backward are custom ops (``FORWARD_SCHEMA``, ``BACKWARD_SCHEMA``, their
autograd written out below): torch.compile(fullgraph=True) sees fixed output shapes.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from logitless.distributed import vocab_shard
from logitless.formulas.common import compute_dtype, reduce
from logitless.ops.common.autocast import disabled as no_autocast
from logitless.ops.common.autograd import custom_op as define
from logitless.ops.common.autograd import fake_grad_outputs, guard_double_backward
from logitless.ops.common.contract import register_autograd
from logitless.ops.common.invariant import blocks, invariant_rows, pad_rows
from logitless.ops.common.kept import nothing_kept
from logitless.options import CrossEntropyOptions, VocabParallelOptions

from . import custom_op, vocab_parallel
from .custom_op import OPTIONS_SCHEMA, TP_SCHEMA

_SINGLE = VocabParallelOptions()
FORWARD_SCHEMA = (
    f"(Tensor x, Tensor weight, Tensor? bias, Tensor target, Tensor? class_weight, {OPTIONS_SCHEMA}, str backend, "
    f"SymInt budget, bool need_argmax, {TP_SCHEMA}) -> (Tensor, Tensor, Tensor, Tensor)"
)
BACKWARD_SCHEMA = (
    "(Tensor? grad_loss, Tensor? grad_lse, Tensor x, Tensor weight, Tensor? bias, Tensor target, "
    f"Tensor? class_weight, Tensor lse, Tensor w_t, {OPTIONS_SCHEMA}, str backend, SymInt budget, bool need_dx, "
    f"bool need_dw, bool need_db, {TP_SCHEMA}) -> (Tensor, Tensor, Tensor)"
)
#: The forward's arguments: 13, then the 3 defaulted ``<vocab parallel>`` ones.
_NUM_INPUTS = 16


def _forward(x: Tensor, weight: Tensor, bias: Optional[Tensor], target: Tensor, class_weight: Optional[Tensor],
             ignore_index: int, reduction: str, label_smoothing: float, softcap: Optional[float], z_loss: float,
             backend: str, budget: int, need_argmax: bool, tp_group: str = "", vocab_size: int = -1,
             partial_dx: bool = False):
    """-> loss reduced as ``reduction`` (here: its bits do not follow a compiler's
    reduction), per-token lse, argmax (or (0,)), w_t."""
    opts = CrossEntropyOptions(ignore_index, "none", label_smoothing, softcap, z_loss)
    tp = VocabParallelOptions(tp_group, vocab_size, partial_dx)
    parts = []
    config = None  # planned by the first block, followed by the others (the same shapes)
    for n0, n1, pad in blocks(x.shape[0], invariant_rows(backend, x.device)) or [(0, 0, 0)]:
        xb, tb = pad_rows(x, n0, n1, pad), pad_rows(target, n0, n1, pad, opts.ignore_index)
        if tp.parallel:  # the ranks' statistics added in rank order
            with no_autocast(x.device):
                loss, lse, argmax, w_t, _, config = vocab_parallel.forward(
                    custom_op.BACKENDS[backend], xb, weight, bias, tb, class_weight, opts, tp,
                    budget=budget, need_argmax=need_argmax, need_grad=False, ordered=True, config=config)
            if argmax is None:
                argmax = tb.new_empty(0, dtype=torch.int64)
            out = (loss, lse, argmax, w_t)
        else:
            out = custom_op._forward(xb, weight, bias, tb, class_weight, *opts.args(), backend, budget, need_argmax,
                                     False, False, False, False, False, config=config)
            config = out[6]
        parts.append([t[:n1 - n0] for t in out[:4]])  # loss, lse, argmax, w_t
    loss, lse, argmax, w_t = (torch.cat(c) for c in zip(*parts))
    return reduce(loss, w_t, reduction), lse, argmax, w_t


def _forward_fake(x, weight, bias, target, class_weight, ignore_index, reduction, label_smoothing, softcap, z_loss,
                  backend, budget, need_argmax, tp_group="", vocab_size=-1, partial_dx=False):
    n = x.shape[0]
    sd = compute_dtype(x.dtype)
    return (x.new_empty((n,) if reduction == "none" else (), dtype=sd), x.new_empty(n, dtype=sd),
            x.new_empty(n if need_argmax else 0, dtype=torch.int64), x.new_empty(n, dtype=sd))


def _backward(grad_loss, grad_lse, x, weight, bias, target, class_weight, lse, w_t, ignore_index: int,
              reduction: str, label_smoothing: float, softcap: Optional[float], z_loss: float, backend: str,
              budget: int, need_dx: bool, need_dw: bool, need_db: bool, tp_group: str = "", vocab_size: int = -1,
              partial_dx: bool = False):
    """dx, dw, db (size 0 where not needed): the default op's backward over the whole
    batch, with the per-token gradient of the reduction as autograd would give it
    (sum: expanded; mean: divided by the weights' sum, then expanded)."""
    opts = CrossEntropyOptions(ignore_index, "none", label_smoothing, softcap, z_loss)
    tp = VocabParallelOptions(tp_group, vocab_size, partial_dx)
    if grad_loss is None:
        grad_loss = torch.zeros_like(lse)
    elif reduction == "sum":
        grad_loss = grad_loss.expand(lse.shape)
    elif reduction == "mean":
        grad_loss = (grad_loss / w_t.sum()).expand(lse.shape)
    config = None
    w, b, cw = weight, bias, class_weight
    if tp.parallel:  # this rank's real rows (the vocab-parallel backward plans for them)
        shard = vocab_shard(tp.tp_group, weight.shape[0], x.device, tp.vocab_size)
        w, b = shard.real_rows(weight), shard.real_rows(bias)
        cw = shard.class_slice(vocab_parallel.full_class_weight(class_weight, shard))
    if x.shape[0] > 0 and w.shape[0] > 0:  # the backward's Config over the whole batch (nothing kept)
        config = custom_op.BACKENDS[backend].plan(x, w, b, cw, opts, budget=budget, need_grad=False,
                                                  need_argmax=False, need_dw=need_dw, cute=False)
    return custom_op._backward_impl(grad_loss, grad_lse, x, weight, bias, target, class_weight, lse, w_t,
                                    *nothing_kept(x), config, *opts.args(), backend, budget, need_dx, need_dw,
                                    need_db, *tp.args())


def _backward_fake(grad_loss, grad_lse, x, weight, bias, *rest):
    need_dx, need_dw, need_db = rest[11:14]
    return fake_grad_outputs(x, weight, bias, need_dx, need_dw, need_db)


#: logitless::lce_invariant_forward(x, weight, bias, target, class_weight, <options>,
#:     backend, budget, need_argmax, <vocab parallel>) -> loss, lse, argmax, w_t;
#: logitless::lce_invariant_backward(grad_loss, grad_lse, ...) -> dx, dw, db.
lce_invariant_forward = define("lce_invariant_forward", _forward, schema=FORWARD_SCHEMA)
lce_invariant_forward.register_fake(_forward_fake)
lce_invariant_backward = define("lce_invariant_backward", _backward, schema=BACKWARD_SCHEMA)
lce_invariant_backward.register_fake(_backward_fake)


def _setup_context(ctx, inputs, output):
    """Saved: x, weight, bias, target, class_weight, lse, w_t; on ctx: the options, backend,
    budget and ``<vocab parallel>``."""
    if len(inputs) < _NUM_INPUTS:  # (a compiled graph may leave the defaulted ones out)
        inputs = (*inputs, "", -1, False)[:_NUM_INPUTS]
    loss, lse, argmax, w_t = output
    ctx.save_for_backward(*inputs[:5], lse, w_t)
    ctx.options, ctx.tp = inputs[5:12], inputs[13:]
    ctx.mark_non_differentiable(argmax, w_t)
    ctx.set_materialize_grads(False)


def _autograd_backward(ctx, grad_loss, grad_lse, *_):
    needs = ctx.needs_input_grad
    need_dx, need_dw, need_db = needs[0], needs[1], needs[2]
    nones = (None,) * (_NUM_INPUTS - 3)
    if not (need_dx or need_dw or need_db):
        return (None, None, None, *nones)
    x, weight, bias, target, class_weight, lse, w_t = ctx.saved_tensors
    args = (grad_loss, grad_lse, x, weight, bias, target, class_weight, lse, w_t, *ctx.options, need_dx, need_dw,
            need_db, *ctx.tp)
    if not getattr(ctx, "eager", False):
        out = lce_invariant_backward(*args)
    elif torch.is_grad_enabled():  # (create_graph=True: the implementation records no history)
        with torch.no_grad():
            out = _backward(*args)
    else:
        out = _backward(*args)
    out = guard_double_backward("linear_cross_entropy", (out[0] if need_dx else None, out[1] if need_dw else None,
                                                         out[2] if need_db else None), grad_loss, grad_lse, x,
                                weight, bias)
    return (*out, *nones)


_eager = register_autograd(lce_invariant_forward, _forward, _setup_context, _autograd_backward)


def blocked(x: Tensor, weight: Tensor, bias: Optional[Tensor], target: Tensor, class_weight: Optional[Tensor],
            opts: CrossEntropyOptions, backend: str, budget: int, need_argmax: bool,
            tp: VocabParallelOptions = _SINGLE):
    """(loss reduced as ``opts.reduction``, lse (N,), argmax (N,) or (0,)) of x (N, H),
    target (N,) int64, with the arguments the public function checked and prepared
    (autocast casts, shift, vocab_size's slice); the module docstring. ``tp``: a
    vocab-parallel head (``weight`` this rank's rows)."""
    inputs = (x, weight, bias, target, class_weight, *opts.args(), backend, budget, need_argmax, *tp.args())
    loss, lse, argmax, _ = _eager.runner(inputs)(*inputs)
    return loss, lse, argmax
