"""The bodies of linear_log_probs' custom ops (``logitless::llp_forward`` and ``llp_backward``),
written against the declared calls of ``contract`` (``LlpCall`` -> ``LlpOutputs``,
``LlpBackwardCall`` -> dx, dw, db); ``ops.common.glue.CustomOp`` derives the schemas, the
flattening and the autograd wiring from those declarations.

The forward plans the call ONCE (``_plan``: the backend's frozen Config, with the
truncation's decisions in it, ``contract.Truncated``, all from the call's arguments); the
forward, the fake's kept shapes and the backward follow that Config: the object on the
eager path; through the custom ops the backward op plans it again from the same
arguments (``replan``, ``contract.LlpPlanned``: the memoised planners return the
forward's object), so no Config crosses them and both may run inside a CUDA graph.
``keep``/``keep_max``: the columns of exp(a - m) the forward kept (``NOTHING_KEPT``-shaped
dummies when none); the backward turns them into dz (over themselves after an eager
forward, ``glue.Owned``; through the custom ops into a new buffer), and they serve the first
backward only (a second one, retain_graph=True, recomputes). A
truncated or batch-invariant call (``top_k`` or ``block``) runs ``truncation``'s forward and
backward; ``tau``, ``sparse``, ``inside`` carry what its backward needs (fixed shapes). With
``tp.tp_group`` the weight is this rank's block of rows of a vocab-parallel head
(``vocab_parallel``). Implementations run eagerly (also under torch.compile, which sees
only the fakes), so the CPU token-range check (``validate.check_targets_in_range``) and
the read of the largest top_k (a host sync, when the caller did not give it and no CUDA
graph is being captured) live in them. Double backward raises.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor

from logitless.formulas.common import compute_dtype
from logitless.formulas.truncation import Truncation, syncs_allowed
from logitless.ops.common.autocast import disabled as no_autocast
from logitless.ops.common.contract import BackendTable, Needs
from logitless.ops.common.glue import CustomOp, Owned, fake_grad_outputs
from logitless.ops.common.kept import Kept, fake_kept, fake_kept_tensors, linear_backward, nothing_kept, take_kept
from logitless.ops.common.validate import check_targets_in_range

from .contract import (
    LlpBackend,
    LlpBackwardCall,
    LlpCall,
    LlpOutputs,
    LlpPlanned,
    may_keep,
    sparse_width,
    tensor_k_max,
)

#: The custom ops: logitless::llp_forward, logitless::llp_backward.
NAME = "llp"
OP = "linear_log_probs"


def forward(call: LlpCall, impl: LlpBackend) -> LlpOutputs:
    """The forward op's outputs (``contract.LlpOutputs``), ``config`` as the object."""
    if call.top_k is not None or call.block:
        return _truncated_forward(call, impl)
    x, weight, bias, tokens, opts = call.x, call.weight, call.bias, call.tokens, call.opts
    config = kept = None
    with no_autocast(x.device):
        if call.tp.tp_group:
            from . import vocab_parallel

            config = _plan(impl, call, planned(call))
            logp, ent, lse, kept = vocab_parallel.forward(impl, x, weight, bias, tokens, opts, call.tp, config)
        else:
            check_targets_in_range(tokens, weight.shape[0], opts.ignore_index, name="tokens")
            if x.shape[0] == 0:
                sd = compute_dtype(x.dtype)
                logp, lse = x.new_empty(0, dtype=sd), x.new_empty(0, dtype=sd)
                ent = x.new_empty(0, dtype=sd) if opts.entropy else None
            else:  # the merge and token_outputs (Triton: one launch, log_probs_epilogue)
                config = _plan(impl, call, planned(call))
                (logp, ent, lse), kept = impl.forward(x, weight, bias, tokens, opts, config)
    return _outputs(x, logp, ent, lse, kept, config)


def planned(call: LlpCall) -> LlpPlanned:
    """The scalars ``call``'s Config is planned from (the backward op's too)."""
    return LlpPlanned(call.budget, call.need_grad, call.need_dw, call.top_k is not None, call.k_max, call.block)


def _plan(impl: LlpBackend, c: LlpCall | LlpBackwardCall, p: LlpPlanned) -> Any:
    """The backend's Config of the call ``c`` (the forward's, or ``replan``'s), None on no
    tokens (nothing runs): ``vocab_parallel.plan``'s over a vocab-parallel head (also None
    for a rank without real rows)."""
    if c.x.shape[0] == 0:
        return None
    kw: dict[str, Any] = dict(budget=p.budget, need_grad=p.need_grad, need_dw=p.dw, kept_owned=c.owned)
    if p.truncated or p.block:
        kw.update(truncated=p.truncated, k_max=p.k_max, block=p.block)
    if c.tp.tp_group:
        from . import vocab_parallel

        return vocab_parallel.plan(impl, c.x, c.weight, c.bias, c.opts, c.tp, **kw)
    return impl.plan(c.x, c.weight, c.bias, c.opts, **kw)


