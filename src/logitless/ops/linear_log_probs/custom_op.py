"""The torch.library custom ops of linear_log_probs: what autograd and torch.compile see.

    logitless::llp_forward(x, weight, bias, tokens, <options>, backend, budget, need_grad,
                           need_dw, <truncation>, <vocab parallel>)
        -> logp, entropy ((0,) without entropy), lse, keep, keep_max, config, tau, sparse, inside
    logitless::llp_backward(grad_logp, grad_entropy, x, weight, bias, tokens, lse, entropy,
                            keep (overwritten with dz), keep_max, config, <options>, backend,
                            budget, need_dx, need_dw, need_db, logp, tau, sparse, inside,
                            <vocab parallel>) -> dx, dw, db

(the schemas, written out: ``FORWARD_SCHEMA``, ``BACKWARD_SCHEMA``). ``<options>`` are the
fields of ``LogProbOptions`` (temperature, entropy, softcap, ignore_index); ``<truncation>``
the per-token top_k, top_p, min_p ((N,) each, or None), k_max (the largest top_k when read
on the host, -1 when not) and block (rows per block under ``batch_invariant``, 0: none),
defaulted: a call with neither truncation nor block is the default one; ``<vocab
parallel>`` the fields of ``VocabParallelOptions`` (tp_group, vocab_size, partial_dx): with
a ``tp_group`` the weight is this rank's block of rows of a vocab-parallel head
(``vocab_parallel``). ``backend`` names an entry of the table ``api.BACKENDS`` (given here
by ``use_backends``), an ``LlpBackend`` (``contract``).

The forward plans the call ONCE (``backend.plan``: the backend's frozen Config, with the
truncation's decisions in it, ``contract.Truncated``); the forward, the fake's kept shapes
and the backward follow that Config. ``config`` is the object on the eager fast path and
the backend's encoding (``backend.codec``: a CPU int64 tensor) through the custom ops.
``keep``/``keep_max``: the columns of exp(a - m) the forward kept (``NOTHING_KEPT``-shaped
dummies when none); the backward turns them into dz in place (declared as a mutation), so
they serve the first backward only (a second one, retain_graph=True, recomputes).
``tau``, ``sparse``, ``inside``: the truncated forward's per-token thresholds and the sparse
backward's candidates (``truncation``: (2, N, W) int32, the candidates' fp32 bits and their
columns, one tensor) and rows; fixed shapes, size 0 when not used.
Implementations run eagerly (also under torch.compile, which sees only the fakes), so the
CPU token-range check (``validate.check_targets_in_range``) lives in them. Double backward
raises.

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
from logitless.ops.common.autocast import disabled as no_autocast
from logitless.ops.common.autograd import (
    custom_op,
    fake_grad_outputs,
    grad_outputs,
    guard_double_backward,
    zero_grads,
)
from logitless.ops.common.contract import register_autograd
from logitless.ops.common.kept import NOTHING_KEPT, fake_kept, fake_kept_tensors, nothing_kept
from logitless.ops.common.validate import check_targets_in_range
from logitless.options import LogProbOptions, VocabParallelOptions

from .contract import LlpBackend, may_keep, sparse_width

OP = "linear_log_probs"

OPTIONS_SCHEMA = "float temperature, bool entropy, float? softcap, SymInt ignore_index"
TP_SCHEMA = 'str tp_group="", SymInt vocab_size=-1, bool partial_dx=False'
FORWARD_SCHEMA = (
    f"(Tensor x, Tensor weight, Tensor? bias, Tensor tokens, {OPTIONS_SCHEMA}, str backend, SymInt budget, "
    "bool need_grad, bool need_dw=True, Tensor? top_k=None, Tensor? top_p=None, Tensor? min_p=None, "
    f"SymInt k_max=-1, SymInt block=0, {TP_SCHEMA}) "
    "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)"
)
BACKWARD_SCHEMA = (
    "(Tensor? grad_logp, Tensor? grad_entropy, Tensor x, Tensor weight, Tensor? bias, Tensor tokens, Tensor lse, "
    f"Tensor entropy_out, Tensor(a8!) keep, Tensor keep_max, Tensor config, {OPTIONS_SCHEMA}, str backend, "
    "SymInt budget, bool need_dx, bool need_dw, bool need_db, Tensor? logp=None, Tensor? tau=None, "
    f"Tensor? sparse=None, Tensor? inside=None, {TP_SCHEMA}) -> (Tensor, Tensor, Tensor)"
)
#: The forward's arguments: 11, then the defaulted need_dw, <truncation> and <vocab parallel>.
_NUM_INPUTS = 20
_DEFAULTS = (True, None, None, None, -1, 0, "", -1, False)

#: backend name -> LlpBackend: ``api.BACKENDS``, given once at import (``use_backends``).
BACKENDS: Mapping[str, LlpBackend] = {}


def use_backends(table: Mapping[str, LlpBackend]) -> None:
    """The table of backends the custom ops run (``api.BACKENDS``)."""
    global BACKENDS
    BACKENDS = table


def _forward(x: Tensor, weight: Tensor, bias: Optional[Tensor], tokens: Tensor, temperature: float, entropy: bool,
             softcap: Optional[float], ignore_index: int, backend: str, budget: int, need_grad: bool,
             need_dw: bool = True, top_k: Optional[Tensor] = None, top_p: Optional[Tensor] = None,
             min_p: Optional[Tensor] = None, k_max: int = -1, block: int = 0, tp_group: str = "",
             vocab_size: int = -1, partial_dx: bool = False, *, distinct: bool = False):
    """x (N, H), weight (V, H), tokens (N,) int64 -> the forward op's outputs (module
    docstring), ``config`` as the object; ``distinct``: the absent outputs distinct tensors of
    the fake's dtypes (the custom op's), else one size-0 tensor (the eager fast path's: nobody
    reads them)."""
    opts = LogProbOptions(temperature, entropy, softcap, ignore_index)
    impl = BACKENDS[backend]
    n = x.shape[0]
    sd = compute_dtype(x.dtype)
    config = kept = None
    if top_k is not None or block:
        from . import truncation

        trunc = None
        if top_k is not None:
            from logitless.formulas.truncation import Truncation

            trunc = Truncation(top_k, top_p, min_p, k_max if k_max >= 0 else None)
        plan = dict(budget=budget, need_grad=need_grad, need_dw=need_dw, trunc=trunc, k_max=k_max, block=block)
        with no_autocast(x.device):
            sharded = None
            if tp_group:
                from . import vocab_parallel

                tp = VocabParallelOptions(tp_group, vocab_size, partial_dx)
                config = vocab_parallel.plan(impl, x, weight, bias, opts, tp, **plan) if n else None
                sharded = vocab_parallel.ShardedBackend(impl, tp, weight, x.device, bool(block))
            elif n:
                config = impl.plan(x, weight, bias, opts, **plan)  # once per call
            if config is None:  # (no tokens: nothing to plan, nothing runs)
                check_targets_in_range(tokens, weight.shape[0], ignore_index, name="tokens")
                width = sparse_width(backend, weight.shape[0], k_max, need_grad, trunc is not None, bool(tp_group))
                empty = [x.new_empty(0, dtype=sd) for _ in range(4)]
                return _outputs(x, tokens, empty[0], empty[1] if entropy else None, empty[2], None, None, True,
                                empty[3], tokens.new_empty((2, 0, width), dtype=torch.int32),
                                tokens.new_empty(0, dtype=torch.bool))
            logp, ent, lse, tau, sparse, kept = truncation.forward(impl, x, weight, bias, tokens, trunc, opts,
                                                                   config, budget, sharded)
        return _outputs(x, tokens, logp, ent, lse, kept, config, distinct, tau, *sparse)
    with no_autocast(x.device):
        if tp_group:
            from . import vocab_parallel

            tp = VocabParallelOptions(tp_group, vocab_size, partial_dx)
            config = vocab_parallel.plan(impl, x, weight, bias, opts, tp, budget=budget, need_grad=need_grad,
                                         need_dw=need_dw)
            logp, ent, lse, kept = vocab_parallel.forward(impl, x, weight, bias, tokens, opts, tp, config)
        else:
            check_targets_in_range(tokens, weight.shape[0], ignore_index, name="tokens")
            if n == 0:
                logp, lse = x.new_empty(0, dtype=sd), x.new_empty(0, dtype=sd)
                ent = x.new_empty(0, dtype=sd) if entropy else None
            else:  # the merge and token_outputs (Triton: one launch, log_probs_epilogue)
                config = impl.plan(x, weight, bias, opts, budget=budget, need_grad=need_grad, need_dw=need_dw)
                (logp, ent, lse), kept = impl.forward(x, weight, bias, tokens, opts, config)
    return _outputs(x, tokens, logp, ent, lse, kept, config, distinct)


def _outputs(x, tokens, logp, ent, lse, kept, config, distinct, tau=None, sparse=None, inside=None):
    """The forward op's outputs (module docstring) from its results; the absent ones as
    ``_forward``'s ``distinct`` says."""
    sd = compute_dtype(x.dtype)
    if kept is None:
        kept = nothing_kept(x)
    if distinct:
        ent = ent if ent is not None else x.new_empty(0, dtype=sd)
        if sparse is None:
            tau, sparse = x.new_empty(0, dtype=sd), tokens.new_empty((2, 0, 0), dtype=torch.int32)
            inside = tokens.new_empty(0, dtype=torch.bool)
    spare = x.new_empty(0, dtype=sd) if ent is None or sparse is None else None
    if sparse is None:
        tau, sparse, inside = spare, spare, spare
    return (logp.to(sd), ent.to(sd) if ent is not None else spare, lse.to(sd), kept[0], kept[1], config, tau,
            sparse, inside)


