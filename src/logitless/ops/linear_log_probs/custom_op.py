"""The torch.library custom ops of linear_log_probs: what autograd and torch.compile see.

    logitless::llp_forward(x, weight, bias, tokens, <options>, backend, budget, need_grad,
                           <vocab parallel>)
        -> logp, entropy ((0,) without entropy), lse, keep, keep_max, plan
    logitless::llp_backward(grad_logp, grad_entropy, x, weight, bias, tokens, lse, entropy,
                            keep (overwritten with dz), keep_max, plan, <options>, backend,
                            budget, need_dx, need_dw, need_db, <vocab parallel>) -> dx, dw, db

``<options>`` are the fields of ``LogProbOptions`` under their own names (temperature,
entropy, softcap, ignore_index); ``<vocab parallel>`` those of ``VocabParallelOptions``
(tp_group, vocab_size, partial_dx), defaulted named arguments: with a ``tp_group`` the
weight is this rank's block of rows of a vocab-parallel head and the ops merge the
statistics over the group (``vocab_parallel``); the fakes take them by name with the
same defaults (inductor drops defaulted arguments from the calls it emits).
``plan`` is the call's plan, made once by the forward's implementation (the backend's
``plan``: a ``planning.plans.LinearPlan``, or None; carried as a CPU int64 tensor
across the custom ops by the scaffolding, ``ops.common.plan_codec``, an object for the
backward); ``keep``/``keep_max`` the columns of exp(a - m) the Triton backend kept for
the backward, laid out by that plan (``NOTHING_KEPT``-shaped dummies when none): the
first backward consumes them in place, a second one (retain_graph=True) recomputes. Implementations run
eagerly (also under torch.compile,
which sees only the fakes), so the CPU token-range check (``validate.check_targets_in_range``) lives in
them. The ops, their fakes and autograd are built from ``SPEC`` (``ops.common.spec``).
Double backward raises.
"""

from __future__ import annotations

from torch import Tensor

from logitless.formulas.common import compute_dtype
from logitless.ops.common.autocast import disabled as no_autocast
from logitless.ops.common.autograd import fake_grad_outputs, grad_outputs, zero_grads
from logitless.ops.common.dispatch import load_backend
from logitless.ops.common.kept import fake_kept, fake_kept_tensors, kept_buffers, nothing_kept
from logitless.ops.common.spec import OpSpec, build, options, scalar, tensor
from logitless.ops.common.validate import check_targets_in_range
from logitless.options import LogProbOptions, VocabParallelOptions
from logitless.planning.plans import LinearPlan

OP = "linear_log_probs"


def _forward(x: Tensor, weight: Tensor, bias, tokens: Tensor, opts: LogProbOptions, backend: str, budget: int,
             need_grad: bool, tp: VocabParallelOptions):
    """x (N, H), weight (V, H), tokens (N,) int64 -> logp (N,), entropy (N,) or (0,),
    lse (N,), keep, keep_max, plan (the object: the scaffolding encodes it where the
    custom op runs)."""
    n, v = x.shape[0], weight.shape[0]
    sd = compute_dtype(x.dtype)
    kept = plan = None
    if not tp.parallel:
        check_targets_in_range(tokens, v, opts.ignore_index, name="tokens")
    impl = load_backend(__package__, backend)
    with no_autocast(x.device):
        if tp.parallel:
            from . import vocab_parallel

            logp, ent, lse, kept, plan = vocab_parallel.forward(impl, x, weight, bias, tokens, opts, tp,
                                                                budget=budget, need_grad=need_grad)
        elif n == 0:
            logp, lse = x.new_empty(0, dtype=sd), x.new_empty(0, dtype=sd)
            ent = x.new_empty(0, dtype=sd) if opts.entropy else None
        else:  # the merge and token_outputs (Triton: one launch, log_probs_epilogue)
            plan = impl.plan(x, weight, bias, opts, budget=budget, need_grad=need_grad)  # once per call
            (logp, ent, lse), kept = impl.forward(x, weight, bias, tokens, opts, budget=budget, plan=plan,
                                                  outputs=True)
    ent = ent.to(sd) if ent is not None else x.new_empty(0, dtype=sd)
    if kept is None:
        kept = nothing_kept(x)
    return logp.to(sd), ent, lse.to(sd), kept[0], kept[1], plan


