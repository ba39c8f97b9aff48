"""The torch.library custom ops of linear_cross_entropy: what autograd and torch.compile see.

    logitless::lce_forward(x, weight, bias, target, class_weight, <options>, backend,
                           budget, need_argmax, need_grad, grad_in_forward, need_dx,
                           need_dw, need_db, <vocab parallel>)
        -> loss, lse, argmax, w_t, keep, keep_max, plan, gx, gw, gb
    logitless::lce_backward(grad_loss, grad_lse, x, weight, bias, target, class_weight, lse, w_t,
                            keep (overwritten with dz), keep_max, plan, <options>,
                            backend, budget, need_dx, need_dw, need_db, <vocab parallel>)
        -> dx, dw, db

``<options>`` are the fields of ``CrossEntropyOptions`` under their own names
(ignore_index, reduction, label_smoothing, softcap, z_loss); ``<vocab parallel>``
those of ``VocabParallelOptions`` (tp_group, vocab_size, partial_dx): with a
``tp_group`` the weight is this rank's block of rows of a vocab-parallel head and the
ops merge statistics over the group (``vocab_parallel``). The per-token ``lse`` is
differentiable (``grad_lse``: d lse / d z_c = p_c adds to the A coefficient), so that
``LossStats.lse`` can enter a loss of the caller's.

Their implementations run eagerly, also under torch.compile (which sees only the fake
implementations: output shapes and dtypes), so they may branch on data: the CPU
target-range check lives here. The forward's implementation plans the call once (the
backend's ``plan``: a ``planning.plans.LinearPlan``, or None), and everything after
follows that plan: its launches, the gradient-in-forward strategy (``grad_in_forward``
only allows it; the plan picks it), the fake's kept shapes and the backward. ``plan``
is that object (the scaffolding carries it as a CPU int64 tensor across the custom ops,
``ops.common.plan_codec``, and hands the backward the object). ``keep``/``keep_max``
are the columns of exp(z - m) the Triton backend kept for the backward
(``NOTHING_KEPT``-shaped dummies when it kept none): the backward turns them into dz in
place (declared as a mutation), so they serve one backward; the autograd glue hands
them to the first backward only, a second one (retain_graph=True) recomputes instead.
Absent outputs (argmax without return_stats, gradients not needed) are tensors of
size 0. Options are plain ints/floats/strings.

The ops, their fakes and autograd (with the gradient-in-forward strategy's scaling) are
built from ``SPEC`` (``ops.common.spec``). Double backward is not supported:
differentiating the gradients raises.
"""

from __future__ import annotations

import torch
from torch import Tensor

from logitless.formulas.common import compute_dtype, reduce
from logitless.formulas.cross_entropy import TokenStats, token_loss
from logitless.ops.common.autocast import disabled as no_autocast
from logitless.ops.common.autograd import fake_grad_outputs, grad_outputs, zero_grads
from logitless.ops.common.dispatch import load_backend, load_strategy
from logitless.ops.common.kept import fake_kept, fake_kept_tensors, kept_buffers, nothing_kept
from logitless.ops.common.spec import OpSpec, build, options, scalar, tensor
from logitless.ops.common.validate import check_targets_in_range
from logitless.options import CrossEntropyOptions, VocabParallelOptions
from logitless.planning.plans import LinearPlan

OP = "linear_cross_entropy"


