"""The O(tokens) epilogues of linear_jsd as one Triton launch each (the twin of
``ce_epilogue`` for the distillation loss).

``forward_loss``: the (6, N) row statistics -> the loss, reduced ("sum", "mean") or per
token ("none"): ``formulas.jsd.token_loss`` then ``formulas.jsd.reduce``, every option
(beta's three modes through the weights (wq, wp), the hard-label term, ignore_index,
NaN at a non-ignored target outside [0, V) with hard labels).

``upstream``: the gradient of the (reduced) loss -> the per-token upstream gradient g
(N,) fp32 that the dz kernels read: grad (per token for "none"), grad ("sum"), grad /
#non-ignored ("mean"); 0 at ignored tokens (also where grad is inf/NaN), as autograd
through ``reduce`` followed by ``formulas.jsd.upstream`` gives it. Without a gradient
(``grad=None``: gradient-in-forward's unit upstream) grad = 1.

The torch formulas stay the spec; tests compare these launches with them on random
statistics, every option alone and combined. Both kernels run as ONE program looping
over the tokens in blocks: one launch, no atomics, a fixed summation order (bitwise
repeatable), no host sync. Traffic: reads 4 of the 6 statistics rows (2 without hard
labels) and the targets once, writes O(N) (the upstream kernel reads the targets twice
under "mean"). Floating-point contraction is off (``enable_fp_fusion=False``) and the
scalars are the same fp32 values, so the per-token loss and g are bitwise the torch
formulas'; the sums over tokens (the reduced loss) differ from torch's in order only.
The count of "mean" is a sum of ones in fp32: exact below 2**24 tokens.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from logitless.formulas.jsd import K_ROW, LSE1, S_ROW, ZTGT
from logitless.options import JSDOptions
from logitless.triton_lib import launch
from logitless.triton_lib.ce_epilogue import store_reduced

REDUCTIONS = {"none": 0, "sum": 1, "mean": 2}
#: Tokens per step of the one program's loop.
BLOCK = 1024


@triton.jit
def jsd_loss_epilogue_kernel(
    stats_ptr, stride_stat, target_ptr, loss_ptr,
    N, V, ignore_index, wq, wp, hlw,
    K_ROW: tl.constexpr, S_ROW: tl.constexpr, LSE1: tl.constexpr, ZTGT: tl.constexpr,
    HAS_HARD: tl.constexpr, REDUCTION: tl.constexpr, BLOCK: tl.constexpr,
):
    """One program. Per token: loss = wq K + wp S (+ hlw (lse1 - z_target), NaN at a
    non-ignored target out of range), 0 at ignored tokens; then the reduction
    (mean: over the non-ignored tokens, 0/0 = NaN)."""
    acc_loss = tl.zeros((BLOCK,), tl.float32)
    acc_w = tl.zeros((BLOCK,), tl.float32)
    for n0 in range(0, N, BLOCK):
        offs = n0 + tl.arange(0, BLOCK)
        ok = offs < N
        k = tl.load(stats_ptr + K_ROW * stride_stat + offs, mask=ok, other=0.0)
        s = tl.load(stats_ptr + S_ROW * stride_stat + offs, mask=ok, other=0.0)
        loss = wq * k + wp * s
        t = tl.load(target_ptr + offs, mask=ok, other=ignore_index)
        valid = t != ignore_index
        if HAS_HARD:
            lse1 = tl.load(stats_ptr + LSE1 * stride_stat + offs, mask=ok, other=0.0)
            z_t = tl.load(stats_ptr + ZTGT * stride_stat + offs, mask=ok, other=0.0)
            loss = loss + hlw * (lse1 - z_t)
            loss = tl.where(valid & ((t < 0) | (t >= V)), float("nan"), loss)
        loss = tl.where(valid, loss, 0.0)
        if REDUCTION == 0:
            tl.store(loss_ptr + offs, loss, mask=ok)
        else:
            acc_loss += tl.where(ok, loss, 0.0)
            acc_w += tl.where(ok & valid, 1.0, 0.0)
    store_reduced(loss_ptr, acc_loss, acc_w, REDUCTION)


@triton.jit
def jsd_upstream_kernel(
    grad_ptr, grad_stride, target_ptr, g_ptr, N, ignore_index,
    HAS_GRAD: tl.constexpr, REDUCTION: tl.constexpr, BLOCK: tl.constexpr,
):
    """One program. g = grad (per token for "none"), grad ("sum"), grad / #non-ignored
    ("mean"), 1 in place of grad without HAS_GRAD; 0 at ignored tokens."""
    g_all = 1.0
    if REDUCTION != 0:
        if HAS_GRAD:
            g_all = tl.load(grad_ptr).to(tl.float32)
        if REDUCTION == 2:
            acc = tl.zeros((BLOCK,), tl.float32)
            for n0 in range(0, N, BLOCK):
                offs = n0 + tl.arange(0, BLOCK)
                t = tl.load(target_ptr + offs, mask=offs < N, other=ignore_index)
                acc += tl.where(t != ignore_index, 1.0, 0.0)
            g_all = g_all / tl.sum(acc, 0)
    for n0 in range(0, N, BLOCK):
        offs = n0 + tl.arange(0, BLOCK)
        ok = offs < N
        if REDUCTION == 0 and HAS_GRAD:
            g = tl.load(grad_ptr + offs * grad_stride, mask=ok, other=0.0).to(tl.float32)
        else:
            g = tl.zeros((BLOCK,), tl.float32) + g_all
        t = tl.load(target_ptr + offs, mask=ok, other=ignore_index)
        tl.store(g_ptr + offs, tl.where(t != ignore_index, g, 0.0), mask=ok)


def forward_loss(stats: Tensor, target: Tensor, num_classes: int, opts: JSDOptions, reduction: str) -> Tensor:
    """The fp32 loss (() or (N,) for "none") from the (6, N) fp32 statistics (rows may
    be strided; columns contiguous) of N > 0 tokens: one launch."""
    n = stats.shape[1]
    assert stats.dtype == torch.float32 and stats.stride(1) == 1
    wq, wp, _ = opts.weights
    target = target.contiguous()
    loss = stats.new_empty((n,) if reduction == "none" else ())
    launch.run_kernel(
        jsd_loss_epilogue_kernel, (1,),
        stats, stats.stride(0), target, loss, n, num_classes, opts.ignore_index, wq, wp,
        float(opts.hard_label_weight), K_ROW=K_ROW, S_ROW=S_ROW, LSE1=LSE1, ZTGT=ZTGT,
        HAS_HARD=opts.hard_label_weight != 0.0, REDUCTION=REDUCTIONS[reduction], BLOCK=BLOCK,
        num_warps=4, enable_fp_fusion=False,
    )
    return loss


def upstream(grad: Optional[Tensor], target: Tensor, ignore_index: int, reduction: str) -> Tensor:
    """The per-token upstream gradient (N,) fp32 of a gradient ``grad`` of the reduced
    loss (() or (N,) for "none"; any strides and float dtype; None: 1): one launch."""
    n = target.shape[0]
    target = target.contiguous()
    g = torch.empty(n, dtype=torch.float32, device=target.device)
    red = REDUCTIONS[reduction]
    if grad is not None and red == 0:
        grad = grad.reshape(-1)
    if n:
        launch.run_kernel(
            jsd_upstream_kernel, (1,),
            grad if grad is not None else g, grad.stride(0) if grad is not None and red == 0 else 0,
            target, g, n, ignore_index, HAS_GRAD=grad is not None, REDUCTION=red, BLOCK=BLOCK,
            num_warps=4, enable_fp_fusion=False,
        )
    return g
