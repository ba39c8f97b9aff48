"""linear_cross_entropy with ``batch_invariant=True``: the forward on fixed-size row
blocks (``ops.common.invariant``), the backward once over the whole batch.

The forward runs the op's forward implementation (``custom_op._forward``, reduction
"none", no gradient planned: nothing kept, no gradient-in-forward) on blocks of
``invariant_rows`` rows, the last block padded with zero rows of ignored targets, so
every GEMM, plan and reduction of a row has the same shape whatever the batch: the
per-token loss, lse and argmax of a row are the same bits whatever the batch size, the
row's position and its neighbours (with or without a gradient to follow). The
reductions ("mean", "sum") add the per-token losses afterwards (their bits may follow
the batch; the per-token values do not).

The backward is the default op's (``custom_op._backward``: the backend's
``grad_coefficients`` and ``backward``) run once over the whole batch with the blocked
forward's lse, the gradients of the per-token losses and of the lse (``grad_lse``):
one dW, no forward re-run. Gradients are deterministic run to run, not batch-invariant
(as linear_log_probs'). Cost against the default op: up to one block of padding rows in
the forward, and no kept columns for the backward (one recomputed GEMM more than the
default path when its budget keeps columns); memory as the default op's.

Over a vocab-parallel head (``vocab_parallel``) each block's statistics are merged with
the SUM added in rank order after an all-gather (``distributed.sum_in_rank_order``: an
all-reduce's order may follow the message size); the backward is the vocab-parallel one.

torch.compile: this path is an autograd.Function over eager code (not custom ops).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from logitless.distributed import vocab_shard
from logitless.formulas.common import reduce
from logitless.ops.common.autocast import disabled as no_autocast
from logitless.ops.common.dispatch import load_backend
from logitless.ops.common.invariant import blocks, invariant_rows, pad_rows
from logitless.ops.common.kept import nothing_kept
from logitless.options import CrossEntropyOptions, VocabParallelOptions

from . import custom_op, vocab_parallel

_SINGLE = VocabParallelOptions()


class _Blocked(torch.autograd.Function):
    """(x, weight, bias, target, class_weight, opts (reduction "none"), backend, budget,
    need_argmax, tp) -> per-token loss, lse, argmax (or empty), w_t."""

    @staticmethod
    def forward(ctx, x, weight, bias, target, class_weight, opts, backend, budget, need_argmax, tp):
        parts = []
        for n0, n1, pad in blocks(x.shape[0], invariant_rows(backend, x.device)) or [(0, 0, 0)]:
            xb, tb = pad_rows(x, n0, n1, pad), pad_rows(target, n0, n1, pad, opts.ignore_index)
            if tp.parallel:  # the ranks' statistics added in rank order
                with no_autocast(x.device):
                    loss, lse, argmax, w_t, _, _ = vocab_parallel.forward(
                        load_backend(custom_op.__package__, backend), xb, weight, bias, tb, class_weight, opts, tp,
                        budget=budget, need_argmax=need_argmax, need_grad=False, ordered=True)
                if argmax is None:
                    argmax = tb.new_empty(0, dtype=torch.int64)
                out = (loss, lse, argmax, w_t)
            else:
                out = custom_op._forward(xb, weight, bias, tb, class_weight, opts, backend, budget, need_argmax,
                                         False, False, False, False, False, _SINGLE)
            parts.append([t[:n1 - n0] for t in out[:4]])  # loss, lse, argmax, w_t
        loss, lse, argmax, w_t = (torch.cat(c) for c in zip(*parts))
        ctx.save_for_backward(x, weight, bias, target, class_weight, lse, w_t)
        ctx.args = (opts, backend, budget, tp)
        ctx.mark_non_differentiable(argmax, w_t)
        ctx.set_materialize_grads(False)
        return loss, lse, argmax, w_t

    @staticmethod
    @once_differentiable
    def backward(ctx, g_loss, g_lse, _g_argmax, _g_wt):
        x, weight, bias, target, class_weight, lse, w_t = ctx.saved_tensors
        opts, backend, budget, tp = ctx.args
        need_dx, need_dw, need_db = ctx.needs_input_grad[:3]
        if g_loss is None:
            g_loss = torch.zeros_like(lse)
        plan = None
        w, b, cw = weight, bias, class_weight
        if tp.parallel:  # this rank's real rows (the vocab-parallel backward plans for them)
            shard = vocab_shard(tp.tp_group, weight.shape[0], x.device, tp.vocab_size)
            w, b = shard.real_rows(weight), shard.real_rows(bias)
            cw = shard.class_slice(vocab_parallel.full_class_weight(class_weight, shard))
        if x.shape[0] > 0 and w.shape[0] > 0:  # the backward's plan over the whole batch (nothing kept)
            plan = load_backend(custom_op.__package__, backend).plan(
                x, w, b, cw, opts, budget=budget, need_grad=False, need_argmax=False, cute=False)
        dx, dw, db = custom_op._backward(g_loss, g_lse, x, weight, bias, target, class_weight, lse, w_t,
                                         *nothing_kept(x), plan, opts, backend, budget, need_dx, need_dw,
                                         need_db, tp)
        return (dx if need_dx else None, dw if need_dw else None, db if need_db else None,
                None, None, None, None, None, None, None)


def blocked(x: Tensor, weight: Tensor, bias: Optional[Tensor], target: Tensor, class_weight: Optional[Tensor],
            opts: CrossEntropyOptions, backend: str, budget: int, need_argmax: bool,
            tp: VocabParallelOptions = _SINGLE):
    """(loss reduced as ``opts.reduction``, lse (N,), argmax (N,) or (0,)) of x (N, H),
    target (N,) int64, with the arguments the public function checked and prepared
    (autocast casts, shift, vocab_size's slice); the module docstring. ``tp``: a
    vocab-parallel head (``weight`` this rank's rows)."""
    loss, lse, argmax, w_t = _Blocked.apply(x, weight, bias, target, class_weight,
                                            replace(opts, reduction="none"), backend, budget, need_argmax, tp)
    return reduce(loss, w_t, opts.reduction), lse, argmax
