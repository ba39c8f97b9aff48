"""The torch.library custom ops of log_probs on logits: what autograd and torch.compile see.

    logitless::lp_forward(logits, tokens, <options>, backend, budget, top_k=None, top_p=None,
                          min_p=None, k_max=0, batch_invariant=False)
        -> logp, entropy ((0,) without entropy), lse, tau ((0,) untruncated), config
    logitless::lp_backward(grad_logp, grad_entropy, logits, tokens, logp (None untruncated),
                           entropy_out, lse, tau, config, <options>, backend)
        -> d / d logits (a new tensor)

(the schemas, written out: ``FORWARD_SCHEMA``, ``BACKWARD_SCHEMA``). ``<options>`` are the
fields of ``LogProbOptions`` (temperature, entropy, softcap, ignore_index); ``backend``
names an entry of the table ``api.BACKENDS`` (given here by ``use_backends``), an
``LpBackend`` (``contract``). ``top_k``, ``top_p``, ``min_p``: the per-token truncation
(``formulas.truncation.Truncation``; None: none), ``k_max`` its largest top_k when known
on the host (-1: read from top_k). Truncated and batch-invariant calls are Configs of the
same backends (``contract.Blocks``): fixed output shapes either way. The forward plans the
call once (``backend.plan``); the backward follows that Config: the object on the eager
fast path, the backend's encoding (``backend.codec``, a CPU int64 tensor) through the
custom ops. The CPU checks of the tokens' and the truncation's values live in the
implementation (eager also under torch.compile). Double backward raises.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from logitless.formulas.common import compute_dtype
from logitless.formulas.truncation import Truncation, check_values
from logitless.ops.common.autocast import disabled as no_autocast
from logitless.ops.common.autograd import below_autograd, custom_op, guard_double_backward
from logitless.ops.common.contract import register_autograd
from logitless.ops.common.validate import check_targets_in_range
from logitless.options import LogProbOptions

from .contract import LpBackend

OP = "log_probs"

OPTIONS_SCHEMA = "float temperature, bool entropy, float? softcap, SymInt ignore_index"
FORWARD_SCHEMA = (
    f"(Tensor logits, Tensor tokens, {OPTIONS_SCHEMA}, str backend, SymInt budget, Tensor? top_k=None, "
    "Tensor? top_p=None, Tensor? min_p=None, SymInt k_max=0, bool batch_invariant=False) "
    "-> (Tensor, Tensor, Tensor, Tensor, Tensor)"
)
BACKWARD_SCHEMA = (
    "(Tensor? grad_logp, Tensor? grad_entropy, Tensor logits, Tensor tokens, Tensor? logp, Tensor entropy_out, "
    f"Tensor lse, Tensor tau, Tensor config, {OPTIONS_SCHEMA}, str backend) -> Tensor"
)
#: The forward's arguments: 8, then the 5 defaulted truncation ones.
_NUM_INPUTS = 13

#: backend name -> LpBackend: ``api.BACKENDS``, given once at import (``use_backends``).
BACKENDS: Mapping[str, LpBackend] = {}


def use_backends(table: Mapping[str, LpBackend]) -> None:
    """The table of backends the custom ops run (``api.BACKENDS``)."""
    global BACKENDS
    BACKENDS = table


def _forward(logits: Tensor, tokens: Tensor, temperature, entropy, softcap, ignore_index, backend: str, budget: int,
             top_k=None, top_p=None, min_p=None, k_max: int = 0, batch_invariant: bool = False):
    """logits (N, V), tokens (N,) int64 -> logp (N,), entropy (N,) or (0,), lse (N,), tau
    (N,) or (0,), the Config as the object."""
    opts = LogProbOptions(temperature, entropy, softcap, ignore_index)
    n, v = logits.shape
    check_targets_in_range(tokens, v, opts.ignore_index, name="tokens")
    trunc = None
    if top_k is not None:
        if logits.device.type == "cpu":
            check_values(top_k, top_p, min_p)
        trunc = Truncation(top_k, top_p, min_p, k_max if k_max >= 0 else None)
    sd = compute_dtype(logits.dtype)
    if n == 0:
        return (logits.new_empty(0, dtype=sd), logits.new_empty(0, dtype=sd), logits.new_empty(0, dtype=sd),
                logits.new_empty(0, dtype=sd), None)
    impl = BACKENDS[backend]
    with no_autocast(logits.device):
        # The call's Config, once: the forward and the backward follow it.
        config = impl.plan(logits, opts, budget=budget, truncated=trunc is not None, batch_invariant=batch_invariant)
        out = impl.forward(logits, tokens, trunc, opts, config)
    ent = out.entropy.to(sd) if out.entropy is not None else logits.new_empty(0, dtype=sd)
    tau = out.tau if out.tau is not None else logits.new_empty(0, dtype=sd)
    return out.logp.to(sd), ent, out.lse.to(sd), tau, config


def _forward_op(*args):
    """The custom op's implementation: ``_forward`` with the Config encoded by its backend."""
    out = _forward(*args)
    return (*out[:4], BACKENDS[args[6]].codec.encode(out[4]))