def replan(b: LlpBackwardCall, impl: LlpBackend) -> Any:
    """The Config the forward of ``b`` planned, planned again from the same inputs (the
    backward custom op's; the planners are memoised: the forward's object)."""
    with no_autocast(b.x.device):
        return _plan(impl, b, b.planned)


def _outputs(x: Tensor, logp, ent, lse, kept, config, tau=None, sparse=None, inside=None) -> LlpOutputs:
    """``LlpOutputs`` from the results (the kept columns' dummies when none)."""
    sd = torch.float64 if x.dtype == torch.float64 else torch.float32  # (formulas.common.compute_dtype)
    keep, keep_max = kept if kept is not None else nothing_kept(x)
    return LlpOutputs(logp.to(sd), ent.to(sd) if ent is not None else None, lse.to(sd), keep, keep_max, config,
                      tau, sparse, inside)


def _truncated_forward(call: LlpCall, impl: LlpBackend) -> LlpOutputs:
    """``forward`` of a truncated or batch-invariant call: the largest top_k (read here, a
    host sync, when the caller did not), the Config with its ``Truncated`` decisions, then
    ``truncation.forward`` (over a vocab-parallel head through ``vocab_parallel.ShardedBackend``)."""
    from . import truncation

    x, weight, bias, tokens, opts = call.x, call.weight, call.bias, call.tokens, call.opts
    trunc = None
    if call.top_k is not None:
        k_max = call.k_max
        if k_max < 0 and x.shape[0] and syncs_allowed(x.device):  # (compiled: eager calls read it before the op)
            k_max = tensor_k_max(call.top_k, call.block)
        assert call.top_p is not None and call.min_p is not None  # (given with top_k: ``api``)
        trunc = Truncation(call.top_k, call.top_p, call.min_p, k_max if k_max >= 0 else None, call.checked)
    sharded = None
    with no_autocast(x.device):
        config = _plan(impl, call, planned(call))  # once per call
        if call.tp.tp_group:
            from . import vocab_parallel

            sharded = vocab_parallel.ShardedBackend(impl, call.tp, weight, x.device, bool(call.block))
        if config is None:  # (no tokens: nothing to plan, nothing runs)
            check_targets_in_range(tokens, weight.shape[0], opts.ignore_index, name="tokens")
            width = sparse_width(impl, weight.shape[0], call.k_max, call.need_grad, trunc is not None,
                                 bool(call.tp.tp_group))
            sd = compute_dtype(x.dtype)
            empty = [x.new_empty(0, dtype=sd) for _ in range(4)]
            return _outputs(x, empty[0], empty[1] if opts.entropy else None, empty[2], None, None, empty[3],
                            tokens.new_empty((2, 0, width), dtype=torch.int32), tokens.new_empty(0, dtype=torch.bool))
        logp, ent, lse, tau, sparse, kept = truncation.forward(impl, x, weight, bias, tokens, trunc, opts, config,
                                                               call.budget, sharded)
    return _outputs(x, logp, ent, lse, kept, config, tau, *sparse)


def fake(call: LlpCall, impl: LlpBackend) -> LlpOutputs:
    """Shapes and dtypes; the kept columns' shapes from a Config planned as the forward
    would (concrete sizes only); the truncated outputs' from the call alone."""
    x, weight, tokens, opts = call.x, call.weight, call.tokens, call.opts
    n = x.shape[0]
    sd = compute_dtype(x.dtype)
    truncated, blocked, parallel = call.top_k is not None, bool(call.block), bool(call.tp.tp_group)
    kept = fake_kept_tensors(x)
    keeps = call.need_grad
    if truncated or blocked:
        keeps = may_keep(impl, call.k_max, call.block, call.need_grad, truncated, opts.softcap, parallel)
    if keeps:
        kept = fake_kept(x, weight, call.tp.tp_group, call.tp.vocab_size, lambda n, v, h: impl.kept_shapes(
            impl.plan(x, weight, call.bias, opts, budget=call.budget, need_grad=True, need_dw=call.need_dw,
                      cute=False, kept_owned=call.owned), n))
    tau = sparse = inside = None
    if truncated or blocked:
        width = sparse_width(impl, weight.shape[0], call.k_max, call.need_grad, truncated, parallel)
        rows, sparse_shape = (n, (2, n, width)) if width else (0, (2, 0, 0))
        tau = x.new_empty(n if truncated else 0, dtype=sd)
        sparse = tokens.new_empty(sparse_shape, dtype=torch.int32)
        inside = tokens.new_empty(rows, dtype=torch.bool)
    return LlpOutputs(x.new_empty(n, dtype=sd), x.new_empty(n, dtype=sd) if opts.entropy else None,
                      x.new_empty(n, dtype=sd), *kept, None, tau, sparse, inside)