def _forward(x: Tensor, weight: Tensor, bias, target: Tensor, class_weight, opts: CrossEntropyOptions,
             backend: str, budget: int, need_argmax: bool, need_grad: bool, grad_in_forward: bool, need_dx: bool,
             need_dw: bool, need_db: bool, tp: VocabParallelOptions):
    """x (N, H), weight (V, H), target (N,) int64 -> loss (() or (N,)), lse (N,),
    argmax (N,) or (0,), w_t (N,), keep, keep_max, plan (see the module docstring), and
    gx, gw, gb: when ``grad_in_forward`` allows it and the call's plan picks it (the
    backend's gradient-in-forward strategy), the gradients for grad_output = 1 that the
    backward scales (gx in x's dtype; gw in weight's dtype for one chunk, else fp32; gb
    fp32), else empty."""
    n, v = x.shape[0], weight.shape[0]
    sd = compute_dtype(x.dtype)
    impl = load_backend(__package__, backend)
    kept = grads = plan = None
    if tp.parallel:
        from . import vocab_parallel

        with no_autocast(x.device):
            loss, lse, argmax, w_t, kept, plan = vocab_parallel.forward(
                impl, x, weight, bias, target, class_weight, opts, tp,
                budget=budget, need_argmax=need_argmax, need_grad=need_grad)
        return _outputs(x, target, loss, lse, argmax if need_argmax else None, w_t, kept, plan, None)
    check_targets_in_range(target, v, opts.ignore_index)
    loss = None
    with no_autocast(x.device):
        if n == 0:
            empty = x.new_empty(0, dtype=sd)
            stats = TokenStats(empty, empty, empty, target.new_empty(0, dtype=torch.int64))
        else:
            # The call's plan, once: the forward, its strategy and the backward follow it.
            plan = impl.plan(x, weight, bias, class_weight, opts, budget=budget, need_grad=need_grad,
                             need_argmax=need_argmax, grad_in_forward=grad_in_forward)
            if plan is not None and plan.grad_in_forward:
                stats, grads = load_strategy(__package__, backend, "grad_in_forward").forward_with_grad(
                    x, weight, bias, target, class_weight, opts, plan=plan,
                    need_smooth=opts.needs_smooth_sum, need_argmax=need_argmax, need_dx=need_dx,
                    need_dw=need_dw, need_db=need_db,
                )
            else:  # the loss with the statistics (Triton: one launch, ce_epilogue)
                stats, kept, loss, w_t = impl.forward(
                    x, weight, bias, target, class_weight, opts.softcap,
                    need_smooth=opts.needs_smooth_sum, need_argmax=need_argmax, budget=budget, plan=plan,
                    loss_opts=opts,
                )
        if loss is None:
            loss_tok, w_t = token_loss(stats, target, v, class_weight, opts)
            loss = reduce(loss_tok, w_t, opts.reduction)
    return _outputs(x, target, loss, stats.lse, stats.argmax if need_argmax else None, w_t, kept, plan, grads)


def _outputs(x, target, loss, lse, argmax, w_t, kept, plan, grads):
    """The forward op's outputs (module docstring) from its results (``plan``: the object;
    the scaffolding encodes it where the custom op runs)."""
    sd = compute_dtype(x.dtype)
    argmax = argmax if argmax is not None else target.new_empty(0, dtype=torch.int64)
    if kept is None:
        kept = nothing_kept(x)
    grads = [g if g is not None else x.new_empty(0) for g in (grads or (None,) * 3)]
    return (loss.to(sd), lse.to(sd), argmax, w_t.to(sd), kept[0], kept[1], plan, *grads)


def _forward_fake(x, weight, bias, target, class_weight, opts, backend, budget, need_argmax, need_grad,
                  grad_in_forward, need_dx, need_dw, need_db, tp):
    n, (v, h) = x.shape[0], weight.shape
    sd = compute_dtype(x.dtype)
    loss = x.new_empty((n,) if opts.reduction == "none" else (), dtype=sd)
    grads = [x.new_empty(0) for _ in range(3)]
    kept = fake_kept_tensors(x)
    impl = load_backend(__package__, backend)

    def plan():  # (as the forward plans; concrete sizes only)
        return impl.plan(x, weight, bias, class_weight, opts, budget=budget, need_grad=need_grad,
                         need_argmax=need_argmax, grad_in_forward=grad_in_forward, cute=False)

    gif = grad_in_forward and n > 0 and plan() is not None and plan().grad_in_forward  # (eager only)
    if gif:
        f32 = torch.float32
        grads = [
            torch.empty_like(x) if need_dx else grads[0],
            (torch.empty_like(weight) if plan().grad_in_forward >= n else weight.new_empty(v, h, dtype=f32))
            if need_dw else grads[1],
            weight.new_empty(v, dtype=f32) if need_db else grads[2],
        ]
    elif need_grad and not (tp.tp_group and isinstance(v, int) and v == 0):
        kept = fake_kept(x, weight, tp.tp_group, tp.vocab_size, lambda n, v, h: impl.kept_shapes(plan(), n))
    return (
        loss,
        x.new_empty(n, dtype=sd),
        x.new_empty(n if need_argmax else 0, dtype=torch.int64),
        x.new_empty(n, dtype=sd),
        *kept,
        None,  # the plan (the scaffolding's fixed-size tensor)
        *grads,
    )


