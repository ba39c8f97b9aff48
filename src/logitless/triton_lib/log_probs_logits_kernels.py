"""Triton kernels of log_probs on logits the caller holds. Bandwidth-bound: the forward
reads the logits once, the backward reads them once and writes d(logits) once;
everything else is O(N). Logits are addressed through their strides with 64-bit offsets.
The math is ``formulas.log_probs`` (Triton twin ``triton_lib.log_probs_math``)."""

import triton
import triton.language as tl

from logitless.triton_lib.ce_math import load_row_coefficients, logits_tile, softcap_tile, target_rows
from logitless.triton_lib.log_probs_math import logp_dz_tile, online_entropy_update


@triton.jit
def lp_forward_kernel(
    z_ptr, token_ptr, lse_ptr, tgt_ptr, ent_ptr,
    N, V, stride_n, stride_v, softcap, inv_temp,
    HAS_SOFTCAP: tl.constexpr, ENTROPY: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """Per-row lse, a at the token and (ENTROPY) the entropy of softmax(a), a =
    softcap(z) / T, in one streaming pass with the next tile's load in flight.
    Writes O(N) fp32 outputs; a token out of range reads 0 (the formulas make it NaN)."""
    offs_n, row_ok, rows, cols, t_ok, z_t = target_rows(z_ptr, token_ptr, N, V, stride_n, stride_v, BLOCK_N, BLOCK_V)
    if HAS_SOFTCAP:
        z_t = softcap_tile(z_t, softcap)
    a_t = tl.where(t_ok, z_t * inv_temp, 0.0)

    m = tl.full((BLOCK_N,), float("-inf"), tl.float32)
    s = tl.zeros((BLOCK_N,), tl.float32)
    u = tl.zeros((BLOCK_N,), tl.float32)
    z_next = tl.load(rows + cols[None, :] * stride_v, mask=row_ok[:, None] & (cols < V)[None, :],
                     other=float("-inf"))
    for v0 in range(0, V, BLOCK_V):
        col_ok = (v0 + cols) < V
        z = z_next.to(tl.float32)
        nxt = v0 + BLOCK_V + cols
        z_next = tl.load(rows + nxt[None, :] * stride_v, mask=row_ok[:, None] & (nxt < V)[None, :],
                         other=float("-inf"))
        if HAS_SOFTCAP:
            z = softcap_tile(z, softcap)
        a = tl.where(col_ok[None, :], z * inv_temp, float("-inf"))
        m, s, u, _, _ = online_entropy_update(a, m, s, u, ENTROPY)

    m_safe = tl.where(m == float("-inf"), 0.0, m)
    log_s = tl.log(s)
    tl.store(lse_ptr + offs_n, m_safe + log_s, mask=row_ok)
    tl.store(tgt_ptr + offs_n, a_t, mask=row_ok)
    if ENTROPY:
        tl.store(ent_ptr + offs_n, log_s - u / s, mask=row_ok)


@triton.jit
def lp_backward_kernel(
    z_ptr, dz_ptr, token_ptr, lse_ptr, coef_ptr,
    N, V, stride_zn, stride_zv, stride_dn, stride_dv, softcap, inv_temp,
    HAS_SOFTCAP: tl.constexpr, ENTROPY: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """d / d logits for one BLOCK_N x BLOCK_V tile: log p = a - lse, dz = p (A + C log p)
    - B [j == t] (times the soft-cap factor). One read of z, one write of dz."""
    z, offs_n, offs_v, row_ok, mask, rows, cols = logits_tile(z_ptr, N, V, stride_zn, stride_zv, softcap,
                                                              HAS_SOFTCAP, BLOCK_N, BLOCK_V)
    lse, ca, cb, cc, token = load_row_coefficients(lse_ptr, coef_ptr, token_ptr, offs_n, row_ok, N)
    logp = z * inv_temp - lse[:, None]
    p = tl.exp(logp)
    dz = logp_dz_tile(p, logp, lse, offs_v, token, ca, cb, cc, softcap, 1.0 / inv_temp, HAS_SOFTCAP, ENTROPY)
    tl.store(dz_ptr + rows * stride_dn + cols * stride_dv, dz.to(dz_ptr.dtype.element_ty), mask=mask)