def save(ctx, call: LlpCall, out: LlpOutputs) -> None:
    """Saved: x, weight, bias, tokens, lse, entropy and, truncated, logp, tau and the sparse
    backward's candidates. On ctx: the options and execution fields the backward reads,
    the Config, the kept columns (the first backward's)."""
    ctx.truncated = call.top_k is not None or bool(call.block)
    if ctx.truncated:
        ctx.save_for_backward(call.x, call.weight, call.bias, call.tokens, out.lse, out.entropy, out.logp, out.tau,
                              out.sparse, out.inside)
    else:
        ctx.save_for_backward(call.x, call.weight, call.bias, call.tokens, out.lse, out.entropy)
    ctx.opts, ctx.backend, ctx.tp = call.opts, call.backend, call.tp
    ctx.config, ctx.planned = out.config, planned(call)
    ctx.kept = (out.keep, out.keep_max)
    frozen = [out.lse, out.keep, out.keep_max]
    if out.tau is not None and out.sparse is not None and out.inside is not None:
        # (truncated; through the custom ops, always: size 0 where absent)
        frozen += [out.tau, out.sparse, out.inside]
    ctx.mark_non_differentiable(*frozen)
    ctx.set_materialize_grads(False)


def backward(ctx, grads: LlpOutputs, need, run) -> tuple:
    """(dx, dw, db): the backward op (``run``) on the saved tensors and the forward's Config."""
    x, weight, bias, tokens, lse, ent, *trunc = ctx.saved_tensors
    keep, keep_max = take_kept(ctx, x)
    grad_logp: Optional[Tensor] = grads.logp  # (None: not materialised)
    if grad_logp is None and grads.entropy is None:
        return None, None, None
    logp, tau, sparse, inside = trunc or (None, None, None, None)
    return run(LlpBackwardCall(grad_logp, grads.entropy, x, weight, bias, tokens, lse, ent, keep, keep_max,
                               ctx.config, ctx.opts, ctx.backend, Needs(need.x, need.weight, need.bias), logp, tau,
                               sparse, inside, ctx.tp, ctx.planned, Owned(ctx.eager)))


def backward_impl(b: LlpBackwardCall, impl: LlpBackend):
    """dx, dw, db (size 0 where not needed). Overwrites ``keep`` (when not a dummy) with dz."""
    x, weight, bias, need, opts = b.x, b.weight, b.bias, b.need, b.opts

    def grads(config, kept: Optional[Kept]):
        with no_autocast(x.device):
            if getattr(config, "trunc", None) is not None:
                from . import truncation

                sharded = None
                if b.tp.tp_group:
                    from . import vocab_parallel

                    sharded = vocab_parallel.ShardedBackend(impl, b.tp, weight, x.device, False)
                v = sharded.vocab_size if sharded is not None else weight.shape[0]
                # (a truncated forward's outputs: present)
                assert b.logp is not None and b.tau is not None and b.sparse is not None and b.inside is not None
                return truncation.backward(sharded if sharded is not None else impl, b.grad_logp, b.grad_entropy, x,
                                           weight, bias, b.tokens, b.lse, b.entropy_out, b.logp, b.tau, b.sparse,
                                           b.inside, kept, opts, config, need.need_dx, need.need_dw, need.need_db, v)
            if b.tp.tp_group:
                from . import vocab_parallel

                return vocab_parallel.backward(impl, b.grad_logp, b.grad_entropy, x, weight, bias, b.tokens, b.lse,
                                               b.entropy_out, opts, b.tp, config, need_dx=need.need_dx,
                                               need_dw=need.need_dw, need_db=need.need_db, kept=kept)
            coef = impl.grad_coefficients(b.entropy_out if opts.entropy else None, b.tokens, b.grad_logp,
                                          b.grad_entropy if opts.entropy else None, weight.shape[0], opts, b.lse)
            return impl.backward(x, weight, bias, b.tokens, opts, b.lse, coef, config, kept=kept,
                                 need_dx=need.need_dx, need_dw=need.need_dw, need_db=need.need_db)

    return linear_backward(b, grads)


def backward_fake(b: LlpBackwardCall, impl: LlpBackend):
    return fake_grad_outputs(b.x, b.weight, b.bias, b.need.need_dx, b.need.need_dw, b.need.need_db)


def define(backends: BackendTable[LlpBackend], *, name: str = NAME,
           tags: tuple = ()) -> CustomOp[LlpCall, LlpOutputs, LlpBackwardCall, LlpBackend]:
    """The custom-op pair over the table of backends ``backends`` (``api.BACKENDS``);
    ``tags``: torch.library's (``glue.HOST_SYNCS`` for the truncated calls' pair)."""
    return CustomOp(name, LlpCall, LlpOutputs, LlpBackwardCall, table=backends, forward=forward, fake=fake,
                    save=save, backward=backward, backward_impl=backward_impl, backward_fake=backward_fake, title=OP,
                    replan=replan, tags=tags)
