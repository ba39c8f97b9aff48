"""Device helpers of the Helion kernels: the math on one tile, written once.

Plain functions of torch ops that the kernels call inside their ``hl.tile`` loops;
Helion traces them into the kernel (in its ref mode they run eagerly). Two rules of
Helion 1.5 shape them: a helper holds no device loop (``hl.tile``; pytorch/helion#865),
so each kernel keeps its own K loop of ``hl.dot``; and a helper broadcasts with
``unsqueeze``, not ``t[:, None]`` (a slice in a helper fails to lower). Tile indices
(``bias[tile_v]``, ``coef[0, tile_n]``) load as in the kernel body.
"""

from __future__ import annotations

import torch


def softcap(z, cap):
    """cap * tanh(z / cap), as 1 - 2 / (e^(2z/cap) + 1) (no tanh in Helion's lowering)."""
    return cap * (1.0 - 2.0 / (torch.exp(2.0 * z / cap) + 1.0))


def logits_epilogue(z, bias, tile_v, cap, HAS_CAP):
    """A tile of x @ W.T (fp32) plus the bias (when given), soft-capped (HAS_CAP)."""
    if bias is not None:
        z = z + bias[tile_v].to(torch.float32).unsqueeze(0)
    if HAS_CAP:
        z = softcap(z, cap)
    return z


def cap_grad(dz, z, cap, HAS_CAP):
    """d/d(pre-cap logit) from d/dz of the soft-capped z: times 1 - (z / cap)^2."""
    if HAS_CAP:
        capped = z / cap
        dz = dz * (1.0 - capped * capped)
    return dz


def finite_max(m):
    """The running max with -inf (an empty or all -inf row) replaced by 0."""
    return torch.where(m == float("-inf"), 0.0, m)


def lse_step(m, s, a, a_max):
    """One tile of an online log-sum-exp: (max, sum of e^(a - max)) of the rows so far and
    the tile ``a`` (rows x columns) with its row max ``a_max`` -> the new (max, sum)."""
    m_new = torch.maximum(m, a_max)
    m_safe = finite_max(m_new)
    return m_new, s * torch.exp(m - m_safe) + torch.sum(torch.exp(a - m_safe.unsqueeze(1)), dim=1)


def lse_of(m, s):
    """The log-sum-exp of the online (max, sum)."""
    return finite_max(m) + torch.log(s)


def mixture_log(lp, lq, log_beta, log_1mbeta, MODE):
    """log m of linear_jsd's mixture: lp (MODE 1, forward KL), lq (MODE 2, reverse KL),
    else log((1 - beta) p + beta q) from lp = log p, lq = log q."""
    if MODE == 1:
        return lp
    if MODE == 2:
        return lq
    u1 = lp + log_1mbeta
    u2 = lq + log_beta
    mx = finite_max(torch.maximum(u1, u2))
    return mx + torch.log(torch.exp(u1 - mx) + torch.exp(u2 - mx))


def row_coefficients(target, lse, coef, tile_n):
    """The per-row inputs of a backward tile: target (or token), lse and the (A, B, C)
    gradient coefficients of the rows ``tile_n``."""
    return target[tile_n], lse[tile_n], coef[0, tile_n], coef[1, tile_n], coef[2, tile_n]


def hit_mask(tile_v, t):
    """[column == target] of the rows' targets ``t`` over the columns ``tile_v``."""
    return tile_v.index.unsqueeze(0) == t.unsqueeze(1)
