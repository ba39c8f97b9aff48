"""The O(tokens) epilogues of the log-prob ops as one Triton launch each (as
``ce_epilogue`` for cross-entropy: small shapes are host-bound, and the torch form was
~40 tiny kernels per forward+backward).

``forward_outputs``: the vocabulary splits' partial statistics (S, N) -> logp, entropy
(or None) and lse: ``formulas.log_probs.merge_splits`` then ``token_outputs`` (0 at
ignored tokens, NaN at tokens out of range).

``grad_coefficients``: the gradients of logp and entropy (either may be None) -> the
(3, N) A, B, C of ``formulas.log_probs.grad_coefficients``.

The torch formulas stay the spec; tests compare these launches with them on random
statistics. Per-token work only: programs over blocks of tokens, no atomics, no host
sync, the same launches every call. Memory traffic: the O(S * N) inputs read once,
O(N) written. Per-token values use the formulas' operations in the same order with
contraction off (``enable_fp_fusion=False``): A, B, C are bitwise the formulas'; logp
and entropy too given the same lse and entropy sums, which use Triton's exp/log (a few
ulp from torch's on the GPU) and, with S > 1 splits, a sequential sum over splits
(``ce_math.SPLIT_STEP`` splits' loads in flight at a time).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from logitless.options import LogProbOptions
from logitless.triton_lib import launch
from logitless.triton_lib.ce_math import SPLIT_STEP, split_ok
from logitless.triton_lib.log_probs_math import epilogue_block, merge_split, token_value

BLOCK = 1024
#: Tokens per program of the forward's merge over splits (``ce_math.SPLIT_STEP`` splits'
#: loads in flight per token: BLOCK would spill registers on sm_90).
TOKENS = 256


@triton.jit
def logp_forward_epilogue_kernel(
    part_max, part_sum, part_u, part_tgt, tokens_ptr, logp_ptr, ent_ptr, lse_ptr,
    N, V, SPLITS, ignore_index, ENTROPY: tl.constexpr, BLOCK: tl.constexpr, STEP: tl.constexpr,
):
    offs, ok, m_safe, t, valid, bad = epilogue_block(part_max, tokens_ptr, N, V, SPLITS, ignore_index, BLOCK)
    total = tl.zeros((BLOCK,), tl.float32)
    u = tl.zeros((BLOCK,), tl.float32)
    tgt = tl.zeros((BLOCK,), tl.float32)
    for s0 in range(0, SPLITS, STEP):  # (in split order, STEP splits' loads in flight)
        for j in tl.static_range(STEP):
            sk = split_ok(s0 + j, SPLITS, ok)
            total, d, scale, ps = merge_split(part_max, part_sum, s0 + j, N, offs, sk, m_safe, total)
            tgt += tl.load(part_tgt + (s0 + j) * N + offs, mask=sk, other=0.0)
            if ENTROPY:
                corr = tl.where(ps > 0, d * ps, 0.0)
                u += tl.where(sk, scale * (tl.load(part_u + (s0 + j) * N + offs, mask=sk, other=0.0) + corr), 0.0)
    log_s = tl.log(total)
    lse = m_safe + log_s
    tl.store(logp_ptr + offs, token_value(tgt - lse, valid, bad), mask=ok)
    tl.store(lse_ptr + offs, lse, mask=ok)
    if ENTROPY:
        tl.store(ent_ptr + offs, token_value(log_s - u / total, valid, bad), mask=ok)


@triton.jit
def logp_grad_coefficients_kernel(
    g_lp_ptr, g_lp_stride, g_h_ptr, g_h_stride, ent_ptr, tokens_ptr, coef_ptr,
    N, V, ignore_index, inv_t,
    HAS_G_LP: tl.constexpr, HAS_G_H: tl.constexpr, BLOCK: tl.constexpr,
):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < N
    if HAS_G_LP:
        g_lp = tl.load(g_lp_ptr + offs * g_lp_stride, mask=ok, other=0.0).to(tl.float32)
    else:
        g_lp = tl.zeros((BLOCK,), tl.float32)
    if HAS_G_H:
        g_h = tl.load(g_h_ptr + offs * g_h_stride, mask=ok, other=0.0).to(tl.float32)
        a = -(g_lp + g_h * tl.load(ent_ptr + offs, mask=ok, other=0.0)) * inv_t
        c = -g_h * inv_t
    else:
        a = -g_lp * inv_t
        c = tl.zeros((BLOCK,), tl.float32)
    b = -g_lp * inv_t
    t = tl.load(tokens_ptr + offs, mask=ok, other=ignore_index)
    valid = t != ignore_index
    bad = valid & ((t < 0) | (t >= V))
    tl.store(coef_ptr + offs, token_value(a, valid, bad), mask=ok)
    tl.store(coef_ptr + N + offs, token_value(b, valid, bad), mask=ok)
    tl.store(coef_ptr + 2 * N + offs, token_value(c, valid, bad), mask=ok)


def forward_outputs(part_max: Tensor, part_sum: Tensor, part_u: Optional[Tensor], part_tgt: Tensor,
                    tokens: Tensor, opts: LogProbOptions, num_classes: int):
    """(logp, entropy or None, lse), fp32 (N,), from (S, N) fp32 partial statistics (max,
    sum, u: None without entropy, target logit) of N > 0 tokens: one launch."""
    splits, n = part_max.shape
    tokens = tokens.contiguous()
    logp = torch.empty(n, dtype=torch.float32, device=part_max.device)
    lse = torch.empty_like(logp)
    ent = torch.empty_like(logp) if opts.entropy else None
    launch.run_kernel(
        logp_forward_epilogue_kernel, (launch.cdiv(n, TOKENS),),
        part_max, part_sum, part_u if part_u is not None else part_max, part_tgt, tokens, logp,
        ent if ent is not None else logp, lse, n, num_classes, splits, opts.ignore_index,
        ENTROPY=opts.entropy, BLOCK=TOKENS, STEP=SPLIT_STEP, num_warps=4, enable_fp_fusion=False,
    )
    return logp, ent, lse


def grad_coefficients(entropy: Optional[Tensor], tokens: Tensor, g_lp: Optional[Tensor], g_h: Optional[Tensor],
                      num_classes: int, opts: LogProbOptions) -> Tensor:
    """(3, N) fp32 A, B, C for the gradients of logp and entropy (None: zero; any strides)
    at N > 0 tokens: one launch."""
    n = tokens.shape[0]
    tokens = tokens.contiguous()
    g_lp = g_lp.reshape(-1) if g_lp is not None else None
    has_h = g_h is not None and entropy is not None
    g_h = g_h.reshape(-1) if has_h else None
    coef = torch.empty(3, n, dtype=torch.float32, device=tokens.device)
    launch.run_kernel(
        logp_grad_coefficients_kernel, (launch.cdiv(n, BLOCK),),
        g_lp if g_lp is not None else coef, g_lp.stride(0) if g_lp is not None else 0,
        g_h if has_h else coef, g_h.stride(0) if has_h else 0,
        entropy.contiguous() if has_h else coef, tokens, coef, n, num_classes, opts.ignore_index,
        1.0 / opts.temperature, HAS_G_LP=g_lp is not None, HAS_G_H=has_h, BLOCK=BLOCK, num_warps=4,
        enable_fp_fusion=False,
    )
    return coef
