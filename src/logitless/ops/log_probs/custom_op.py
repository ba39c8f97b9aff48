"""The torch.library custom ops of log_probs on logits: what autograd and torch.compile see.

    logitless::lp_forward(logits, tokens, <options>, backend, budget) -> logp, entropy
                          ((0,) without entropy), lse
    logitless::lp_backward(grad_logp, grad_entropy, logits, tokens, lse, entropy,
                           <options>, backend, budget) -> d / d logits (a new tensor)

``<options>`` are the fields of ``LogProbOptions`` under their own names. The CPU
token-range check lives in the implementation (eager also under torch.compile).
Double backward raises.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from logitless.formulas.common import compute_dtype
from logitless.formulas.log_probs import grad_coefficients, token_outputs
from logitless.ops.common.autocast import disabled as no_autocast
from logitless.ops.common.autograd import custom_op, guard_double_backward, named, under_forward_overrides
from logitless.ops.common.dispatch import load_backend
from logitless.ops.common.validate import check_targets_in_range
from logitless.options import LogProbOptions

OP = "log_probs"


def _forward(logits: Tensor, tokens: Tensor, temperature: float, entropy: bool, softcap: Optional[float],
             ignore_index: int, backend: str, budget: int) -> tuple[Tensor, Tensor, Tensor]:
    """logits (N, V), tokens (N,) int64 -> logp (N,), entropy (N,) or (0,), lse (N,)."""
    opts = LogProbOptions(temperature, entropy, softcap, ignore_index)
    n, v = logits.shape
    check_targets_in_range(tokens, v, ignore_index, name="tokens")
    sd = compute_dtype(logits.dtype)
    if n == 0:
        empty = logits.new_empty(0, dtype=sd)
        return empty, empty.clone(), empty.clone()
    with no_autocast(logits.device):
        stats = load_backend(__package__, backend).forward(logits, tokens, opts, budget=budget)
        logp, ent = token_outputs(stats, tokens, v, opts)
    ent = ent.to(sd) if ent is not None else logits.new_empty(0, dtype=sd)
    return logp.to(sd), ent, stats.lse.to(sd)


lp_forward = custom_op("lp_forward", _forward)


@lp_forward.register_fake
def _(logits, tokens, temperature, entropy, softcap, ignore_index, backend, budget):
    n = logits.shape[0]
    sd = compute_dtype(logits.dtype)
    return logits.new_empty(n, dtype=sd), logits.new_empty(n if entropy else 0, dtype=sd), logits.new_empty(n, dtype=sd)


def _backward(grad_logp: Optional[Tensor], grad_entropy: Optional[Tensor], logits: Tensor, tokens: Tensor,
              lse: Tensor, entropy_out: Tensor, temperature: float, entropy: bool, softcap: Optional[float],
              ignore_index: int, backend: str, budget: int) -> Tensor:
    opts = LogProbOptions(temperature, entropy, softcap, ignore_index)
    out = torch.empty_like(logits)
    n, v = logits.shape
    if n == 0:
        return out
    with no_autocast(logits.device):
        coef = grad_coefficients(entropy_out if entropy else None, tokens, grad_logp,
                                 grad_entropy if entropy else None, v, opts, lse)
        load_backend(__package__, backend).backward(logits, tokens, opts, lse, coef, out, budget=budget)
    return out


lp_backward = custom_op("lp_backward", _backward)


@lp_backward.register_fake
def _(grad_logp, grad_entropy, logits, tokens, lse, entropy_out, temperature, entropy, softcap,
      ignore_index, backend, budget):
    return torch.empty_like(logits)


def _setup_context(ctx, inputs, output):
    a = named(_forward, inputs)
    _, ent, lse = output
    ctx.save_for_backward(a["logits"], a["tokens"], lse, ent)
    ctx.opts = LogProbOptions.from_args(a)
    ctx.backend, ctx.budget, ctx.num_inputs = a["backend"], a["budget"], len(inputs)
    ctx.mark_non_differentiable(lse)
    ctx.set_materialize_grads(False)


def _autograd_backward(ctx, grad_logp, grad_entropy, *_):
    if not ctx.needs_input_grad[0] or (grad_logp is None and grad_entropy is None):
        return (None,) * ctx.num_inputs
    logits, tokens, lse, ent = ctx.saved_tensors
    grad = lp_backward(grad_logp, grad_entropy, logits, tokens, lse, ent, *ctx.opts.args(), ctx.backend, ctx.budget)
    (grad,) = guard_double_backward(OP, (grad,), grad_logp, grad_entropy, logits)
    return (grad,) + (None,) * (ctx.num_inputs - 1)


# The backward plans (and reads ``override(...)``) as its forward did, on any thread.
_setup, _backward = under_forward_overrides(_setup_context, _autograd_backward)
lp_forward.register_autograd(_backward, setup_context=_setup)
