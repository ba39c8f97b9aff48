"""The torch.library custom ops of linear_cross_entropy: what autograd and torch.compile see.

    logitless::lce_forward(x, weight, bias, target, class_weight, <options>, backend,
                           budget, need_argmax, need_grad, grad_in_forward, need_dx,
                           need_dw, need_db, <vocab parallel>)
        -> loss, lse, argmax, w_t, keep, keep_max, config, gx, gw, gb
    logitless::lce_backward(grad_loss, grad_lse, x, weight, bias, target, class_weight, lse, w_t,
                            keep (overwritten with dz), keep_max, config, <options>,
                            backend, budget, need_dx, need_dw, need_db, <vocab parallel>)
        -> dx, dw, db

(the schemas, written out: ``FORWARD_SCHEMA``, ``BACKWARD_SCHEMA``). ``<options>`` are the
fields of ``CrossEntropyOptions`` (ignore_index, reduction, label_smoothing, softcap, z_loss);
``<vocab parallel>`` those of ``VocabParallelOptions`` (tp_group, vocab_size, partial_dx):
with a ``tp_group`` the weight is this rank's block of rows of a vocab-parallel head
(``vocab_parallel``). ``backend`` names an entry of the table ``api.BACKENDS`` (given here
by ``use_backends``), an ``LceBackend`` (``contract``).

The forward plans the call ONCE (``backend.plan``: the backend's frozen Config); the
forward, its gradient-in-forward strategy (the Config picks it where ``grad_in_forward``
allows it), the fake's kept shapes and the backward follow that Config. ``config`` is the
object on the eager fast path and the backend's encoding (``backend.codec``: a CPU int64
tensor) through the custom ops. ``keep``/``keep_max``: the columns of exp(z - m) the
forward kept (``NOTHING_KEPT``-shaped dummies when none); the backward turns them into dz
in place (declared as a mutation), so they serve the first backward only (``_backward``:
a second one, retain_graph=True, recomputes). ``gx, gw, gb``: the gradients for a unit
upstream gradient when the forward used the gradient-in-forward strategy (eager only),
which the backward scales. The per-token ``lse`` is differentiable (``grad_lse``). Absent
outputs are tensors of size 0. Double backward raises.

The autograd (``_setup_context``, ``_backward``) is written out below: what is saved and
what the backward op receives; ``ops.common.contract.register_autograd`` wires it and the
eager fast path.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Optional

import torch
from torch import Tensor

from logitless.formulas.common import compute_dtype, reduce
from logitless.formulas.cross_entropy import TokenStats, token_loss
from logitless.ops.common.autocast import disabled as no_autocast
from logitless.ops.common.autograd import (
    custom_op,
    fake_grad_outputs,
    grad_outputs,
    guard_double_backward,
    zero_grads,
)
from logitless.ops.common.contract import register_autograd
from logitless.ops.common.grad_in_forward import scale_grads
from logitless.ops.common.kept import NOTHING_KEPT, fake_kept, fake_kept_tensors, nothing_kept
from logitless.ops.common.validate import check_targets_in_range
from logitless.options import CrossEntropyOptions, VocabParallelOptions

from .contract import LceBackend

OP = "linear_cross_entropy"

OPTIONS_SCHEMA = "SymInt ignore_index, str reduction, float label_smoothing, float? softcap, float z_loss"
TP_SCHEMA = 'str tp_group="", SymInt vocab_size=-1, bool partial_dx=False'
FORWARD_SCHEMA = (
    f"(Tensor x, Tensor weight, Tensor? bias, Tensor target, Tensor? class_weight, {OPTIONS_SCHEMA}, str backend, "
    "SymInt budget, bool need_argmax, bool need_grad, bool grad_in_forward, bool need_dx, bool need_dw, "
    f"bool need_db, {TP_SCHEMA}) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)"
)
BACKWARD_SCHEMA = (
    "(Tensor grad_loss, Tensor? grad_lse, Tensor x, Tensor weight, Tensor? bias, Tensor target, "
    "Tensor? class_weight, Tensor lse, Tensor w_t, Tensor(a9!) keep, Tensor keep_max, Tensor config, "
    f"{OPTIONS_SCHEMA}, str backend, SymInt budget, bool need_dx, bool need_dw, bool need_db, {TP_SCHEMA}) "
    "-> (Tensor, Tensor, Tensor)"
)
#: The forward's arguments: 18, then the 3 defaulted ``<vocab parallel>`` ones.
_NUM_INPUTS = 21

#: backend name -> LceBackend: ``api.BACKENDS``, given once at import (``use_backends``).
BACKENDS: Mapping[str, LceBackend] = {}


def use_backends(table: Mapping[str, LceBackend]) -> None:
    """The table of backends the custom ops run (``api.BACKENDS``)."""
    global BACKENDS
    BACKENDS = table


def _forward(x: Tensor, weight: Tensor, bias: Optional[Tensor], target: Tensor, class_weight: Optional[Tensor],
             ignore_index: int, reduction: str, label_smoothing: float, softcap: Optional[float], z_loss: float,
             backend: str, budget: int, need_argmax: bool, need_grad: bool, grad_in_forward: bool, need_dx: bool,
             need_dw: bool, need_db: bool, tp_group: str = "", vocab_size: int = -1, partial_dx: bool = False,
             *, config=None):
    """x (N, H), weight (V, H), target (N,) int64 -> the forward op's outputs (module
    docstring), ``config`` as the object. A given ``config`` (the Config of an earlier
    call of the same shapes: ``batch_invariant``'s blocks) is used as is."""
    opts = CrossEntropyOptions(ignore_index, reduction, label_smoothing, softcap, z_loss)
    impl = BACKENDS[backend]
    if tp_group:
        from . import vocab_parallel

        tp = VocabParallelOptions(tp_group, vocab_size, partial_dx)
        with no_autocast(x.device):
            loss, lse, argmax, w_t, kept, config = vocab_parallel.forward(
                impl, x, weight, bias, target, class_weight, opts, tp, budget=budget, need_argmax=need_argmax,
                need_grad=need_grad, need_dw=need_dw, config=config)
        return _outputs(x, target, loss, lse, argmax if need_argmax else None, w_t, kept, config, None)
    check_targets_in_range(target, weight.shape[0], ignore_index)
    with no_autocast(x.device):
        if x.shape[0] == 0:
            empty = x.new_empty(0, dtype=compute_dtype(x.dtype))
            stats = TokenStats(empty, empty, empty, target.new_empty(0, dtype=torch.int64))
            loss_tok, w_t = token_loss(stats, target, weight.shape[0], class_weight, opts)
            return _outputs(x, target, reduce(loss_tok, w_t, reduction), empty, stats.argmax if need_argmax else None,
                            w_t, None, None, None)
        # The call's Config, once: the forward, its strategy and the backward follow it.
        if config is None:
            config = impl.plan(x, weight, bias, class_weight, opts, budget=budget, need_grad=need_grad,
                               need_argmax=need_argmax, grad_in_forward=grad_in_forward, need_dw=need_dw)
        out = impl.forward(x, weight, bias, target, class_weight, opts, config, need_argmax=need_argmax,
                           need_dx=need_dx, need_dw=need_dw, need_db=need_db)
    return _outputs(x, target, out.loss, out.stats.lse, out.stats.argmax if need_argmax else None, out.w_t,
                    out.kept, config, out.grads)


def _outputs(x, target, loss, lse, argmax, w_t, kept, config, grads):
    """The forward op's outputs (module docstring) from its results."""
    sd = torch.float64 if x.dtype == torch.float64 else torch.float32  # (formulas.common.compute_dtype)
    argmax = argmax if argmax is not None else target.new_empty(0, dtype=torch.int64)
    if kept is None:
        kept = nothing_kept(x)
    grads = [g if g is not None else x.new_empty(0) for g in (grads or (None,) * 3)]
    return (loss.to(sd), lse.to(sd), argmax, w_t.to(sd), kept[0], kept[1], config, *grads)


def _forward_op(*args):
    """The custom op's implementation: ``_forward`` with the Config encoded by its backend."""
    out = _forward(*args)
    return (*out[:6], BACKENDS[args[10]].codec.encode(out[6]), *out[7:])


def _forward_fake(x, weight, bias, target, class_weight, ignore_index, reduction, label_smoothing, softcap, z_loss,
                  backend, budget, need_argmax, need_grad, grad_in_forward, need_dx, need_dw, need_db, tp_group="",
                  vocab_size=-1, partial_dx=False):
    """Shapes and dtypes; the kept columns' shapes from a Config planned as the forward
    would (concrete sizes only, at most once)."""
    n, (v, h) = x.shape[0], weight.shape
    sd = compute_dtype(x.dtype)
    impl = BACKENDS[backend]
    opts = CrossEntropyOptions(ignore_index, reduction, label_smoothing, softcap, z_loss)
    loss = x.new_empty((n,) if reduction == "none" else (), dtype=sd)
    grads = [x.new_empty(0) for _ in range(3)]
    kept = fake_kept_tensors(x)
    planned = []

    def config():  # (as the forward plans, without the CuTe choice: no memory here)
        if not planned:
            planned.append(impl.plan(x, weight, bias, class_weight, opts, budget=budget, need_grad=need_grad,
                                     need_argmax=need_argmax, grad_in_forward=grad_in_forward, need_dw=need_dw,
                                     cute=False))
        return planned[0]

    gif = grad_in_forward and n > 0 and getattr(config(), "grad_in_forward", 0)  # (eager only)
    if gif:
        f32 = torch.float32
        grads = [
            torch.empty_like(x) if need_dx else grads[0],
            (torch.empty_like(weight) if gif >= n else weight.new_empty(v, h, dtype=f32)) if need_dw else grads[1],
            weight.new_empty(v, dtype=f32) if need_db else grads[2],
        ]
    elif need_grad and not (tp_group and isinstance(v, int) and v == 0):
        kept = fake_kept(x, weight, tp_group, vocab_size, lambda n, v, h: impl.kept_shapes(config(), n))
    return (loss, x.new_empty(n, dtype=sd), x.new_empty(n if need_argmax else 0, dtype=torch.int64),
            x.new_empty(n, dtype=sd), *kept, impl.codec.fake(), *grads)


def _backward_impl(grad_loss, grad_lse, x, weight, bias, target, class_weight, lse, w_t, keep, keep_max, config,
                   ignore_index, reduction, label_smoothing, softcap, z_loss, backend, budget, need_dx, need_dw,
                   need_db, tp_group="", vocab_size=-1, partial_dx=False):
    """dx, dw, db (size 0 where not needed). Overwrites ``keep`` (when not a dummy) with dz.
    ``config``: the forward's (the object, or its encoding)."""
    dx = dw = db = None
    if x.shape[0] == 0:
        dx, dw, db = zero_grads(x, weight, bias)
    elif need_dx or need_dw or need_db:
        impl = BACKENDS[backend]
        if isinstance(config, Tensor):  # (through the custom ops; the eager path hands the object)
            config = impl.codec.decode(config)
        kept = None if keep.shape == NOTHING_KEPT else (keep, keep_max)
        opts = CrossEntropyOptions(ignore_index, reduction, label_smoothing, softcap, z_loss)
        with no_autocast(x.device):
            if tp_group:
                from . import vocab_parallel

                dx, dw, db = vocab_parallel.backward(
                    impl, grad_loss, grad_lse, x, weight, bias, target, class_weight, lse, w_t, opts,
                    VocabParallelOptions(tp_group, vocab_size, partial_dx), need_dx=need_dx, need_dw=need_dw,
                    need_db=need_db, config=config, kept=kept)
            else:
                coef = impl.grad_coefficients(grad_loss, grad_lse, lse, w_t, target, class_weight, opts,
                                              weight.shape[0])
                dx, dw, db = impl.backward(x, weight, bias, target, class_weight, softcap, lse, coef, config,
                                           kept=kept, need_dx=need_dx, need_dw=need_dw, need_db=need_db)
    return grad_outputs(x, dx, dw, db, need_dx, need_dw, need_db)


def _backward_fake(grad_loss, grad_lse, x, weight, bias, *rest):
    need_dx, need_dw, need_db = rest[14:17]
    return fake_grad_outputs(x, weight, bias, need_dx, need_dw, need_db)


lce_forward = custom_op("lce_forward", _forward_op, schema=FORWARD_SCHEMA)
lce_forward.register_fake(_forward_fake)
lce_backward = custom_op("lce_backward", _backward_impl, mutates_args=("keep",), schema=BACKWARD_SCHEMA)
lce_backward.register_fake(_backward_fake)


def _setup_context(ctx, inputs, output):
    """Saved: x, weight, bias, target, class_weight, lse, w_t. On ctx: the options and
    execution arguments, the Config, the kept columns (the first backward's), the
    gradient-in-forward strategy's gradients when the forward used it."""
    if len(inputs) < _NUM_INPUTS:  # (a compiled graph may leave the defaulted ones out)
        inputs = (*inputs, "", -1, False)[:_NUM_INPUTS]
    x, weight, bias, target, class_weight = inputs[:5]
    loss, lse, argmax, w_t, keep, keep_max, config, gx, gw, gb = output
    ctx.save_for_backward(x, weight, bias, target, class_weight, lse, w_t)
    ctx.options = inputs[5:12]  # <options>, backend, budget
    ctx.tp = inputs[18:]
    ctx.config = config
    ctx.kept = (keep, keep_max)
    ctx.forward_grads = None
    if inputs[14] and (gx.numel() or gw.numel() or gb.numel()):  # grad_in_forward allowed and used
        ctx.forward_grads = (gx, gw, gb)
        ctx.dtypes = (x.dtype, weight.dtype)
    if isinstance(config, Tensor):
        ctx.mark_non_differentiable(argmax, w_t, keep, keep_max, config, gx, gw, gb)
    else:  # (the eager fast path's Config is the object)
        ctx.mark_non_differentiable(argmax, w_t, keep, keep_max, gx, gw, gb)
    ctx.set_materialize_grads(False)


def _backward(ctx, grad_loss, grad_lse, *_):
    """(dx, dw, db, None...): the backward op on the saved tensors and the forward's Config,
    or the gradient-in-forward strategy's gradients scaled by ``grad_loss``."""
    kept, ctx.kept = ctx.kept, None
    forward_grads, ctx.forward_grads = ctx.forward_grads, None
    needs = ctx.needs_input_grad
    need_dx, need_dw, need_db = needs[0], needs[1], needs[2]
    nones = (None,) * (_NUM_INPUTS - 3)
    if not (need_dx or need_dw or need_db):
        return (None, None, None, *nones)
    x, weight, bias, target, class_weight, lse, w_t = ctx.saved_tensors
    if grad_loss is None:  # (gradients are not materialised)
        grad_loss = torch.zeros(lse.shape if ctx.options[1] == "none" else (), dtype=lse.dtype, device=lse.device)
    if kept is None:  # a second backward: the kept columns are spent
        kept = nothing_kept(x)
    # The eager fast path calls the implementation, recording no autograd history (as the
    # dispatcher runs a custom op's: a backward with create_graph=True runs in grad mode).
    op = lce_backward if not getattr(ctx, "eager", False) else _backward_impl
    no_grad = op is _backward_impl and torch.is_grad_enabled()
    rest = (*ctx.options, need_dx, need_dw, need_db, *ctx.tp)
    if forward_grads is not None:
        # Gradient-in-forward: scale the forward's gradients by the upstream gradient, in
        # place; a gradient of the lse (rare) comes on top through the backward op.
        out = scale_grads([g if g.numel() else None for g in forward_grads], grad_loss, *ctx.dtypes)
        if grad_lse is not None:
            with torch.no_grad() if no_grad else contextlib.nullcontext():
                extra = op(torch.zeros_like(grad_loss), grad_lse, x, weight, bias, target, class_weight, lse, w_t,
                           *nothing_kept(x), ctx.config, *rest)
            out = tuple(g + e if g is not None else None for g, e in zip(out, extra))
    elif no_grad:
        with torch.no_grad():
            out = op(grad_loss, grad_lse, x, weight, bias, target, class_weight, lse, w_t, *kept, ctx.config, *rest)
    else:
        out = op(grad_loss, grad_lse, x, weight, bias, target, class_weight, lse, w_t, *kept, ctx.config, *rest)
    out = guard_double_backward(OP, (out[0] if need_dx else None, out[1] if need_dw else None,
                                     out[2] if need_db else None), grad_loss, grad_lse, x, weight, bias)
    return (*out, *nones)


#: What the public function calls: ``lce_forward`` with its autograd, through a plain
#: autograd.Function in eager mode (``autograd.EagerOp``: ``.runner(inputs)(*inputs)``).
lce_forward_eager = register_autograd(lce_forward, _forward, _setup_context, _backward)
