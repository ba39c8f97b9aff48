"""Helion kernels of linear_jsd: the forward's row statistics, the backward's d(logits).

The math is ``logitless.formulas.jsd``'s (Triton twin: ``triton_lib.jsd_math``); MODE 0 is
0 < beta < 1 (the mixture), 1 beta == 0 (forward KL, lm := lp), 2 beta == 1 (reverse KL,
lm := lq).
- ``jsd_row_stats``: the (6, rows) statistics of ``formulas.jsd`` (LSE_S, LSE_T, S, K,
  LSE1, ZTGT) of a chunk of rows of both heads' fp32 logits (bias added; cuBLAS wrote
  them: ``linear_jsd.jsd_forward``), soft-capped here. Per row tile, a first sweep over
  vocabulary tiles (online lse of a = zs / T and b = zt / T, and with the hard-label term
  lse(zs) and zs[target]), then a second sweep (the mixture needs both lse first) for
  S = sum p (lp - lm) and K = sum q (lq - lm): both read the rows, no GEMM (memory-bound).
  The two sweeps are one loop body under ``hl.static_range(2)`` (the same block sizes).
- ``jsd_dlogits``: the student's d(logits) of one vocabulary chunk (the teacher gets no
  gradient): dz = g [ (wp p (lp - lm - S) + [beta == 0] (p - q)) / T + hlw (p1 - [c == t]) ]
  (1 - (zs / s)^2) in the student's dtype, both heads' tiles recomputed; cuBLAS takes it to
  dX, dW, db (``grad_kernels.chunked_backward``). NOT (1 - beta) (p - m) / T (Helion's
  example), which finite differences reject.
"""

from __future__ import annotations

import helion
import helion.language as hl
import torch

from logitless.helion_lib.runtime import kernel_settings
from logitless.helion_lib.tile_math import cap_grad, hit_mask, lse_of, lse_step, mixture_log, softcap

_SETTINGS = kernel_settings()


def both_epilogues(zs, zt, bs, bt, tile_v, cap_s, cap_t, HAS_CAP_S, HAS_CAP_T):
    """Both heads' tiles of x @ W.T plus their biases (when given), soft-capped."""
    if bs is not None:
        zs = zs + bs[tile_v].to(torch.float32).unsqueeze(0)
    if bt is not None:
        zt = zt + bt[tile_v].to(torch.float32).unsqueeze(0)
    if HAS_CAP_S:
        zs = softcap(zs, cap_s)
    if HAS_CAP_T:
        zt = softcap(zt, cap_t)
    return zs, zt


def row_inputs(target, stats, g, tile_n):
    """The per-row inputs of a backward tile: target, lse_s, lse_t, S, lse1 (the forward's
    statistics) and the upstream gradient g of the rows ``tile_n``."""
    return target[tile_n], stats[0, tile_n], stats[1, tile_n], stats[2, tile_n], stats[4, tile_n], g[tile_n]


def dlogits(zs, zt, rows, tile_v, inv_t, cap_s, log_beta, log_1mbeta, wp, hlw, MODE, HAS_HARD, HAS_CAP_S):
    """The student's gradient line of the module docstring on one tile of both heads'
    soft-capped logits (``rows``: ``row_inputs``)."""
    tgt, lse_s, lse_t, s_row, lse1, gr = rows
    lp = zs * inv_t - lse_s.unsqueeze(1)
    lq = zt * inv_t - lse_t.unsqueeze(1)
    p = torch.exp(lp)
    if MODE == 1:
        da = p - torch.exp(lq)
    else:
        lm = mixture_log(lp, lq, log_beta, log_1mbeta, MODE)
        da = wp * torch.where(p == 0.0, 0.0, p * (lp - lm - s_row.unsqueeze(1)))
    dz = da * (gr * inv_t).unsqueeze(1)
    if HAS_HARD:
        p1 = torch.exp(zs - lse1.unsqueeze(1))
        hit = torch.where(hit_mask(tile_v, tgt), 1.0, 0.0)
        dz = dz + (hlw * gr).unsqueeze(1) * (p1 - hit)
    return cap_grad(dz, zs, cap_s, HAS_CAP_S)