def _backward(grad_loss, grad_lse, x, weight, bias, target, class_weight, lse, w_t, keep, keep_max, plan,
              opts: CrossEntropyOptions, backend: str, budget: int, need_dx: bool, need_dw: bool, need_db: bool,
              tp: VocabParallelOptions):
    """dx, dw, db (size 0 where not needed). Overwrites ``keep`` (when not empty) with dz.
    ``plan``: the forward's (the object: the scaffolding decoded it)."""
    n, v = x.shape[0], weight.shape[0]
    dx = dw = db = None
    if n == 0:
        dx, dw, db = zero_grads(x, weight, bias)
    elif need_dx or need_dw or need_db:
        impl = load_backend(__package__, backend)
        kept = kept_buffers(plan, keep, keep_max)  # the forward's buffers, laid out by its plan
        with no_autocast(x.device):
            if tp.parallel:
                from . import vocab_parallel

                dx, dw, db = vocab_parallel.backward(
                    impl, grad_loss, grad_lse, x, weight, bias, target, class_weight, lse, w_t, opts, tp,
                    budget=budget, need_dx=need_dx, need_dw=need_dw, need_db=need_db, plan=plan, kept=kept)
            else:
                coef = impl.grad_coefficients(grad_loss, grad_lse, lse, w_t, target, class_weight, opts, v)
                dx, dw, db = impl.backward(
                    x, weight, bias, target, class_weight, opts.softcap, lse, coef,
                    need_dx=need_dx, need_dw=need_dw, need_db=need_db, budget=budget, plan=plan, kept=kept,
                )
    return grad_outputs(x, dx, dw, db, need_dx, need_dw, need_db)


def _backward_fake(grad_loss, grad_lse, x, weight, bias, target, class_weight, lse, w_t, keep, keep_max, plan,
                   opts, backend, budget, need_dx, need_dw, need_db, tp):
    return fake_grad_outputs(x, weight, bias, need_dx, need_dw, need_db)


def _zero_grad_loss(a: dict) -> Tensor:
    """The gradient of a loss that got none (gradients are not materialised)."""
    lse = a["lse"]
    return torch.zeros(lse.shape if a["opts"].reduction == "none" else (), dtype=lse.dtype, device=lse.device)


_HEAD = (tensor("x"), tensor("weight"), tensor("bias", True), tensor("target"), tensor("class_weight", True))
_EXEC = (scalar("backend", str), scalar("budget", int))
_NEED = (scalar("need_dx", bool), scalar("need_dw", bool), scalar("need_db", bool))
_KEPT = ("keep", "keep_max")
_TP = options("tp", VocabParallelOptions, defaulted=True)

SPEC = OpSpec(
    op=OP,
    name="lce_forward",
    forward=(*_HEAD, options("opts", CrossEntropyOptions), *_EXEC, scalar("need_argmax", bool),
             scalar("need_grad", bool), scalar("grad_in_forward", bool), *_NEED, _TP),
    outputs=("loss", "lse", "argmax", "w_t", *_KEPT, "plan", "gx", "gw", "gb"),
    forward_impl=_forward,
    forward_fake=_forward_fake,
    backward_name="lce_backward",
    backward=(tensor("grad_loss"), tensor("grad_lse", True), *_HEAD, tensor("lse"), tensor("w_t"),
              *(tensor(k) for k in _KEPT), tensor("plan"), options("opts", CrossEntropyOptions), *_EXEC, *_NEED,
              _TP),
    backward_impl=_backward,
    backward_fake=_backward_fake,
    grads=("grad_loss", "grad_lse") + (None,) * 8,
    grad_inputs=("x", "weight", "bias"),
    need={"need_dx": "x", "need_dw": "weight", "need_db": "bias"},
    mutates=("keep",),
    # Not saved tensors: the first backward consumes them (in place) and drops them.
    consumed=_KEPT,
    nothing=nothing_kept,
    forward_grads=("gx", "gw", "gb"),
    forward_grads_when="grad_in_forward",
    zero_if_none={"grad_loss": _zero_grad_loss},
    plan_cls=LinearPlan,
)

_built = build(SPEC)
lce_forward, lce_backward = _built.forward_op, _built.backward_op
#: What the public function calls: ``lce_forward``, through a plain autograd.Function in eager mode.
lce_forward_eager = _built.eager