def _forward_op(*args):
    """The custom op's implementation: ``_forward`` with the Config encoded by its backend."""
    out = _forward(*args, distinct=True)
    return (*out[:5], BACKENDS[args[8]].codec.encode(out[5]), *out[6:])


def _forward_fake(x, weight, bias, tokens, temperature, entropy, softcap, ignore_index, backend, budget, need_grad,
                  need_dw=True, top_k=None, top_p=None, min_p=None, k_max=-1, block=0, tp_group="", vocab_size=-1,
                  partial_dx=False):
    """Shapes and dtypes; the kept columns' shapes from a Config planned as the forward
    would (concrete sizes only); the truncated outputs' from the arguments alone."""

    n = x.shape[0]
    sd = compute_dtype(x.dtype)
    impl = BACKENDS[backend]
    opts = LogProbOptions(temperature, entropy, softcap, ignore_index)
    kept = fake_kept_tensors(x)
    truncated, parallel = top_k is not None, bool(tp_group)
    keeps = need_grad
    if truncated or block:
        keeps = may_keep(backend, k_max, block, need_grad, truncated, softcap, parallel)
    if keeps:
        kept = fake_kept(x, weight, tp_group, vocab_size, lambda n, v, h: impl.kept_shapes(
            impl.plan(x, weight, bias, opts, budget=budget, need_grad=True, need_dw=need_dw, cute=False), n))
    width = sparse_width(backend, weight.shape[0], k_max, need_grad, truncated, parallel)
    rows, sparse_shape = (n, (2, n, width)) if width else (0, (2, 0, 0))
    return (x.new_empty(n, dtype=sd), x.new_empty(n if entropy else 0, dtype=sd), x.new_empty(n, dtype=sd), *kept,
            impl.codec.fake(), x.new_empty(n if truncated else 0, dtype=sd),
            tokens.new_empty(sparse_shape, dtype=torch.int32), tokens.new_empty(rows, dtype=torch.bool))


