"""The bodies of linear_topk_kl's custom ops (``logitless::topk_kl_forward`` and
``_backward``), written against the declared calls of ``contract`` (``TopKCall`` ->
``TopKOutputs``, ``TopKBackwardCall`` -> dx, dw, db); ``ops.common.glue.CustomOp`` derives
the schemas, the flattening and the autograd wiring from those declarations.

The forward plans the call ONCE (``backend.plan``), runs the backend's forward (the
statistics of the full rows: ``formulas.topk_kl.TopKStats``; over a vocab-parallel head
``vocab_parallel`` merges the ranks'), and ``formulas.topk_kl.token_terms`` turns them into
the loss and, when a backward follows, the coefficients of a unit upstream gradient. The
backward scales those by each token's upstream gradient and runs the backend's backward
under the forward's Config; ``keep``/``keep_max`` serve the first backward only (a second
one, retain_graph=True, recomputes).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor

from logitless.formulas.common import compute_dtype, reduce
from logitless.formulas.cross_entropy import upstream_per_token
from logitless.formulas.topk_kl import TopKStats, token_terms
from logitless.ops.common.autocast import disabled as no_autocast
from logitless.ops.common.contract import BackendTable, Needs
from logitless.ops.common.glue import CustomOp, Owned, fake_grad_outputs
from logitless.ops.common.kept import Kept, fake_kept, fake_kept_tensors, linear_backward, nothing_kept, take_kept
from logitless.ops.common.validate import check_targets_in_range

from .contract import TopKBackend, TopKBackwardCall, TopKCall, TopKOutputs

#: The custom ops: logitless::topk_kl_forward, logitless::topk_kl_backward.
NAME = "topk_kl"
OP = "linear_topk_kl"


def check_teacher(ids: Tensor, teacher_log_probs: Tensor, num_classes: int) -> None:
    """ValueError for a teacher id outside [0, V) or repeated within a token, or a
    log-probability > 0 (CPU tensors only: on a GPU the check would be a host sync; such a
    token's loss is NaN there, or counts a repeated id twice). ``ids`` ascending per row.
    (In the op's implementation, which runs on real tensors also under torch.compile.)"""
    if ids.numel() == 0 or ids.device.type != "cpu":
        return
    positive = teacher_log_probs > 0
    if bool(positive.any()):
        position = int(positive.reshape(-1).nonzero()[0])
        raise ValueError(f"teacher_log_probs contains {float(teacher_log_probs.reshape(-1)[position]):.4g} > 0 at "
                         f"position {position} (flat index, after sorting each token's ids): log-probabilities are "
                         "<= 0 (logits passed by mistake? take log_softmax of the teacher's logits first)")
    bad = (ids < 0) | (ids >= num_classes)
    if bool(bad.any()):
        position = int(bad.reshape(-1).nonzero()[0])
        raise ValueError(f"teacher_ids contains {int(ids.reshape(-1)[position])}, outside [0, {num_classes}), "
                         f"at position {position} (flat index, after sorting each token's ids)")
    repeated = ids[:, 1:] == ids[:, :-1]
    if bool(repeated.any()):
        row = int(repeated.any(1).nonzero()[0])
        raise ValueError(f"teacher_ids repeats an id within token {row} (flat index): the ids of a token must be "
                         "distinct (the teacher's top-k)")


def check_target(target: Tensor, num_classes: int, opts) -> None:
    """With hard labels: a target outside [0, V) that is not ignore_index raises on the CPU."""
    if opts.hard:
        check_targets_in_range(target, num_classes, opts.ignore_index)


def forward(call: TopKCall, impl: TopKBackend) -> TopKOutputs:
    """The forward op's outputs (``contract.TopKOutputs``), ``config`` as the object."""
    x, weight, ids, target, opts = call.x, call.weight, call.ids, call.target, call.opts
    n, k = ids.shape
    kept = config = None
    with no_autocast(x.device):
        if call.tp.tp_group:
            from . import vocab_parallel

            v = vocab_parallel.vocab_size(call)
            check_teacher(ids, call.teacher_log_probs, v)
            check_target(target, v, opts)
            stats, kept, config = vocab_parallel.forward(impl, call)
        else:
            v = weight.shape[0]
            check_teacher(ids, call.teacher_log_probs, v)
            check_target(target, v, opts)
            if n == 0:
                cd = compute_dtype(x.dtype)
                empty = x.new_empty(0, dtype=cd)
                stats = TopKStats(empty, x.new_empty((0, k), dtype=cd), empty, empty)
            else:
                config = _plan(impl, call)  # once
                out = impl.forward(x, weight, call.bias, ids, target, opts, config)
                stats, kept = out.stats, out.kept
        terms = token_terms(stats, call.teacher_log_probs, ids, target, opts, v, grad=call.need_grad)
    return _outputs(call, stats, terms, kept, config)


def _outputs(call: TopKCall, stats: TopKStats, terms, kept, config) -> TopKOutputs:
    x = call.x
    cd = compute_dtype(x.dtype)
    lse1 = stats.lse1 if stats.lse1 is not None else stats.lse_tail
    rows = torch.stack([stats.lse_tail.to(cd), lse1.to(cd)])
    coef = terms.coef if terms.coef is not None else x.new_empty(0, dtype=cd)
    sparse = terms.sparse if terms.sparse is not None else x.new_empty((0, 0), dtype=cd)
    keep, keep_max = kept if kept is not None else nothing_kept(x)
    return TopKOutputs(reduce(terms.loss, terms.w, call.opts.reduction), terms.w, rows, coef, sparse, keep,
                       keep_max, config)


def fake(call: TopKCall, impl: TopKBackend) -> TopKOutputs:
    """Shapes and dtypes; the kept columns' shapes from a Config planned as the forward
    would (concrete sizes only, at most once)."""
    x, weight = call.x, call.weight
    n, k = call.ids.shape
    cd = compute_dtype(x.dtype)
    loss = x.new_empty((n,) if call.opts.reduction == "none" else (), dtype=cd)
    kept = fake_kept_tensors(x)
    if call.need_grad and not (call.tp.tp_group and isinstance(weight.shape[0], int) and weight.shape[0] == 0):
        kept = fake_kept(x, weight, call.tp.tp_group, call.tp.vocab_size, lambda n, v, h: impl.kept_shapes(
            impl.plan(x, weight, call.bias, call.opts, budget=call.budget, need_grad=True, k=k, cute=False,
                      kept_owned=call.owned), n))
    grad = call.need_grad
    return TopKOutputs(loss, x.new_empty(n, dtype=cd), x.new_empty((2, n), dtype=cd),
                       x.new_empty((3, n) if grad else (0,), dtype=cd),
                       x.new_empty((n, k) if grad else (0, 0), dtype=cd), *kept, None)


def backward_impl(b: TopKBackwardCall, impl: TopKBackend):
    """dx, dw, db (size 0 where not needed). Overwrites ``keep`` (when not a dummy) with dz."""

    def grads(config, kept: Optional[Kept]):
        g = upstream_per_token(b.grad_loss, b.w, b.opts.reduction)
        counted = b.w > 0  # (a "mean" over no token: g is inf there, its coefficients are 0)
        coef = torch.where(counted, b.coef * g, torch.zeros_like(b.coef))
        sparse = torch.where(counted[:, None], b.sparse * g[:, None], torch.zeros_like(b.sparse))
        with no_autocast(b.x.device):
            if b.tp.tp_group:
                from . import vocab_parallel

                return vocab_parallel.backward(impl, b, coef, sparse, config, kept)
            return impl.backward(b.x, b.weight, b.bias, b.ids, b.target, b.opts, b.rows, coef, sparse, config,
                                 kept=kept, need_dx=b.need.need_dx, need_dw=b.need.need_dw, need_db=b.need.need_db)

    return linear_backward(b, grads)


def _plan(impl: TopKBackend, c: TopKCall | TopKBackwardCall) -> Any:
    """The backend's Config of a call on one device with tokens (the forward's, and
    ``replan``'s from the backward call: the same)."""
    return impl.plan(c.x, c.weight, c.bias, c.opts, budget=c.budget, need_grad=c.need_grad, k=c.ids.shape[1],
                     kept_owned=c.owned)


def replan(b: TopKBackwardCall, impl: TopKBackend) -> Any:
    """The forward's Config of ``b`` (the backward custom op's), planned again from the same
    inputs (the planners are memoised: the forward's object); None without tokens."""
    if b.ids.shape[0] == 0:
        return None
    with no_autocast(b.x.device):
        if b.tp.tp_group:
            from . import vocab_parallel

            return vocab_parallel.plan(impl, b)
        return _plan(impl, b)


def backward_fake(b: TopKBackwardCall, impl: TopKBackend):
    return fake_grad_outputs(b.x, b.weight, b.bias, b.need.need_dx, b.need.need_dw, b.need.need_db)


def save(ctx, call: TopKCall, out: TopKOutputs) -> None:
    """Saved: x, weight, bias, ids, target and the forward's per-token results; on ctx: the
    options and execution fields the backward reads, the Config, the kept columns (the
    first backward's)."""
    ctx.save_for_backward(call.x, call.weight, call.bias, call.ids, call.target, out.w, out.rows, out.coef,
                          out.sparse)
    ctx.opts, ctx.backend, ctx.tp = call.opts, call.backend, call.tp
    ctx.config = out.config  # (None through the custom ops: the backward op plans it again)
    ctx.budget, ctx.need_grad = call.budget, call.need_grad
    ctx.kept = (out.keep, out.keep_max)
    ctx.mark_non_differentiable(out.w, out.rows, out.coef, out.sparse, out.keep, out.keep_max)
    ctx.set_materialize_grads(False)


def backward(ctx, grads: TopKOutputs, need, run) -> tuple:
    """(dx, dw, db): the backward op (``run``) on the saved tensors and the forward's Config."""
    x, weight, bias, ids, target, w, rows, coef, sparse = ctx.saved_tensors
    keep, keep_max = take_kept(ctx, x)
    grad_loss: Optional[Tensor] = grads.loss
    if grad_loss is None:  # (gradients are not materialised)
        shape = w.shape if ctx.opts.reduction == "none" else ()
        grad_loss = torch.zeros(shape, dtype=w.dtype, device=w.device)
    return run(TopKBackwardCall(grad_loss, x, weight, bias, ids, target, w, rows, coef, sparse, keep, keep_max,
                                ctx.config, ctx.opts, ctx.backend, Needs(need.x, need.weight, need.bias), ctx.tp,
                                ctx.budget, ctx.need_grad, Owned(ctx.eager)))


def define(backends: BackendTable[TopKBackend]) -> CustomOp[TopKCall, TopKOutputs, TopKBackwardCall, TopKBackend]:
    """The custom-op pair over the table of backends ``backends`` (``api.BACKENDS``)."""
    return CustomOp(NAME, TopKCall, TopKOutputs, TopKBackwardCall, table=backends, forward=forward, fake=fake,
                    save=save, backward=backward, backward_impl=backward_impl, backward_fake=backward_fake, title=OP,
                    replan=replan)
