"""The bodies of log_probs' custom ops on logits (``logitless::lp_forward`` and ``lp_backward``),
written against the declared calls of ``contract`` (``LpCall`` -> ``LpOutputs``,
``LpBackwardCall`` -> d / d logits); ``ops.common.glue.CustomOp`` derives the schemas, the
flattening and the autograd wiring from those declarations.

Truncated and batch-invariant calls are Configs of the same backends (``contract.Blocks``):
fixed output shapes either way. The forward plans the call once (``backend.plan``); the
backward follows that Config: the object on the eager path; through the custom ops the
backward op plans it again from the forward's planning arguments (``replan``: the
memoised planner returns the forward's object), so no Config crosses them and both may
run inside a CUDA graph. The CPU checks of the
tokens' and the truncation's values live in the forward (eager also under torch.compile).
Double backward raises.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from logitless.formulas.common import compute_dtype
from logitless.formulas.truncation import Truncation, check_values
from logitless.ops.common.autocast import disabled as no_autocast
from logitless.ops.common.contract import BackendTable
from logitless.ops.common.glue import CustomOp
from logitless.ops.common.validate import check_targets_in_range

from .contract import LpBackend, LpBackwardCall, LpCall, LpOutputs, LpPlanned

#: The custom ops: logitless::lp_forward, logitless::lp_backward.
NAME = "lp"
OP = "log_probs"


def forward(call: LpCall, impl: LpBackend) -> LpOutputs:
    """logp (N,), entropy (N,) or None, lse (N,), tau (N,) or None, the Config as the object."""
    logits, tokens, opts = call.logits, call.tokens, call.opts
    n, v = logits.shape
    check_targets_in_range(tokens, v, opts.ignore_index, name="tokens")
    trunc = None
    if call.top_k is not None:
        assert call.top_p is not None and call.min_p is not None  # (given with top_k: ``api``)
        if not call.checked and logits.device.type == "cpu":
            check_values(call.top_k, call.top_p, call.min_p)
        trunc = Truncation(call.top_k, call.top_p, call.min_p, call.k_max if call.k_max >= 0 else None, call.checked)
    blocked = trunc is not None or call.batch_invariant
    sd = compute_dtype(logits.dtype)
    if n == 0:
        empty = logits.new_empty(0, dtype=sd)
        return LpOutputs(empty, logits.new_empty(0, dtype=sd) if opts.entropy else None,
                         logits.new_empty(0, dtype=sd), logits.new_empty(0, dtype=sd) if blocked else None, None)
    with no_autocast(logits.device):
        # The call's Config, once: the forward and the backward follow it.
        config = impl.plan(logits, opts, budget=call.budget, truncated=trunc is not None,
                           batch_invariant=call.batch_invariant)
        out = impl.forward(logits, tokens, trunc, opts, config)
    return LpOutputs(out.logp.to(sd), out.entropy.to(sd) if out.entropy is not None else None, out.lse.to(sd),
                     out.tau, config)


def fake(call: LpCall, impl: LpBackend) -> LpOutputs:
    n = call.logits.shape[0]
    sd = compute_dtype(call.logits.dtype)
    blocked = call.top_k is not None or call.batch_invariant  # (tau: the truncated path's output)
    empty = call.logits.new_empty
    return LpOutputs(empty(n, dtype=sd), empty(n, dtype=sd) if call.opts.entropy else None, empty(n, dtype=sd),
                     empty(n, dtype=sd) if blocked else None, None)


def save(ctx, call: LpCall, out: LpOutputs) -> None:
    """Saved: logits, tokens, logp (truncated or batch-invariant calls only: where it is
    -inf no gradient flows), entropy, lse, tau. On ctx: the options, the backend, the Config."""
    blocked = call.top_k is not None or call.batch_invariant
    ctx.save_for_backward(call.logits, call.tokens, out.logp if blocked else None, out.entropy, out.lse, out.tau)
    ctx.opts, ctx.backend, ctx.config = call.opts, call.backend, out.config
    ctx.planned = LpPlanned(call.budget, call.top_k is not None, call.batch_invariant)
    frozen = [out.lse]
    if out.tau is not None:
        frozen.append(out.tau)
    ctx.mark_non_differentiable(*frozen)
    ctx.set_materialize_grads(False)


def backward(ctx, grads: LpOutputs, need, run) -> tuple:
    """(d logits,): the backward op (``run``) on the saved tensors and the forward's Config."""
    grad_logp: Optional[Tensor] = grads.logp  # (None: not materialised)
    if grad_logp is None and grads.entropy is None:
        return (None,)
    logits, tokens, logp, entropy_out, lse, tau = ctx.saved_tensors
    return run(LpBackwardCall(grad_logp, grads.entropy, logits, tokens, logp, entropy_out, lse, tau, ctx.config,
                              ctx.opts, ctx.backend, ctx.planned))


def backward_impl(b: LpBackwardCall, impl: LpBackend) -> tuple:
    """(d / d logits,); ``config``: the forward's."""
    logits = b.logits
    if logits.shape[0] == 0:
        return (torch.empty_like(logits),)
    with no_autocast(logits.device):
        return (impl.backward(b.grad_logp, b.grad_entropy, logits, b.tokens, b.logp, b.entropy_out, b.lse, b.tau,
                              b.opts, b.config),)


def replan(b: LpBackwardCall, impl: LpBackend):
    """The forward's Config of ``b`` (the backward custom op's), planned again from the same
    logits and planning arguments (the planner is memoised: the forward's object); None
    without tokens."""
    if b.logits.shape[0] == 0:
        return None
    with no_autocast(b.logits.device):
        p = b.planned
        return impl.plan(b.logits, b.opts, budget=p.budget, truncated=p.truncated, batch_invariant=p.batch_invariant)


def backward_fake(b: LpBackwardCall, impl: LpBackend) -> tuple:
    return (torch.empty_like(b.logits),)


def define(backends: BackendTable[LpBackend], *, name: str = NAME,
           tags: tuple = ()) -> CustomOp[LpCall, LpOutputs, LpBackwardCall, LpBackend]:
    """The custom-op pair over the table of backends ``backends`` (``api.BACKENDS``);
    ``tags``: torch.library's (``glue.HOST_SYNCS`` for the truncated calls' pair)."""
    return CustomOp(name, LpCall, LpOutputs, LpBackwardCall, table=backends, forward=forward, fake=fake, save=save,
                    backward=backward, backward_impl=backward_impl, backward_fake=backward_fake, title=OP,
                    replan=replan, tags=tags)
