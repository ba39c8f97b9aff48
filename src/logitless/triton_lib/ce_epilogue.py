"""The O(tokens) epilogues of the cross-entropy ops as one or two Triton launches each
(small shapes are host-bound, and the torch form of these formulas
was ~40 tiny kernels per forward+backward, each a few microseconds of GPU time and
tens of microseconds of host time).

``forward_loss``: the vocabulary splits' partial statistics (S, N) -> lse (N,), w_t
(N,) and the loss (reduced or per token): ``formulas.common.merge_splits``, then
``formulas.cross_entropy.token_loss`` and ``formulas.common.reduce``, every option
(ignore_index, label smoothing, class weights, z-loss, reductions none/sum/mean;
NaN at targets out of range).

``grad_coefficients``: grad of the loss (and of lse) -> the (3, N) A, B, C of
``formulas.cross_entropy.grad_coefficients`` (with ``upstream_per_token``'s g and the
A term of a gradient of lse on top).

The torch formulas stay the spec (the module docstring of formulas/cross_entropy.py);
tests compare these launches with them on random statistics, every option alone and
combined. The forward merges the splits in one program up to ``BLOCK`` tokens (which also
reduces the loss: one launch), past them on a grid of programs over blocks of tokens, then
one program sums the per-token losses; each program adds its splits in split order,
``ce_math.SPLIT_STEP`` loads in flight at a time (one program looping over every token and
split, one load at a time, was 0.29 ms at 4096 tokens x 63 splits on an H100). The
backward's coefficients are one program looping over the tokens. No atomics, fixed summation orders
(bitwise repeatable), no host sync, the same launches every call (CUDA-graph friendly; after
the first, ``launch.run_kernel``'s cached kernel, without Triton's per-launch binding).
Memory traffic: each reads its O(S * N) inputs once (twice for w_t under "mean" in the
backward); it writes O(N). Label smoothing with class weights adds one torch op, W = sum_c
w_c (the formulas' sum). A launch saves ~20 launches of torch ops.

Versus the torch formulas: per-token values use the same operations in the same
order with the same fp32 scalars (host-side products such as (eps / V) * V are
computed in Python as torch does), and floating-point contraction is off
(``enable_fp_fusion=False``), so A, B, C, w_t and the per-token loss are bitwise
the torch formulas' for the same inputs, except through the two sums that change
order: the merge over S > 1 splits and the sums over tokens (the reduced loss, and
"mean"'s denominator in the backward) differ from torch's at fp32 rounding. lse uses
Triton's exp/log (approximate on the GPU): within a few ulp of torch's.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from logitless.formulas.cross_entropy import _class_weight_sum
from logitless.options import CrossEntropyOptions
from logitless.triton_lib import launch
from logitless.triton_lib.ce_math import SPLIT_STEP, split_ok, splits_max

REDUCTIONS = {"none": 0, "sum": 1, "mean": 2}
#: Tokens per step of the one-program loops (the sums over tokens: their lanes).
BLOCK = 1024
#: Tokens per program of the forward's merge over splits past BLOCK tokens (a grid: one
#: program's chain of split steps is the latency; more tokens per program would not
#: shorten it). Up to BLOCK tokens: one program, which reduces the loss too (one launch).
TOKENS = 256


@triton.jit
def _target_weight(t, valid, cw_ptr, V, HAS_CW: tl.constexpr):
    if HAS_CW:
        w = tl.load(cw_ptr + tl.minimum(tl.maximum(t, 0), V - 1), mask=valid, other=0.0).to(tl.float32)
        return tl.where(valid, w, 0.0)
    return tl.where(valid, 1.0, 0.0)


@triton.jit
def store_reduced(loss_ptr, acc_loss, acc_w, REDUCTION: tl.constexpr):
    """The end of a one-program loss epilogue: the sum of the per-token losses
    accumulated in ``acc_loss`` (REDUCTION 1, "sum"), or that sum over the sum of the
    weights in ``acc_w`` (2, "mean"), stored at ``loss_ptr``; nothing for 0 ("none")."""
    if REDUCTION == 1:
        tl.store(loss_ptr, tl.sum(acc_loss, 0))
    if REDUCTION == 2:
        tl.store(loss_ptr, tl.sum(acc_loss, 0) / tl.sum(acc_w, 0))


@triton.jit
def ce_forward_epilogue_kernel(
    part_max, part_sum, part_tgt, part_smooth, target_ptr, cw_ptr,
    lse_ptr, loss_ptr, wt_ptr, w_sum_ptr,
    N, V, SPLITS, ignore_index, one_minus_eps, eps_over_v, w_sum, z_loss,
    HAS_SMOOTH: tl.constexpr, HAS_CW: tl.constexpr, HAS_ZLOSS: tl.constexpr,
    REDUCTION: tl.constexpr, BLOCK: tl.constexpr, STEP: tl.constexpr,
):
    """Program i: tokens [i BLOCK, (i+1) BLOCK). Per token: lse = M + log sum_s s_s
    exp(m_s - M), the target logit and smoothing sum over splits (in split order, STEP
    splits' loads at a time), w_t, the loss of ``token_loss``: into loss_ptr per token
    (REDUCTION 0: "none", or a buffer for ``ce_reduce_kernel``), or with REDUCTION 1 / 2
    (the one program: BLOCK covers every token) reduced into loss_ptr as that kernel does."""
    if HAS_SMOOTH and HAS_CW:
        w_sum = tl.load(w_sum_ptr)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < N
    m_safe = splits_max(part_max, offs, ok, N, SPLITS, STEP)
    total = tl.zeros((BLOCK,), tl.float32)
    tgt = tl.zeros((BLOCK,), tl.float32)
    smooth = tl.zeros((BLOCK,), tl.float32)
    for s0 in range(0, SPLITS, STEP):
        for j in tl.static_range(STEP):
            at = (s0 + j) * N + offs
            sk = split_ok(s0 + j, SPLITS, ok)
            m_s = tl.load(part_max + at, mask=sk, other=0.0)
            total += tl.where(sk, tl.load(part_sum + at, mask=sk, other=0.0) * tl.exp(m_s - m_safe), 0.0)
            tgt += tl.load(part_tgt + at, mask=sk, other=0.0)
            if HAS_SMOOTH:
                smooth += tl.load(part_smooth + at, mask=sk, other=0.0)
    lse = m_safe + tl.log(total)
    t = tl.load(target_ptr + offs, mask=ok, other=ignore_index)
    valid = t != ignore_index
    in_range = (t >= 0) & (t < V)
    w_t = _target_weight(t, valid, cw_ptr, V, HAS_CW)
    loss = one_minus_eps * w_t * (lse - tgt)
    if HAS_SMOOTH:
        loss = loss + eps_over_v * (w_sum * lse - smooth)
    if HAS_ZLOSS:
        loss = loss + z_loss * lse * lse
    loss = tl.where(valid, loss, 0.0)
    loss = tl.where(valid & ~in_range, float("nan"), loss)
    tl.store(lse_ptr + offs, lse, mask=ok)
    tl.store(wt_ptr + offs, w_t, mask=ok)
    if REDUCTION == 0:
        tl.store(loss_ptr + offs, loss, mask=ok)
    else:  # (w_t is 0 past N: ignore_index there)
        store_reduced(loss_ptr, tl.where(ok, loss, 0.0), w_t, REDUCTION)


@triton.jit
def ce_reduce_kernel(tok_loss_ptr, wt_ptr, loss_ptr, N, REDUCTION: tl.constexpr, BLOCK: tl.constexpr):
    """One program: the per-token losses summed ("sum", REDUCTION 1) or over the sum of
    w_t ("mean", 2), BLOCK lanes accumulated in token order then added (``store_reduced``)."""
    acc_loss = tl.zeros((BLOCK,), tl.float32)
    acc_w = tl.zeros((BLOCK,), tl.float32)
    for n0 in range(0, N, BLOCK):
        offs = n0 + tl.arange(0, BLOCK)
        ok = offs < N
        acc_loss += tl.load(tok_loss_ptr + offs, mask=ok, other=0.0)
        acc_w += tl.load(wt_ptr + offs, mask=ok, other=0.0)
    store_reduced(loss_ptr, acc_loss, acc_w, REDUCTION)


@triton.jit
def ce_grad_coefficients_kernel(
    grad_loss_ptr, grad_loss_stride, grad_lse_ptr, grad_lse_stride, lse_ptr, wt_ptr, target_ptr,
    cw_ptr, w_sum_ptr, coef_ptr,
    N, V, ignore_index, one_minus_eps, eps_over_v, smooth_a, two_z_loss,
    HAS_SMOOTH: tl.constexpr, HAS_CW: tl.constexpr, HAS_ZLOSS: tl.constexpr, HAS_GRAD_LSE: tl.constexpr,
    REDUCTION: tl.constexpr, BLOCK: tl.constexpr,
):
    """One program. g = grad (per token: "none"), grad ("sum"), grad / sum w_t ("mean");
    A = g ((1 - eps) w_t + (eps / V) W + 2 z lse), B = g (1 - eps) w_t, C = g eps / V,
    zero at ignored tokens, NaN out of range; A += grad of lse (at every token)."""
    if REDUCTION != 0:
        g_all = tl.load(grad_loss_ptr).to(tl.float32)
        if REDUCTION == 2:
            acc = tl.zeros((BLOCK,), tl.float32)
            for n0 in range(0, N, BLOCK):
                offs = n0 + tl.arange(0, BLOCK)
                acc += tl.load(wt_ptr + offs, mask=offs < N, other=0.0)
            g_all = g_all / tl.sum(acc, 0)
    if HAS_SMOOTH and HAS_CW:
        smooth_a = eps_over_v * tl.load(w_sum_ptr)
    for n0 in range(0, N, BLOCK):
        offs = n0 + tl.arange(0, BLOCK)
        ok = offs < N
        if REDUCTION == 0:
            g = tl.load(grad_loss_ptr + offs * grad_loss_stride, mask=ok, other=0.0).to(tl.float32)
        else:
            g = g_all
        t = tl.load(target_ptr + offs, mask=ok, other=ignore_index)
        valid = t != ignore_index
        in_range = (t >= 0) & (t < V)
        w_t = _target_weight(t, valid, cw_ptr, V, HAS_CW)
        b = one_minus_eps * w_t
        a = b
        if HAS_SMOOTH:
            a = a + smooth_a
        if HAS_ZLOSS:
            a = a + two_z_loss * tl.load(lse_ptr + offs, mask=ok, other=0.0)
        c = tl.zeros((BLOCK,), tl.float32) + eps_over_v
        bad = valid & ~in_range
        a = tl.where(bad, float("nan"), tl.where(valid, a * g, 0.0))
        b = tl.where(bad, float("nan"), tl.where(valid, b * g, 0.0))
        c = tl.where(bad, float("nan"), tl.where(valid, c * g, 0.0))
        if HAS_GRAD_LSE:
            a += tl.load(grad_lse_ptr + offs * grad_lse_stride, mask=ok, other=0.0).to(tl.float32)
        tl.store(coef_ptr + offs, a, mask=ok)
        tl.store(coef_ptr + N + offs, b, mask=ok)
        tl.store(coef_ptr + 2 * N + offs, c, mask=ok)


def _scalars(opts: CrossEntropyOptions, num_classes: int, class_weight: Optional[Tensor]):
    eps = opts.label_smoothing
    # W = sum_c w_c with class weights and label smoothing: the formulas' own sum (one
    # small torch reduction, in that case only), so that the loss stays bitwise theirs.
    w_sum = _class_weight_sum(class_weight, num_classes) if eps > 0.0 and class_weight is not None else None
    return dict(one_minus_eps=1.0 - eps, eps_over_v=eps / num_classes, w_sum=w_sum,
                has_smooth=eps > 0.0, has_cw=class_weight is not None, has_z=opts.z_loss != 0.0)


def forward_loss(part_max: Tensor, part_sum: Tensor, part_tgt: Tensor, part_smooth: Optional[Tensor],
                 target: Tensor, class_weight: Optional[Tensor], opts: CrossEntropyOptions,
                 num_classes: int) -> tuple[Tensor, Tensor, Tensor]:
    """(lse (N,), loss (() or (N,) for "none"), w_t (N,)), fp32, from (S, N) fp32 partial
    statistics (max, sum of exp(z - max), target logit, smoothing sum: None unless
    label smoothing) of N > 0 tokens: one launch up to ``BLOCK`` tokens; past them a grid
    over tokens, and a second launch that reduces the loss unless "none"."""
    splits, n = part_max.shape
    sc = _scalars(opts, num_classes, class_weight)
    target = target.contiguous()  # (no copy when contiguous, as from the public functions)
    class_weight = class_weight.contiguous() if class_weight is not None else None
    lse = torch.empty(n, dtype=torch.float32, device=part_max.device)
    w_t = torch.empty_like(lse)
    reduction = REDUCTIONS[opts.reduction]
    one = n <= BLOCK  # one program (reducing the loss itself), else a grid and ce_reduce_kernel
    loss = lse.new_empty(()) if reduction and one else torch.empty_like(lse)
    launch.run_kernel(
        ce_forward_epilogue_kernel, (1 if one else launch.cdiv(n, TOKENS),),
        part_max, part_sum, part_tgt, part_smooth if part_smooth is not None else part_max, target,
        class_weight if class_weight is not None else part_max, lse, loss, w_t,
        sc["w_sum"] if sc["w_sum"] is not None else lse,
        n, num_classes, splits, opts.ignore_index, sc["one_minus_eps"], sc["eps_over_v"], float(num_classes),
        float(opts.z_loss), HAS_SMOOTH=sc["has_smooth"], HAS_CW=sc["has_cw"], HAS_ZLOSS=sc["has_z"],
        REDUCTION=reduction if one else 0, BLOCK=BLOCK if one else TOKENS, STEP=SPLIT_STEP, num_warps=4,
        enable_fp_fusion=False,
    )
    if reduction and not one:
        tok_loss, loss = loss, lse.new_empty(())
        launch.run_kernel(ce_reduce_kernel, (1,), tok_loss, w_t, loss, n, REDUCTION=reduction, BLOCK=BLOCK,
                          num_warps=4, enable_fp_fusion=False)
    return lse, loss, w_t


def grad_coefficients(grad_loss: Tensor, grad_lse: Optional[Tensor], lse: Tensor, w_t: Tensor, target: Tensor,
                      class_weight: Optional[Tensor], opts: CrossEntropyOptions, num_classes: int) -> Tensor:
    """The (3, N) fp32 A, B, C of ``formulas.cross_entropy.grad_coefficients`` for the
    gradient ``grad_loss`` of the reduced loss (() or (N,) with "none"; any strides) and
    an optional gradient of lse (N,): one launch. ``w_t``: the forward's (fp32)."""
    n = lse.shape[0]
    sc = _scalars(opts, num_classes, class_weight)
    lse, w_t, target = lse.contiguous(), w_t.contiguous(), target.contiguous()
    class_weight = class_weight.contiguous() if class_weight is not None else None
    coef = torch.empty(3, n, dtype=torch.float32, device=lse.device)
    reduction = REDUCTIONS[opts.reduction]
    grad_loss = grad_loss.reshape(-1) if reduction == 0 else grad_loss
    launch.run_kernel(
        ce_grad_coefficients_kernel, (1,),
        grad_loss, grad_loss.stride(0) if reduction == 0 else 0,
        grad_lse if grad_lse is not None else lse, grad_lse.stride(0) if grad_lse is not None else 0,
        lse, w_t, target, class_weight if class_weight is not None else lse,
        sc["w_sum"] if sc["w_sum"] is not None else lse, coef,
        n, num_classes, opts.ignore_index, sc["one_minus_eps"], sc["eps_over_v"],
        sc["eps_over_v"] * float(num_classes), 2.0 * opts.z_loss,
        HAS_SMOOTH=sc["has_smooth"], HAS_CW=sc["has_cw"], HAS_ZLOSS=sc["has_z"],
        HAS_GRAD_LSE=grad_lse is not None, REDUCTION=reduction, BLOCK=BLOCK, num_warps=4,
        enable_fp_fusion=False,
    )
    return coef
