"""The torch.library custom ops of log_probs on logits: what autograd and torch.compile see.

    logitless::lp_forward(logits, tokens, <options>, backend, budget) -> logp, entropy
                          ((0,) without entropy), lse
    logitless::lp_backward(grad_logp, grad_entropy, logits, tokens, lse, entropy_out,
                           <options>, backend, budget) -> d / d logits (a new tensor)

``<options>`` are the fields of ``LogProbOptions`` under their own names. The ops, their
fakes and autograd are built from ``SPEC`` (``ops.common.spec``). The CPU token-range
check lives in the implementation (eager also under torch.compile). Double backward raises.
"""

from __future__ import annotations

import torch
from torch import Tensor

from logitless.formulas.common import compute_dtype
from logitless.formulas.log_probs import grad_coefficients, token_outputs
from logitless.ops.common.autocast import disabled as no_autocast
from logitless.ops.common.dispatch import load_backend
from logitless.ops.common.spec import OpSpec, build, options, scalar, tensor
from logitless.ops.common.validate import check_targets_in_range
from logitless.options import LogProbOptions

OP = "log_probs"


def _forward(logits: Tensor, tokens: Tensor, opts: LogProbOptions, backend: str, budget: int):
    """logits (N, V), tokens (N,) int64 -> logp (N,), entropy (N,) or (0,), lse (N,)."""
    n, v = logits.shape
    check_targets_in_range(tokens, v, opts.ignore_index, name="tokens")
    sd = compute_dtype(logits.dtype)
    if n == 0:
        empty = logits.new_empty(0, dtype=sd)
        return empty, empty.clone(), empty.clone()
    with no_autocast(logits.device):
        stats = load_backend(__package__, backend).forward(logits, tokens, opts, budget=budget)
        logp, ent = token_outputs(stats, tokens, v, opts)
    ent = ent.to(sd) if ent is not None else logits.new_empty(0, dtype=sd)
    return logp.to(sd), ent, stats.lse.to(sd)


def _forward_fake(logits, tokens, opts, backend, budget):
    n = logits.shape[0]
    sd = compute_dtype(logits.dtype)
    return (logits.new_empty(n, dtype=sd), logits.new_empty(n if opts.entropy else 0, dtype=sd),
            logits.new_empty(n, dtype=sd))


def _backward(grad_logp, grad_entropy, logits, tokens, lse, entropy_out, opts: LogProbOptions, backend: str,
              budget: int) -> Tensor:
    out = torch.empty_like(logits)
    n, v = logits.shape
    if n == 0:
        return out
    with no_autocast(logits.device):
        coef = grad_coefficients(entropy_out if opts.entropy else None, tokens, grad_logp,
                                 grad_entropy if opts.entropy else None, v, opts, lse)
        load_backend(__package__, backend).backward(logits, tokens, opts, lse, coef, out, budget=budget)
    return out


def _backward_fake(grad_logp, grad_entropy, logits, *_):
    return torch.empty_like(logits)


_EXEC = (scalar("backend", str), scalar("budget", int))

SPEC = OpSpec(
    op=OP,
    name="lp_forward",
    forward=(tensor("logits"), tensor("tokens"), options("opts", LogProbOptions), *_EXEC),
    outputs=("logp", "entropy_out", "lse"),
    forward_impl=_forward,
    forward_fake=_forward_fake,
    backward_name="lp_backward",
    backward=(tensor("grad_logp", True), tensor("grad_entropy", True), tensor("logits"), tensor("tokens"),
              tensor("lse"), tensor("entropy_out"), options("opts", LogProbOptions), *_EXEC),
    backward_impl=_backward,
    backward_fake=_backward_fake,
    grads=("grad_logp", "grad_entropy", None),
    grad_inputs=("logits",),
    skip_if_no_grads=True,
)

_built = build(SPEC)
lp_forward, lp_backward = _built.forward_op, _built.backward_op
