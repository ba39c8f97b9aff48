"""Row statistics of the distillation loss from full rows of student and teacher logits
(``formulas.jsd``), shared by the jsd op (logits the caller holds) and linear_jsd (fp32
logit chunks written by cuBLAS), and the scalar arguments every JSD kernel takes.
"""

import math

import triton
import triton.language as tl

from logitless.triton_lib.ce_math import online_lse_update, softcap_tile
from logitless.triton_lib.jsd_math import log_mixture, plogratio


def scalar_args(opts) -> dict:
    """The float and constexpr arguments every JSD kernel takes (``_triton_jsd_math``)."""
    beta = opts.beta
    mode = 1 if beta == 0.0 else 2 if beta == 1.0 else 0
    mid = mode == 0
    return dict(
        inv_t=1.0 / opts.temperature,
        log_beta=math.log(beta) if mid else 0.0,
        log_1mbeta=math.log1p(-beta) if mid else 0.0,
        cap_s=float(opts.student_softcap or 1.0),
        cap_t=float(opts.teacher_softcap or 1.0),
        MODE=mode,
        HAS_HARD=opts.hard_label_weight != 0.0,
        HAS_CAP_S=opts.student_softcap is not None,
        HAS_CAP_T=opts.teacher_softcap is not None,
    )


@triton.jit
def load_capped(rows, offs_v, stride_v, row_ok, V, other, cap, HAS_CAP: tl.constexpr):
    """A (BLOCK_N, BLOCK_V) tile in fp32, soft-capped, ``other`` outside the matrix."""
    col_ok = offs_v < V
    z = tl.load(rows + offs_v.to(tl.int64)[None, :] * stride_v,
                mask=row_ok[:, None] & col_ok[None, :], other=other).to(tl.float32)
    if HAS_CAP:
        z = tl.where(col_ok[None, :], softcap_tile(z, cap), other)
    return z


@triton.jit
def jsd_forward_kernel(
    zs_ptr, zt_ptr, target_ptr, stats_ptr,
    N, V, stride_sn, stride_sv, stride_tn, stride_tv,
    inv_t, log_beta, log_1mbeta, cap_s, cap_t,
    MODE: tl.constexpr, HAS_HARD: tl.constexpr, HAS_CAP_S: tl.constexpr, HAS_CAP_T: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """Row statistics (6, N) of ``_jsd_math``: lse(zs/T), lse(zt/T), S = sum p (lp - lm),
    K = sum q (lq - lm), lse(zs) and zs[target] (the last two only with HAS_HARD).

    Program i owns rows [i*BLOCK_N, (i+1)*BLOCK_N). Sweep 1 over the vocabulary: online
    log-sum-exps (fp32); for the KL limits (MODE 1, 2) also the one divergence sum,
    rescaled online like the sum of exponentials. Sweep 2 (0 < beta < 1 only): S and K,
    which need both lse. Traffic: both logits read once (KL) or twice; 6 floats per row.
    """
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = offs_n < N
    rows_s = zs_ptr + offs_n.to(tl.int64)[:, None] * stride_sn
    rows_t = zt_ptr + offs_n.to(tl.int64)[:, None] * stride_tn
    cols = tl.arange(0, BLOCK_V)
    neg = float("-inf")

    m_s = tl.full((BLOCK_N,), neg, tl.float32)
    s_s = tl.zeros((BLOCK_N,), tl.float32)
    m_t = tl.full((BLOCK_N,), neg, tl.float32)
    s_t = tl.zeros((BLOCK_N,), tl.float32)
    m_1 = tl.full((BLOCK_N,), neg, tl.float32)
    s_1 = tl.zeros((BLOCK_N,), tl.float32)
    w = tl.zeros((BLOCK_N,), tl.float32)  # KL limits: sum e^(x - m) (b - a), x the weighting head
    for v0 in range(0, V, BLOCK_V):
        zs = load_capped(rows_s, v0 + cols, stride_sv, row_ok, V, neg, cap_s, HAS_CAP_S)
        a = zs * inv_t
        b = load_capped(rows_t, v0 + cols, stride_tv, row_ok, V, neg, cap_t, HAS_CAP_T) * inv_t
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
    lse_s = tl.where(m_s == neg, 0.0, m_s) + tl.log(s_s)
    lse_t = tl.where(m_t == neg, 0.0, m_t) + tl.log(s_t)

    acc_s = tl.zeros((BLOCK_N,), tl.float32)
    acc_k = tl.zeros((BLOCK_N,), tl.float32)
    if MODE == 1:
        acc_k = w / s_t - lse_t + lse_s
    elif MODE == 2:
        acc_s = w / s_s - lse_s + lse_t
    else:  # the mixture is not an online quantity: a second sweep with both lse known
        for v0 in range(0, V, BLOCK_V):
            a = load_capped(rows_s, v0 + cols, stride_sv, row_ok, V, neg, cap_s, HAS_CAP_S)
            b = load_capped(rows_t, v0 + cols, stride_tv, row_ok, V, neg, cap_t, HAS_CAP_T)
            lp = a * inv_t - lse_s[:, None]
            lq = b * inv_t - lse_t[:, None]
            lm = log_mixture(lp, lq, log_beta, log_1mbeta, MODE)
            acc_s += tl.sum(plogratio(tl.exp(lp), lp, lm), 1)
            acc_k += tl.sum(plogratio(tl.exp(lq), lq, lm), 1)

    tl.store(stats_ptr + offs_n, lse_s, mask=row_ok)
    tl.store(stats_ptr + N + offs_n, lse_t, mask=row_ok)
    tl.store(stats_ptr + 2 * N + offs_n, acc_s, mask=row_ok)
    tl.store(stats_ptr + 3 * N + offs_n, acc_k, mask=row_ok)
    lse1 = tl.zeros((BLOCK_N,), tl.float32)
    z_t = tl.zeros((BLOCK_N,), tl.float32)
    if HAS_HARD:
        lse1 = tl.where(m_1 == neg, 0.0, m_1) + tl.log(s_1)
        target = tl.load(target_ptr + offs_n, mask=row_ok, other=-1)
        t_ok = row_ok & (target >= 0) & (target < V)
        z_t = tl.load(zs_ptr + offs_n.to(tl.int64) * stride_sn + target.to(tl.int64) * stride_sv,
                      mask=t_ok, other=0.0).to(tl.float32)
        if HAS_CAP_S:
            z_t = tl.where(t_ok, softcap_tile(z_t, cap_s), 0.0)
    tl.store(stats_ptr + 4 * N + offs_n, lse1, mask=row_ok)
    tl.store(stats_ptr + 5 * N + offs_n, z_t, mask=row_ok)