@helion.kernel(**_SETTINGS)
def jsd_row_stats(
    zs: torch.Tensor, zt: torch.Tensor, target: torch.Tensor,
    inv_t: float, cap_s: float, cap_t: float, log_beta: float, log_1mbeta: float,
    MODE: hl.constexpr, HAS_HARD: hl.constexpr, HAS_CAP_S: hl.constexpr, HAS_CAP_T: hl.constexpr,
) -> torch.Tensor:
    n, v = zs.size()
    stats = torch.empty([6, n], dtype=torch.float32, device=zs.device)
    for tile_n in hl.tile(n):
        tgt = target[tile_n]
        m_s = hl.full([tile_n], float("-inf"), dtype=torch.float32)
        s_s = hl.zeros([tile_n], dtype=torch.float32)
        m_t = hl.full([tile_n], float("-inf"), dtype=torch.float32)
        s_t = hl.zeros([tile_n], dtype=torch.float32)
        m_1 = hl.full([tile_n], float("-inf"), dtype=torch.float32)
        s_1 = hl.zeros([tile_n], dtype=torch.float32)
        ztgt = hl.zeros([tile_n], dtype=torch.float32)
        lse_s = hl.zeros([tile_n], dtype=torch.float32)
        lse_t = hl.zeros([tile_n], dtype=torch.float32)
        s_row = hl.zeros([tile_n], dtype=torch.float32)
        k_row = hl.zeros([tile_n], dtype=torch.float32)
        # one sweep body, unrolled twice at compile time (the same tiles in both sweeps)
        for sweep in hl.static_range(2):
            for tile_v in hl.tile(v):
                col_ok = (tile_v.index < v)[None, :]
                a_s = zs[tile_n, tile_v].to(torch.float32)
                b_t = zt[tile_n, tile_v].to(torch.float32)
                if HAS_CAP_S:
                    a_s = softcap(a_s, cap_s)
                if HAS_CAP_T:
                    b_t = softcap(b_t, cap_t)
                z1 = torch.where(col_ok, a_s, float("-inf"))
                a = z1 * inv_t
                b = torch.where(col_ok, b_t * inv_t, float("-inf"))
                if sweep == 0:  # online lse of both heads (and of the hard-label logits)
                    m_s, s_s = lse_step(m_s, s_s, a, torch.amax(a, dim=1))
                    m_t, s_t = lse_step(m_t, s_t, b, torch.amax(b, dim=1))
                    if HAS_HARD:
                        m_1, s_1 = lse_step(m_1, s_1, z1, torch.amax(z1, dim=1))
                        ztgt = ztgt + torch.sum(torch.where(hit_mask(tile_v, tgt), z1, 0.0), dim=1)
                else:  # S and K against both lse
                    lp = a - lse_s[:, None]
                    lq = b - lse_t[:, None]
                    lm = mixture_log(lp, lq, log_beta, log_1mbeta, MODE)
                    p = torch.exp(lp)
                    q = torch.exp(lq)
                    s_row = s_row + torch.sum(torch.where(p == 0.0, 0.0, p * (lp - lm)), dim=1)
                    k_row = k_row + torch.sum(torch.where(q == 0.0, 0.0, q * (lq - lm)), dim=1)
            if sweep == 0:
                lse_s = lse_of(m_s, s_s)
                lse_t = lse_of(m_t, s_t)
        stats[0, tile_n] = lse_s
        stats[1, tile_n] = lse_t
        stats[2, tile_n] = s_row
        stats[3, tile_n] = k_row
        if HAS_HARD:
            stats[4, tile_n] = lse_of(m_1, s_1)
            stats[5, tile_n] = ztgt
        else:
            stats[4, tile_n] = hl.zeros([tile_n], dtype=torch.float32)
            stats[5, tile_n] = hl.zeros([tile_n], dtype=torch.float32)
    return stats


@helion.kernel(**_SETTINGS)
def jsd_dlogits(
    xs: torch.Tensor, ws: torch.Tensor, bs: torch.Tensor | None,
    xt: torch.Tensor, wt: torch.Tensor, bt: torch.Tensor | None, target: torch.Tensor,
    stats: torch.Tensor, g: torch.Tensor,
    inv_t: float, cap_s: float, cap_t: float, log_beta: float, log_1mbeta: float, wp: float, hlw: float,
    MODE: hl.constexpr, HAS_HARD: hl.constexpr, HAS_CAP_S: hl.constexpr, HAS_CAP_T: hl.constexpr,
) -> torch.Tensor:
    n, hs = xs.size()
    ht = xt.size(1)
    v = ws.size(0)
    dz = torch.empty([n, v], dtype=xs.dtype, device=xs.device)
    for tile_n, tile_v in hl.tile([n, v]):
        rows = row_inputs(target, stats, g, tile_n)
        zs = hl.zeros([tile_n, tile_v], dtype=torch.float32)
        for tile_h in hl.tile(hs):
            zs = hl.dot(xs[tile_n, tile_h], ws[tile_v, tile_h].T, acc=zs)
        zt = hl.zeros([tile_n, tile_v], dtype=torch.float32)
        for tile_g in hl.tile(ht):
            zt = hl.dot(xt[tile_n, tile_g], wt[tile_v, tile_g].T, acc=zt)
        zs, zt = both_epilogues(zs, zt, bs, bt, tile_v, cap_s, cap_t, HAS_CAP_S, HAS_CAP_T)
        dz[tile_n, tile_v] = dlogits(zs, zt, rows, tile_v, inv_t, cap_s, log_beta, log_1mbeta, wp, hlw, MODE,
                                     HAS_HARD, HAS_CAP_S).to(dz.dtype)
    return dz
