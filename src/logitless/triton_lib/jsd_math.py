"""The Triton form of ``formulas.jsd``'s per-element formulas, shared by the jsd and
linear_jsd kernels (the twin of ``ce_math`` for cross-entropy).

MODE (a constexpr) picks the divergence: 0 for 0 < beta < 1 (the mixture), 1 for
beta == 0 (forward KL, lm := lp), 2 for beta == 1 (reverse KL, lm := lq).
"""

import triton
import triton.language as tl

from logitless.triton_lib.ce_math import online_lse_update

#: The smallest normal fp32: the mixture's floor before its log (never 0 or subnormal).
FLT_MIN = tl.constexpr(1.1754943508222875e-38)


@triton.jit
def log_mixture(lp, lq, p, q, log_beta, log_1mbeta, MODE: tl.constexpr):
    """lm = log(beta q + (1 - beta) p) (lp for MODE 1, lq for MODE 2; p, q unused there).

    MODE 0 from the probabilities p = e^lp, q = e^lq that every caller needs anyway: in
    [0, 1] they cannot overflow, so one log (3 MUFU ops per element with the two exp,
    where a log-add-exp of lp, lq took 5). The sum is clamped at FLT_MIN: it only acts
    where both underflow (both masked: -inf logits), where the callers' terms p (lp - lm)
    and q (lq - lm) are 0 (masked) or below 1e-36 (docs/design.md,
    "Distillation: linear_jsd")."""
    if MODE == 1:
        return lp
    elif MODE == 2:
        return lq
    else:
        mix = tl.exp(log_1mbeta) * p + tl.exp(log_beta) * q
        return tl.log(tl.maximum(mix, FLT_MIN, propagate_nan=tl.PropagateNan.ALL))  # NaN stays NaN


@triton.jit
def stats_init(BLOCK_N: tl.constexpr):
    """The running statistics of ``stats_update`` before any column: maxima -inf, sums 0.
    Returns (m_s, s_s, m_t, s_t, m_1, s_1, w), each (BLOCK_N,) fp32."""
    neg = float("-inf")
    m = tl.full((BLOCK_N,), neg, tl.float32)
    z = tl.zeros((BLOCK_N,), tl.float32)
    return m, z, m, z, m, z, z


@triton.jit
def stats_update(zs, a, b, m_s, s_s, m_t, s_t, m_1, s_1, w, MODE: tl.constexpr, HAS_HARD: tl.constexpr):
    """One online step of the row statistics' first sweep over a (BLOCK_N, BLOCK_V) tile:
    zs the student's soft-capped fp32 logits, a = zs / T and b the teacher's at
    temperature T (-inf where masked). Updates the running max and sum of exponentials
    of both heads at T (m_s, s_s, m_t, s_t), of the student at T = 1 (m_1, s_1;
    HAS_HARD) and, for the KL limits, the divergence sum w rescaled by the weighting
    head's max (MODE 1: sum e^(b - m_t) (b - a); MODE 2: sum e^(a - m_s) (a - b)).
    Returns the updated (m_s, s_s, m_t, s_t, m_1, s_1, w)."""
    m_s_old = m_s
    m_t_old = m_t
    m_s, s_s, e_s, ms_safe, _ = online_lse_update(a, m_s, s_s)
    m_t, s_t, e_t, mt_safe, _ = online_lse_update(b, m_t, s_t)
    if MODE == 1:  # forward KL: K = E_q[b - a] - lse(b) + lse(a), one sweep
        w = w * tl.exp(m_t_old - mt_safe) + tl.sum(tl.where(e_t == 0.0, 0.0, e_t * (b - a)), 1)
    if MODE == 2:  # reverse KL: S = E_p[a - b] - lse(a) + lse(b), one sweep
        w = w * tl.exp(m_s_old - ms_safe) + tl.sum(tl.where(e_s == 0.0, 0.0, e_s * (a - b)), 1)
    if HAS_HARD:
        m_1, s_1, _, _, _ = online_lse_update(zs, m_1, s_1)
    return m_s, s_s, m_t, s_t, m_1, s_1, w


@triton.jit
def plogratio(p, lp, lm):
    """p * (lp - lm), 0 where p == 0 (NaN stays NaN)."""
    return tl.where(p == 0.0, 0.0, p * (lp - lm))


@triton.jit
def jsd_dz_tile(zs, zt, offs_v, target, lse_s, lse_t, s_row, lse1, g,
                inv_t, wp, hlw, log_beta, log_1mbeta, softcap_s,
                MODE: tl.constexpr, HAS_HARD: tl.constexpr, HAS_SOFTCAP: tl.constexpr):
    """d loss / d pre-cap student logits of a (BLOCK_N, BLOCK_V) tile (``formulas.jsd``):

        dz = g [ (wp p (lp - lm - S) + [beta == 0] (p - q)) / T + hlw (p1 - [c == t]) ]
             * (1 - (zs / s)^2)

    zs, zt: soft-capped fp32 logits; per row: target, lse_s, lse_t, S, lse1, g."""
    lp = zs * inv_t - lse_s[:, None]
    lq = zt * inv_t - lse_t[:, None]
    p = tl.exp(lp)
    if MODE == 1:
        da = p - tl.exp(lq)
    elif MODE == 2:
        da = wp * tl.where(p == 0.0, 0.0, p * (lp - lq - s_row[:, None]))
    else:
        lm = log_mixture(lp, lq, p, tl.exp(lq), log_beta, log_1mbeta, MODE)
        da = wp * tl.where(p == 0.0, 0.0, p * (lp - lm - s_row[:, None]))
    dz = da * (g * inv_t)[:, None]
    if HAS_HARD:
        p1 = tl.exp(zs - lse1[:, None])
        hit = tl.where(offs_v[None, :] == target[:, None], 1.0, 0.0)
        dz += (hlw * g)[:, None] * (p1 - hit)
    if HAS_SOFTCAP:
        c = zs / softcap_s
        dz *= 1.0 - c * c
    return dz


@triton.jit
def load_jsd_row_stats(stats_ptr, g_ptr, target_ptr, offs_n, row_ok, N):
    """Per-row inputs of ``jsd_dz_tile`` from the (6, N) statistics (rows lse_s, lse_t,
    S, K, lse1, z_target), the upstream gradient g (0 at ignored tokens) and target."""
    lse_s = tl.load(stats_ptr + offs_n, mask=row_ok, other=0.0)
    lse_t = tl.load(stats_ptr + N + offs_n, mask=row_ok, other=0.0)
    s_row = tl.load(stats_ptr + 2 * N + offs_n, mask=row_ok, other=0.0)
    lse1 = tl.load(stats_ptr + 4 * N + offs_n, mask=row_ok, other=0.0)
    g = tl.load(g_ptr + offs_n, mask=row_ok, other=0.0)
    target = tl.load(target_ptr + offs_n, mask=row_ok, other=-1)
    return lse_s, lse_t, s_row, lse1, g, target