def _backward_impl(grad_logp, grad_entropy, x, weight, bias, tokens, lse, entropy_out, keep, keep_max, config,
                   temperature, entropy, softcap, ignore_index, backend, budget, need_dx, need_dw, need_db,
                   logp=None, tau=None, sparse=None, inside=None, tp_group="", vocab_size=-1,
                   partial_dx=False):
    """dx, dw, db (size 0 where not needed). Overwrites ``keep`` (when not a dummy) with dz.
    ``config``: the forward's (the object, or its encoding)."""
    dx = dw = db = None
    if x.shape[0] == 0:
        dx, dw, db = zero_grads(x, weight, bias)
    elif need_dx or need_dw or need_db:
        impl = BACKENDS[backend]
        if isinstance(config, Tensor):  # (the eager fast path hands the object itself)
            config = impl.codec.decode(config)
        kept = None if keep.shape == NOTHING_KEPT else (keep, keep_max)
        opts = LogProbOptions(temperature, entropy, softcap, ignore_index)
        tp = VocabParallelOptions(tp_group, vocab_size, partial_dx)
        with no_autocast(x.device):
            if getattr(config, "trunc", None) is not None:
                from . import truncation

                v = weight.shape[0]
                if tp_group:
                    from . import vocab_parallel

                    impl = vocab_parallel.ShardedBackend(impl, tp, weight, x.device, False)
                    v = impl.vocab_size
                return truncation.backward(impl, grad_logp, grad_entropy, x, weight, bias, tokens, lse, entropy_out,
                                           logp, tau, sparse, inside, kept, opts, config, need_dx, need_dw,
                                           need_db, v)
            if tp_group:
                from . import vocab_parallel

                dx, dw, db = vocab_parallel.backward(impl, grad_logp, grad_entropy, x, weight, bias, tokens, lse,
                                                     entropy_out, opts, tp, config, need_dx=need_dx, need_dw=need_dw,
                                                     need_db=need_db, kept=kept)
            else:
                coef = impl.grad_coefficients(entropy_out if entropy else None, tokens, grad_logp,
                                              grad_entropy if entropy else None, weight.shape[0], opts, lse)
                dx, dw, db = impl.backward(x, weight, bias, tokens, opts, lse, coef, config, kept=kept,
                                           need_dx=need_dx, need_dw=need_dw, need_db=need_db)
    return grad_outputs(x, dx, dw, db, need_dx, need_dw, need_db)