def _forward_fake(logits, tokens, temperature, entropy, softcap, ignore_index, backend, budget, top_k=None, top_p=None,
                  min_p=None, k_max=0, batch_invariant=False):
    n = logits.shape[0]
    sd = compute_dtype(logits.dtype)
    blocked = top_k is not None or batch_invariant  # (tau: the truncated path's output)
    return (logits.new_empty(n, dtype=sd), logits.new_empty(n if entropy else 0, dtype=sd),
            logits.new_empty(n, dtype=sd), logits.new_empty(n if blocked else 0, dtype=sd),
            BACKENDS[backend].codec.fake())


def _backward_impl(grad_logp, grad_entropy, logits, tokens, logp, entropy_out, lse, tau, config, temperature,
                   entropy, softcap, ignore_index, backend) -> Tensor:
    """d / d logits; ``config``: the forward's (the object, or its encoding)."""
    if logits.shape[0] == 0:
        return torch.empty_like(logits)
    impl = BACKENDS[backend]
    opts = LogProbOptions(temperature, entropy, softcap, ignore_index)
    with no_autocast(logits.device):
        return impl.backward(grad_logp, grad_entropy, logits, tokens, logp, entropy_out, lse, tau, opts,
                             impl.codec.decode(config))


def _backward_fake(grad_logp, grad_entropy, logits, *_):
    return torch.empty_like(logits)


lp_forward = custom_op("lp_forward", _forward_op, schema=FORWARD_SCHEMA)
lp_forward.register_fake(_forward_fake)
lp_backward = custom_op("lp_backward", _backward_impl, schema=BACKWARD_SCHEMA)
lp_backward.register_fake(_backward_fake)



def _setup_context(ctx, inputs, output):
    """Saved: logits, tokens, logp (truncated or batch-invariant calls only: where it is
    -inf no gradient flows), entropy, lse, tau. On ctx: the options and the backend, the
    Config."""
    if len(inputs) < _NUM_INPUTS:  # (a compiled graph may leave the defaulted ones out)
        inputs = (*inputs, None, None, None, 0, False)[:_NUM_INPUTS]
    logp, entropy_out, lse, tau, config = output
    blocked = inputs[8] is not None or inputs[12]
    ctx.save_for_backward(inputs[0], inputs[1], logp if blocked else None, entropy_out, lse, tau)
    ctx.options = inputs[2:7]  # <options>, backend
    ctx.config = config
    if isinstance(config, Tensor):
        ctx.mark_non_differentiable(lse, tau, config)
    else:  # (the eager fast path's Config is the object)
        ctx.mark_non_differentiable(lse, tau)
    ctx.set_materialize_grads(False)


def _backward(ctx, grad_logp, grad_entropy, *_):
    """(d logits, None...): the backward op on the saved tensors and the forward's Config."""
    nones = (None,) * (_NUM_INPUTS - 1)
    if not ctx.needs_input_grad[0] or (grad_logp is None and grad_entropy is None):
        return (None, *nones)
    logits, tokens, logp, entropy_out, lse, tau = ctx.saved_tensors
    args = (grad_logp, grad_entropy, logits, tokens, logp, entropy_out, lse, tau, ctx.config, *ctx.options)
    # The eager fast path calls the implementation, recording no autograd history (as the
    # dispatcher runs a custom op's: a backward with create_graph=True runs in grad mode).
    if getattr(ctx, "eager", False):
        with below_autograd():
            dz = _backward_impl(*args)
    else:
        dz = lp_backward(*args)
    (dz,) = guard_double_backward(OP, (dz,), grad_logp, grad_entropy, logits)
    return (dz, *nones)


#: What the public function calls: ``lp_forward`` with its autograd, through a plain
#: autograd.Function in eager mode (``autograd.EagerOp``: ``.runner(inputs)(*inputs)``).
lp_forward_eager = register_autograd(lp_forward, _forward, _setup_context, _backward)
