"""Launch functions of the Helion linear_cross_entropy kernels (``ce_kernels``, ``grad_kernels``).

Framework side of the contract: 2-D x (N, H), weight (V, H), optional bias (V,), int64
target (N,), optional class weights (V,); fp32 per-token statistics out, and the
gradient coefficients in (``formulas.cross_entropy.grad_coefficients``'s (3, N) fp32).
Everything else (the loss from the statistics, reductions, autograd) stays in the op.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from logitless.formulas.cross_entropy import TokenStats
from logitless.formulas.log_probs import merge_splits
from logitless.helion_lib import configs
from logitless.helion_lib.runtime import launch, require
from logitless.options import CrossEntropyOptions


def _cap(opts: CrossEntropyOptions) -> tuple[float, bool]:
    return (float(opts.softcap), True) if opts.softcap is not None else (1.0, False)


def forward_args(x, weight, bias, target, class_weight, opts, need_argmax=False, span=None) -> tuple:
    """The arguments of ``ce_kernels.ce_forward``; ``span``: columns per vocabulary split
    (None: all V, one split)."""
    cap, has_cap = _cap(opts)
    cw = class_weight if (class_weight is not None and opts.needs_smooth_sum) else None
    span = max(1, weight.shape[0]) if span is None else span
    return (x, weight, bias, target, cw, cap, span, has_cap, opts.needs_smooth_sum, bool(need_argmax))


def merge_forward(parts: tuple, num_classes: int, need_smooth: bool, need_argmax: bool) -> TokenStats:
    """``TokenStats`` from ``ce_forward``'s (splits, N) partials: the log-sum-exp merged
    (``formulas.log_probs.merge_splits``), target logit and smoothing sum added (the target
    lies in one split), the first index of the largest logit."""
    pm, ps, zt, smooth, best, am = parts
    lse, _ = merge_splits(pm, ps, None)
    argmax = None
    if need_argmax:
        top = best.amax(dim=0, keepdim=True)
        argmax = torch.where(best == top, am, torch.full_like(am, num_classes)).amin(dim=0)
    return TokenStats(lse, zt.sum(0), smooth.sum(0) if need_smooth else None, argmax)


def dz_class_weight(class_weight: Optional[Tensor], opts: CrossEntropyOptions) -> Optional[Tensor]:
    """The class weights dz reads: its C term is eps / V, 0 without label smoothing, so they
    enter dz only with label smoothing."""
    return class_weight if opts.needs_smooth_sum else None


def backward_args(x, weight, bias, target, dz_weight, lse, coef, softcap: Optional[float]) -> tuple:
    """The arguments of ``grad_kernels.linear_dlogits`` (LOG_PROBS False), for all of V;
    ``dz_weight``: the class weights of dz's C term (``dz_class_weight``) or None."""
    cap, has_cap = (float(softcap), True) if softcap is not None else (1.0, False)
    return (x, weight, bias, target, dz_weight, lse.float().contiguous(), coef.float().contiguous(), cap, 1.0,
            has_cap, False, False)


def lce_forward(x: Tensor, weight: Tensor, bias: Optional[Tensor], target: Tensor,
                class_weight: Optional[Tensor], opts: CrossEntropyOptions,
                need_argmax: bool = False, config: Optional[dict] = None) -> TokenStats:
    """Per-token statistics (lse, target logit, smoothing sum or None, argmax or None) of
    the soft-capped logits x @ W.T + b, fp32, never materialised."""
    require()
    from logitless.helion_lib.ce_kernels import ce_forward

    n = x.shape[0]
    if n == 0:
        e = x.new_empty((0,), dtype=torch.float32)
        return TokenStats(e, e, e if opts.needs_smooth_sum else None,
                          x.new_empty((0,), dtype=torch.int64) if need_argmax else None)
    sizes = configs.sizes(x, weight)
    cfg = config or configs.pick("ce_forward", sizes, x.device)
    span = configs.forward_span(cfg, sizes, x.device)
    parts = launch(ce_forward, forward_args(x, weight, bias, target, class_weight, opts, need_argmax, span), cfg)
    return merge_forward(parts, weight.shape[0], opts.needs_smooth_sum, need_argmax)


def lce_backward(x: Tensor, weight: Tensor, bias: Optional[Tensor], target: Tensor,
                 dz_weight: Optional[Tensor], lse: Tensor, coef: Tensor, softcap: Optional[float],
                 config: Optional[dict] = None, need_dx: bool = True, need_dw: bool = True,
                 budget: Optional[int] = None, chunk: Optional[int] = None, dx_acc: bool = False,
                 ) -> tuple[Optional[Tensor], Optional[Tensor], Optional[Tensor]]:
    """(dx, dW, db or None) for the per-token coefficients ``coef`` (``dz_weight``: the class
    weights of dz's C term, ``dz_class_weight``) ((3, N): A, B, C of
    ``formulas.cross_entropy``, 0 at ignored tokens); dx, dW in x's / W's dtype, db in fp32
    (the caller casts it to the bias dtype). ``grad_kernels.backward``: dz per vocabulary
    chunk of ``chunk`` columns (default: ``vocab_chunk`` of ``budget`` bytes), cuBLAS for
    the gradients; ``dx_acc``: dx as the fp32 accumulator (not cast).
    ``need_dx`` / ``need_dw`` False skip that part (None in its place; db comes with dW).
    """
    require()
    from logitless.helion_lib.grad_kernels import backward

    return backward(backward_args(x, weight, bias, target, dz_weight, lse, coef, softcap), "ce", config,
                    need_dx, need_dw, budget=budget, chunk=chunk, dx_acc=dx_acc)