def _backward_fake(grad_logp, grad_entropy, x, weight, bias, *rest):
    need_dx, need_dw, need_db = rest[12:15]
    return fake_grad_outputs(x, weight, bias, need_dx, need_dw, need_db)


llp_forward = custom_op("llp_forward", _forward_op, schema=FORWARD_SCHEMA)
llp_forward.register_fake(_forward_fake)
llp_backward = custom_op("llp_backward", _backward_impl, mutates_args=("keep",), schema=BACKWARD_SCHEMA)
llp_backward.register_fake(_backward_fake)


def _setup_context(ctx, inputs, output):
    """Saved: x, weight, bias, tokens, lse, entropy and, truncated, logp, tau and the sparse
    backward's candidates. On ctx: the options and execution arguments, the Config, the
    kept columns (the first backward's)."""
    if len(inputs) < _NUM_INPUTS:  # (a compiled graph may leave the defaulted ones out)
        inputs = (*inputs, *_DEFAULTS[len(inputs) - 11:])
    x, weight, bias, tokens = inputs[:4]
    logp, ent, lse, keep, keep_max, config, tau, sparse, inside = output
    ctx.truncated = inputs[12] is not None or bool(inputs[16])
    if ctx.truncated:
        ctx.save_for_backward(x, weight, bias, tokens, lse, ent, logp, tau, sparse, inside)
    else:
        ctx.save_for_backward(x, weight, bias, tokens, lse, ent)
    ctx.options = inputs[4:10]  # <options>, backend, budget
    ctx.tp = inputs[17:]
    ctx.config = config
    ctx.kept = (keep, keep_max)
    rest = (lse, keep, keep_max, tau, sparse, inside)
    if isinstance(config, Tensor):
        ctx.mark_non_differentiable(*rest, config)
    else:  # (the eager fast path's Config is the object)
        ctx.mark_non_differentiable(*rest)
    ctx.set_materialize_grads(False)


def _backward(ctx, grad_logp, grad_entropy, *_):
    """(dx, dw, db, None...): the backward op on the saved tensors and the forward's Config."""
    kept, ctx.kept = ctx.kept, None
    needs = ctx.needs_input_grad
    need_dx, need_dw, need_db = needs[0], needs[1], needs[2]
    nones = (None,) * (_NUM_INPUTS - 3)
    if not (need_dx or need_dw or need_db) or (grad_logp is None and grad_entropy is None):
        return (None, None, None, *nones)
    x, weight, bias, tokens, lse, ent, *trunc = ctx.saved_tensors
    if kept is None:  # a second backward: the kept columns are spent
        kept = nothing_kept(x)
    # The eager fast path calls the implementation, recording no autograd history (as the
    # dispatcher runs a custom op's: a backward with create_graph=True runs in grad mode).
    op = llp_backward if not getattr(ctx, "eager", False) else _backward_impl
    args = (grad_logp, grad_entropy, x, weight, bias, tokens, lse, ent, *kept, ctx.config, *ctx.options, need_dx,
            need_dw, need_db, *(trunc or (None,) * 4), *ctx.tp)
    if op is _backward_impl and torch.is_grad_enabled():
        with torch.no_grad():
            out = op(*args)
    else:
        out = op(*args)
    out = guard_double_backward(OP, (out[0] if need_dx else None, out[1] if need_dw else None,
                                     out[2] if need_db else None), grad_logp, grad_entropy, x, weight, bias)
    return (*out, *nones)


#: What the public function calls: ``llp_forward`` with its autograd, through a plain
#: autograd.Function in eager mode (``autograd.EagerOp``: ``.runner(inputs)(*inputs)``).
llp_forward_eager = register_autograd(llp_forward, _forward, _setup_context, _backward)