def _forward_fake(x, weight, bias, tokens, opts, backend, budget, need_grad, tp):
    n = x.shape[0]
    sd = compute_dtype(x.dtype)
    kept = fake_kept_tensors(x)
    if need_grad:
        impl = load_backend(__package__, backend)
        kept = fake_kept(x, weight, tp.tp_group, tp.vocab_size, lambda n, v, h: impl.kept_shapes(
            impl.plan(x, weight, bias, opts, budget=budget, need_grad=need_grad, cute=False), n))
    return (
        x.new_empty(n, dtype=sd),
        x.new_empty(n if opts.entropy else 0, dtype=sd),
        x.new_empty(n, dtype=sd),
        *kept,
        None,  # the plan (the scaffolding's fixed-size tensor)
    )


def _backward(grad_logp, grad_entropy, x, weight, bias, tokens, lse, entropy_out, keep, keep_max, plan,
              opts: LogProbOptions, backend: str, budget: int, need_dx: bool, need_dw: bool, need_db: bool,
              tp: VocabParallelOptions):
    """dx, dw, db (size 0 where not needed). Overwrites ``keep`` (when not empty) with dz.
    ``plan``: the forward's (the object: the scaffolding decoded it)."""
    n, v = x.shape[0], weight.shape[0]
    dx = dw = db = None
    if n == 0:
        dx, dw, db = zero_grads(x, weight, bias)
    elif need_dx or need_dw or need_db:
        with no_autocast(x.device):
            impl = load_backend(__package__, backend)
            kept = kept_buffers(plan, keep, keep_max)  # the forward's buffers, laid out by its plan
            if tp.parallel:
                from . import vocab_parallel

                dx, dw, db = vocab_parallel.backward(
                    impl, grad_logp, grad_entropy, x, weight, bias, tokens, lse, entropy_out, opts, tp,
                    budget=budget, need_dx=need_dx, need_dw=need_dw, need_db=need_db, plan=plan, kept=kept)
            else:
                coef = impl.grad_coefficients(entropy_out if opts.entropy else None, tokens, grad_logp,
                                              grad_entropy if opts.entropy else None, v, opts, lse)
                dx, dw, db = impl.backward(x, weight, bias, tokens, opts, lse, coef, need_dx=need_dx,
                                           need_dw=need_dw, need_db=need_db, budget=budget, plan=plan, kept=kept)
    return grad_outputs(x, dx, dw, db, need_dx, need_dw, need_db)


def _backward_fake(grad_logp, grad_entropy, x, weight, bias, tokens, lse, entropy_out, keep, keep_max, plan,
                   opts, backend, budget, need_dx, need_dw, need_db, tp):
    return fake_grad_outputs(x, weight, bias, need_dx, need_dw, need_db)


_HEAD = (tensor("x"), tensor("weight"), tensor("bias", True), tensor("tokens"))
_EXEC = (scalar("backend", str), scalar("budget", int))
_KEPT = ("keep", "keep_max")
_NEED = (scalar("need_dx", bool), scalar("need_dw", bool), scalar("need_db", bool))

SPEC = OpSpec(
    op=OP,
    name="llp_forward",
    forward=(*_HEAD, options("opts", LogProbOptions), *_EXEC, scalar("need_grad", bool),
             options("tp", VocabParallelOptions, defaulted=True)),
    outputs=("logp", "entropy_out", "lse", *_KEPT, "plan"),
    forward_impl=_forward,
    forward_fake=_forward_fake,
    backward_name="llp_backward",
    backward=(tensor("grad_logp", True), tensor("grad_entropy", True), *_HEAD, tensor("lse"), tensor("entropy_out"),
              *(tensor(k) for k in _KEPT), tensor("plan"), options("opts", LogProbOptions), *_EXEC, *_NEED,
              options("tp", VocabParallelOptions, defaulted=True)),
    backward_impl=_backward,
    backward_fake=_backward_fake,
    grads=("grad_logp", "grad_entropy", None, None, None, None),
    grad_inputs=("x", "weight", "bias"),
    need={"need_dx": "x", "need_dw": "weight", "need_db": "bias"},
    mutates=("keep",),
    consumed=_KEPT,  # not saved: the first backward consumes them in place
    nothing=nothing_kept,
    skip_if_no_grads=True,
    plan_cls=LinearPlan,
)

_built = build(SPEC)
llp_forward, llp_backward = _built.forward_op, _built.backward_op
#: What the public function calls: ``llp_forward``, through a plain autograd.Function in eager mode.
llp_forward_eager = _built.eager
