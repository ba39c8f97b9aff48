"""Every per-token field of TRL's fused LM head (``trl.trainer.utils.FusedCausalLMOutput``)
from one pass over the vocabulary, exact, without the (tokens x vocab) logits.

For a token's row of temperature-scaled logits a_c = softcap(x @ W^T + b)_c / T and
its label t (``logitless.formulas.log_probs``; p = softmax(a)):

    log_probs         = a_t - lse,                 lse = log sum_c exp(a_c)
    entropy           = -sum_c p_c log p_c          (lse - sum_c p_c a_c)
    log_sum_sq_probs  = log sum_c p_c^2 = lse2 - 2 lse,   lse2 = log sum_c exp(2 a_c)
    mean_logits       = (sum_c a_c) / V
    is_top1           = argmax_c a_c == t          (first maximum on ties, as torch.argmax)

Every field is 0 (False) at tokens whose label is ``ignore_index``, as TRL's. Only
``log_probs`` and ``entropy`` carry gradients (as TRL's: the other three are metrics).

Routes (:func:`head_fields`):

* ``outputs`` within {log_probs, entropy}: ``logitless.linear_log_probs`` (its Triton
  kernels on a GPU): one pass.
* any other field, where ``linear_log_probs`` would run Triton (CUDA, 16/32-bit floats;
  the interpreter with ``backend="triton"``): :class:`_TritonFields`, linear_log_probs'
  own forward kernel with its ``FIELDS`` statistics (``triton_lib.log_probs_fields``):
  per token and vocabulary split also s2 = sum e^(2(a - m)) (rescaled by e^(2(m - m'))
  when the max grows), the sum of a and the first argmax, merged over the splits as lse
  is; its backward is linear_log_probs' (the same lse, entropy and kept columns).
* elsewhere (CPU, float64): :class:`_AllFields`, the same statistics in bounded PyTorch
  tiles (fp32 logits from the inputs' values, fp32 GEMMs) beside those of
  ``formulas.log_probs`` (running max m, s = sum e^(a - m), u = sum e^(a - m)(a - m));
  its backward recomputes the tiles (``formulas.log_probs.dlogits_``).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from logitless.formulas.log_probs import dlogits_, grad_coefficients
from logitless.ops.common import validate as _validate
from logitless.ops.common.autocast import disabled as no_autocast
from logitless.ops.common.contract import TritonKind
from logitless.ops.common.kept import Kept
from logitless.ops.common.torch_tiles import chunked_backward, linear_torch_plan
from logitless.ops.common.validate import check_targets_in_range, resolve_backend
from logitless.ops.linear_log_probs import linear_log_probs as _linear_log_probs
from logitless.ops.linear_log_probs.torch_backend import scaled_tile
from logitless.options import LogProbOptions

#: TRL's ``OPTIONAL_OUTPUTS`` with log_probs: the fields in FusedCausalLMOutput's order.
FIELDS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")


def check_outputs(outputs) -> tuple:
    """``outputs`` as a tuple of known field names (ValueError naming the known ones)."""
    if isinstance(outputs, str):
        outputs = (outputs,)
    outputs = tuple(outputs)
    unknown = [o for o in outputs if o not in FIELDS]
    if unknown:
        raise ValueError(f"unknown fused LM head output(s) {unknown}; the fields are {FIELDS}")
    return outputs


def _one_pass(x: Tensor, weight: Tensor, bias: Optional[Tensor], labels: Tensor, opts: LogProbOptions,
              budget: int):
    """Per token (compute dtype): lse, a_t, entropy, lse2, sum_c a_c, argmax."""
    n, _ = x.shape
    v = weight.shape[0]
    cd = torch.float64 if x.dtype == torch.float64 else torch.float32
    plan = linear_torch_plan(x, v, budget, tiles=4, accumulators=0)
    out = [torch.empty(n, dtype=cd, device=x.device) for _ in range(5)]
    arg_out = torch.empty(n, dtype=torch.int64, device=x.device)
    for n0 in range(0, n, plan.token_chunk):
        n1 = min(n, n0 + plan.token_chunk)
        x_c, t_c = x[n0:n1].to(cd), labels[n0:n1]
        m = torch.full((n1 - n0,), float("-inf"), dtype=cd, device=x.device)
        s, u, s2, zsum, a_t = (torch.zeros_like(m) for _ in range(5))
        best = torch.full_like(m, float("-inf"))
        arg = torch.zeros(n1 - n0, dtype=torch.int64, device=x.device)
        for v0 in range(0, v, plan.vocab_chunk):
            v1 = min(v, v0 + plan.vocab_chunk)
            a = scaled_tile(x_c, weight[v0:v1].to(cd), bias[v0:v1].to(cd) if bias is not None else None, opts)
            local = t_c - v0
            inside = (local >= 0) & (local < v1 - v0)
            picked = a.gather(1, local.clamp(0, v1 - v0 - 1)[:, None])[:, 0]
            a_t += torch.where(inside, picked, torch.zeros_like(picked))
            zsum += a.sum(dim=1)
            tile_max, tile_arg = a.max(dim=1)  # first maximum within the tile
            better = tile_max > best  # strict: an earlier tile keeps a tie
            best = torch.where(better, tile_max, best)
            arg = torch.where(better, tile_arg + v0, arg)
            m_new = torch.maximum(m, tile_max)
            m_safe = torch.where(m_new == float("-inf"), torch.zeros_like(m_new), m_new)
            d = m - m_safe  # -inf while the row had nothing (then s = u = s2 = 0)
            scale = torch.exp(d)
            a.sub_(m_safe[:, None])  # a - m'
            e = torch.exp(a)
            u = scale * (u + torch.where(s > 0, d * s, torch.zeros_like(s))) \
                + torch.where(e > 0, e * a, torch.zeros_like(e)).sum(dim=1)
            s = s * scale + e.sum(dim=1)
            s2 = s2 * scale * scale + (e * e).sum(dim=1)
            m = m_new
            del a, e
        m_safe = torch.where(m == float("-inf"), torch.zeros_like(m), m)
        log_s = torch.log(s)
        out[0][n0:n1] = m_safe + log_s
        out[1][n0:n1] = a_t
        out[2][n0:n1] = log_s - u / s
        out[3][n0:n1] = 2 * m_safe + torch.log(s2)
        out[4][n0:n1] = zsum
        arg_out[n0:n1] = arg
    return (*out, arg_out)


def _fields_forward_end(ctx, saved, outputs, **attrs):
    """The end of both fields Functions' forward: save (x, weight, bias, labels, lse,
    entropy) and ``attrs`` on ctx, mark the last three of the five outputs (log_sum_sq_probs,
    mean_logits, is_top1) non-differentiable, return the five."""
    ctx.save_for_backward(*saved)
    for name, value in attrs.items():
        setattr(ctx, name, value)
    ctx.mark_non_differentiable(*outputs[2:])
    return outputs


def _fields_backward(ctx, g_lp, g_h, n_inputs: int, grads):
    """The backward of both fields Functions: None for all ``n_inputs`` inputs when no
    gradient flows in or none is needed (the entropy's gradient is dropped when the forward
    computed no entropy), else ``grads(ctx, g_lp, g_h, need) -> (dx, dw, db)`` (need: which
    of x, weight, bias want one) and None for the other inputs."""
    need = tuple(ctx.needs_input_grad[:3])
    if not ctx.opts.entropy:
        g_h = None
    if g_lp is None and g_h is None or not any(need):
        return (None,) * n_inputs
    return (*grads(ctx, g_lp, g_h, need), *(None,) * (n_inputs - 3))


def _torch_grads(ctx, g_lp, g_h, need):
    x, weight, bias, labels, lse, ent = ctx.saved_tensors
    opts, (need_dx, need_dw, need_db) = ctx.opts, need
    coef = grad_coefficients(ent, labels, g_lp, g_h, weight.shape[0], opts, lse)
    exact = x.dtype == lse.dtype
    plan = linear_torch_plan(x, weight.shape[0], ctx.budget, tiles=2 + (opts.softcap is not None),
                             accumulators=0 if exact else int(need_dw))

    def dz_of(x_c, w_v, b_v, n0, n1, v0):
        return dlogits_(scaled_tile(x_c, w_v, b_v, opts), lse[n0:n1], coef[:, n0:n1], labels[n0:n1], v0, opts)

    return chunked_backward(x, weight, bias, plan, dz_of, need_dx=need_dx, need_dw=need_dw, need_db=bool(need_db),
                            dx_acc=False)


def _triton_grads(ctx, g_lp, g_h, need):
    from logitless.ops.linear_log_probs import triton_backend as tb

    x, weight, bias, labels, lse, ent = ctx.saved_tensors
    opts, (need_dx, need_dw, need_db) = ctx.opts, need
    kept, ctx.kept = ctx.kept, None
    with no_autocast(x.device):
        coef = tb.grad_coefficients(ent if opts.entropy else None, labels, g_lp, g_h, weight.shape[0], opts)
        return tb.backward(x, weight, bias, labels, opts, lse, coef, need_dx=need_dx, need_dw=need_dw,
                           need_db=bool(need_db) and bias is not None, plan=ctx.plan,
                           kept=Kept.of(*kept, owned=True) if kept is not None else None)


class _AllFields(torch.autograd.Function):
    """(log_probs, entropy, log_sum_sq_probs, mean_logits, is_top1) from one pass; the
    last three are not differentiable."""

    @staticmethod
    def forward(ctx, x, weight, bias, labels, opts: LogProbOptions, budget: int):
        v = weight.shape[0]
        lse, a_t, ent, lse2, zsum, arg = _one_pass(x, weight, bias, labels, opts, budget)
        valid = labels != opts.ignore_index
        bad = valid & ((labels < 0) | (labels >= v))
        zero = torch.zeros_like(lse)

        def clean(t):  # 0 at ignored tokens, NaN at out-of-range labels
            t = torch.where(valid, t, zero)
            return torch.where(bad, torch.full_like(t, float("nan")), t)

        logp, ent = clean(a_t - lse), clean(ent)
        sq, mean = clean(lse2 - 2 * lse), clean(zsum / v)
        top1 = (arg == labels) & valid
        return _fields_forward_end(ctx, (x, weight, bias, labels, lse, ent), (logp, ent, sq, mean, top1),
                                   opts=opts, budget=budget)

    @staticmethod
    def backward(ctx, g_lp, g_h, *_):
        return _fields_backward(ctx, g_lp, g_h, 6, _torch_grads)


class _TritonFields(torch.autograd.Function):
    """The five fields from linear_log_probs' Triton forward with ``fields=True`` (one
    GEMM pass); gradients of log_probs and entropy by its backward (the last three
    outputs are not differentiable). Entropy is computed only when ``opts.entropy``
    (else that output is an empty tensor)."""

    @staticmethod
    def forward(ctx, x, weight, bias, labels, opts: LogProbOptions, budget: int, need_grad: bool):
        from logitless.ops.linear_log_probs import triton_backend as tb

        check_targets_in_range(labels, weight.shape[0], opts.ignore_index, name="labels")
        with no_autocast(x.device):
            plan = tb.linear(x, weight, bias, opts, budget=budget, need_grad=need_grad, cute=False)
            (logp, ent, lse, sq, mean, top1), kept = tb.forward(x, weight, bias, labels, opts, plan=plan,
                                                                 outputs=True, fields=True)
        if ent is None:
            ent = logp.new_empty(0)
        # (kept: consumed by the first backward)
        return _fields_forward_end(ctx, (x, weight, bias, labels, lse, ent), (logp, ent, sq, mean, top1),
                                   opts=opts, plan=plan, kept=kept)

    @staticmethod
    def backward(ctx, g_lp, g_h, *_):
        return _fields_backward(ctx, g_lp, g_h, 7, _triton_grads)


def head_fields(x: Tensor, weight: Tensor, labels: Tensor, bias: Optional[Tensor] = None, *,
                temperature: float = 1.0, softcap: Optional[float] = None, outputs=("log_probs",),
                ignore_index: int = -100, memory_budget: Optional[int] = None, backend: str = "auto"):
    """TRL's five per-token fields (module docstring) of x (..., H) against labels (...),
    in ``FIELDS`` order, None for the ones not in ``outputs``; ``log_probs`` always.
    x, weight and bias must share a dtype (the caller casts: TRL's compute dtype).
    ``backend``: as ``linear_log_probs``' ("auto": Triton on CUDA, else PyTorch; "torch";
    "triton", also the CPU interpreter); it picks the route of the extra fields too."""
    outputs = check_outputs(outputs)
    want = {f: f in outputs or f == "log_probs" for f in FIELDS}
    if not any(want[f] for f in FIELDS[2:]):
        res = _linear_log_probs(x, weight, labels, bias, temperature=temperature, entropy=want["entropy"],
                                softcap=softcap, ignore_index=ignore_index, memory_budget=memory_budget,
                                backend=backend)
        logp, ent = res if want["entropy"] else (res, None)
        return logp, ent, None, None, None
    budget = _validate.memory_budget(memory_budget, x.device)
    if x.dtype != weight.dtype or (bias is not None and bias.dtype != weight.dtype):
        raise TypeError(f"x, weight and bias must share a dtype, got {x.dtype}, {weight.dtype}"
                        + ("" if bias is None else f", {bias.dtype}"))
    if x.shape[-1] != weight.shape[1] or tuple(labels.shape) != tuple(x.shape[:-1]):
        raise ValueError(f"x {tuple(x.shape)}, weight {tuple(weight.shape)} and labels {tuple(labels.shape)} "
                         "do not fit: x (..., H), weight (V, H), labels (...)")
    flat = labels.reshape(-1).long()
    x2d = x.reshape(-1, x.shape[-1])
    from logitless.ops.linear_log_probs.api import BACKENDS

    impl = resolve_backend(backend, x.device, x.dtype, BACKENDS)
    if issubclass(BACKENDS.kind(impl), TritonKind) and x2d.shape[0] > 0:  # (its fields' Triton kernels)
        if x2d.stride(-1) != 1:
            x2d = x2d.contiguous()
        opts = LogProbOptions.checked(temperature=temperature, entropy=want["entropy"], softcap=softcap,
                                      ignore_index=ignore_index)
        need_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias))
        fields = _TritonFields.apply(x2d, weight, bias, flat, opts, budget, need_grad)
    else:
        opts = LogProbOptions.checked(temperature=temperature, entropy=True, softcap=softcap,
                                      ignore_index=ignore_index)
        fields = _AllFields.apply(x2d, weight, bias, flat, opts, budget)
    return tuple(f.reshape(labels.shape) if want[name] else None for name, f in zip(FIELDS, fields))


__all__ = ["FIELDS", "head_fields", "check_outputs"]
