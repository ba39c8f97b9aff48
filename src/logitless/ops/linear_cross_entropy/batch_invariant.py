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

The forward and backward are custom ops (``SPEC``): torch.compile(fullgraph=True) sees
fixed output shapes.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

import torch
from torch import Tensor

from logitless.distributed import vocab_shard
from logitless.formulas.common import compute_dtype, reduce
from logitless.ops.common.autocast import disabled as no_autocast
from logitless.ops.common.autograd import fake_grad_outputs
from logitless.ops.common.invariant import blocks, invariant_rows, pad_rows
from logitless.ops.common.kept import nothing_kept
from logitless.ops.common.spec import OpSpec, build, options, scalar, tensor
from logitless.options import CrossEntropyOptions, VocabParallelOptions

from . import custom_op, vocab_parallel

_SINGLE = VocabParallelOptions()


def _forward(x: Tensor, weight: Tensor, bias: Optional[Tensor], target: Tensor, class_weight: Optional[Tensor],
             opts: CrossEntropyOptions, backend: str, budget: int, need_argmax: bool, tp: VocabParallelOptions):
    """-> loss reduced as ``opts.reduction`` (here: its bits do not follow a compiler's
    reduction), per-token lse, argmax (or (0,)), w_t."""
    reduction, opts = opts.reduction, replace(opts, reduction="none")
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


def _forward_fake(x, weight, bias, target, class_weight, opts, backend, budget, need_argmax, tp):
    n = x.shape[0]
    sd = compute_dtype(x.dtype)
    return (x.new_empty((n,) if opts.reduction == "none" else (), dtype=sd), x.new_empty(n, dtype=sd),
            x.new_empty(n if need_argmax else 0, dtype=torch.int64), x.new_empty(n, dtype=sd))


def _backward(grad_loss, grad_lse, x, weight, bias, target, class_weight, lse, w_t, opts: CrossEntropyOptions,
              backend: str, budget: int, need_dx: bool, need_dw: bool, need_db: bool, tp: VocabParallelOptions):
    """dx, dw, db (size 0 where not needed): the default op's backward over the whole
    batch, with the per-token gradient of the reduction as autograd would give it
    (sum: expanded; mean: divided by the weights' sum, then expanded)."""
    reduction, opts = opts.reduction, replace(opts, reduction="none")
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


def _backward_fake(grad_loss, grad_lse, x, weight, bias, *_rest):
    *_, need_dx, need_dw, need_db, _tp = _rest
    return fake_grad_outputs(x, weight, bias, need_dx, need_dw, need_db)


_HEAD = (tensor("x"), tensor("weight"), tensor("bias", True), tensor("target"), tensor("class_weight", True))
_EXEC = (options("opts", CrossEntropyOptions), scalar("backend", str), scalar("budget", int))
_TP = options("tp", VocabParallelOptions, defaulted=True)

#: logitless::lce_invariant_forward(x, weight, bias, target, class_weight, <options>,
#:     backend, budget, need_argmax, <vocab parallel>) -> loss, lse, argmax, w_t;
#: logitless::lce_invariant_backward(grad_loss, grad_lse, ...) -> dx, dw, db.
SPEC = OpSpec(
    op="linear_cross_entropy",
    name="lce_invariant_forward",
    forward=(*_HEAD, *_EXEC, scalar("need_argmax", bool), _TP),
    outputs=("loss", "lse", "argmax", "w_t"),
    forward_impl=_forward,
    forward_fake=_forward_fake,
    backward_name="lce_invariant_backward",
    backward=(tensor("grad_loss", True), tensor("grad_lse", True), *_HEAD, tensor("lse"), tensor("w_t"), *_EXEC,
              scalar("need_dx", bool), scalar("need_dw", bool), scalar("need_db", bool), _TP),
    backward_impl=_backward,
    backward_fake=_backward_fake,
    grads=("grad_loss", "grad_lse", None, None),
    grad_inputs=("x", "weight", "bias"),
    need={"need_dx": "x", "need_dw": "weight", "need_db": "bias"},
)

_built = build(SPEC)
lce_invariant_forward, lce_invariant_backward = _built.forward_op, _built.backward_op


def blocked(x: Tensor, weight: Tensor, bias: Optional[Tensor], target: Tensor, class_weight: Optional[Tensor],
            opts: CrossEntropyOptions, backend: str, budget: int, need_argmax: bool,
            tp: VocabParallelOptions = _SINGLE):
    """(loss reduced as ``opts.reduction``, lse (N,), argmax (N,) or (0,)) of x (N, H),
    target (N,) int64, with the arguments the public function checked and prepared
    (autocast casts, shift, vocab_size's slice); the module docstring. ``tp``: a
    vocab-parallel head (``weight`` this rank's rows)."""
    loss, lse, argmax, _ = _built.eager(x, weight, bias, target, class_weight, *opts.args(), backend, budget,
                                        need_argmax, *tp.args())
    return loss, lse, argmax
