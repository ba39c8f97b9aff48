"""Helion kernels of linear_log_probs: x @ W.T (+ b) tile by tile, never a logits tile in HBM.

The math is ``logitless.formulas.log_probs``'s (Triton twin: ``triton_lib.log_probs_math``),
with a = softcap(z) / T:
- ``logp_forward``: per row tile, the online (m, s, u) over vocabulary tiles
  (s = sum e^(a - m), u = sum e^(a - m) (a - m), rescaled when m grows) and a at the token;
  lse = m + log s, H = log s - u / s;
- ``logp_dx`` / ``logp_dw``: the recompute, then dz_j = (p_j (A + C log p_j) - B [j == t])
  (1 - (z_j / s)^2) with (A, B, C) from ``formulas.log_probs.grad_coefficients`` (1/T folded
  in), fed into dX (over vocabulary tiles) and dW, db (over row tiles). No atomics.
"""

from __future__ import annotations

import torch

import helion
import helion.language as hl

from logitless.helion_lib.runtime import kernel_settings

_SETTINGS = kernel_settings()


@helion.kernel(**_SETTINGS)
def logp_forward(
    x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, tokens: torch.Tensor,
    softcap: float, inv_t: float, HAS_SOFTCAP: hl.constexpr, ENTROPY: hl.constexpr,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n, h = x.size()
    v = w.size(0)
    lse = torch.empty([n], dtype=torch.float32, device=x.device)
    at_out = torch.empty([n], dtype=torch.float32, device=x.device)
    ent_out = torch.empty([n], dtype=torch.float32, device=x.device)
    for tile_n in hl.tile(n):
        t = tokens[tile_n]
        m = hl.full([tile_n], float("-inf"), dtype=torch.float32)
        s = hl.zeros([tile_n], dtype=torch.float32)
        u = hl.zeros([tile_n], dtype=torch.float32)
        at = hl.zeros([tile_n], dtype=torch.float32)
        for tile_v in hl.tile(v):
            z = hl.zeros([tile_n, tile_v], dtype=torch.float32)
            for tile_h in hl.tile(h):
                z = hl.dot(x[tile_n, tile_h], w[tile_v, tile_h].T, acc=z)
            if bias is not None:
                z = z + bias[tile_v].to(torch.float32)[None, :]
            if HAS_SOFTCAP:
                z = softcap * (1.0 - 2.0 / (torch.exp(2.0 * z / softcap) + 1.0))
            cols = tile_v.index
            a = torch.where((cols < v)[None, :], z * inv_t, float("-inf"))
            m_new = torch.maximum(m, torch.amax(a, dim=1))
            m_safe = torch.where(m_new == float("-inf"), 0.0, m_new)
            d = m - m_safe
            scale = torch.exp(d)
            shifted = a - m_safe[:, None]
            e = torch.exp(shifted)
            if ENTROPY:
                corr = torch.where(s > 0.0, d * s, 0.0)
                u = scale * (u + corr) + torch.sum(torch.where(e > 0.0, e * shifted, 0.0), dim=1)
            s = s * scale + torch.sum(e, dim=1)
            m = m_new
            at = at + torch.sum(torch.where(cols[None, :] == t[:, None], a, 0.0), dim=1)
        m_fin = torch.where(m == float("-inf"), 0.0, m)
        lse[tile_n] = m_fin + torch.log(s)
        at_out[tile_n] = at
        ent_out[tile_n] = torch.log(s) - u / s
    return lse, at_out, ent_out


@helion.kernel(**_SETTINGS)
def logp_dx(
    x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, tokens: torch.Tensor,
    lse: torch.Tensor, coef: torch.Tensor, softcap: float, inv_t: float,
    HAS_SOFTCAP: hl.constexpr, ENTROPY: hl.constexpr,
) -> torch.Tensor:
    n, h = x.size()
    v = w.size(0)
    dx = torch.empty_like(x)
    for tile_n, tile_k in hl.tile([n, h]):
        t = tokens[tile_n]
        row_lse = lse[tile_n]
        ca = coef[0, tile_n]
        cb = coef[1, tile_n]
        cc = coef[2, tile_n]
        acc = hl.zeros([tile_n, tile_k], dtype=torch.float32)
        for tile_v in hl.tile(v):
            z = hl.zeros([tile_n, tile_v], dtype=torch.float32)
            for tile_h in hl.tile(h):
                z = hl.dot(x[tile_n, tile_h], w[tile_v, tile_h].T, acc=z)
            if bias is not None:
                z = z + bias[tile_v].to(torch.float32)[None, :]
            if HAS_SOFTCAP:
                z = softcap * (1.0 - 2.0 / (torch.exp(2.0 * z / softcap) + 1.0))
            cols = tile_v.index
            logp = z * inv_t - row_lse[:, None]
            p = torch.exp(logp)
            if ENTROPY:
                dz = torch.where(p > 0.0, p * (ca[:, None] + cc[:, None] * logp), 0.0)
            else:
                dz = p * ca[:, None]
            dz = dz - torch.where(cols[None, :] == t[:, None], cb[:, None], 0.0)
            if HAS_SOFTCAP:
                capped = z / softcap
                dz = dz * (1.0 - capped * capped)
            dz = torch.where((cols < v)[None, :], dz, 0.0)
            acc = hl.dot(dz.to(w.dtype), w[tile_v, tile_k], acc=acc)
        dx[tile_n, tile_k] = acc.to(dx.dtype)
    return dx


@helion.kernel(**_SETTINGS)
def logp_dw(
    x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, tokens: torch.Tensor,
    lse: torch.Tensor, coef: torch.Tensor, softcap: float, inv_t: float,
    HAS_SOFTCAP: hl.constexpr, ENTROPY: hl.constexpr,
) -> tuple[torch.Tensor, torch.Tensor]:
    n, h = x.size()
    v = w.size(0)
    dw = torch.empty_like(w)
    db = torch.empty([v], dtype=torch.float32, device=w.device)
    for tile_v, tile_k in hl.tile([v, h]):
        acc = hl.zeros([tile_v, tile_k], dtype=torch.float32)
        acc_b = hl.zeros([tile_v], dtype=torch.float32)
        for tile_n in hl.tile(n):
            t = tokens[tile_n]
            row_lse = lse[tile_n]
            ca = coef[0, tile_n]
            cb = coef[1, tile_n]
            cc = coef[2, tile_n]
            z = hl.zeros([tile_n, tile_v], dtype=torch.float32)
            for tile_h in hl.tile(h):
                z = hl.dot(x[tile_n, tile_h], w[tile_v, tile_h].T, acc=z)
            if bias is not None:
                z = z + bias[tile_v].to(torch.float32)[None, :]
            if HAS_SOFTCAP:
                z = softcap * (1.0 - 2.0 / (torch.exp(2.0 * z / softcap) + 1.0))
            cols = tile_v.index
            logp = z * inv_t - row_lse[:, None]
            p = torch.exp(logp)
            if ENTROPY:
                dz = torch.where(p > 0.0, p * (ca[:, None] + cc[:, None] * logp), 0.0)
            else:
                dz = p * ca[:, None]
            dz = dz - torch.where(cols[None, :] == t[:, None], cb[:, None], 0.0)
            if HAS_SOFTCAP:
                capped = z / softcap
                dz = dz * (1.0 - capped * capped)
            dz = torch.where((tile_n.index < n)[:, None], dz, 0.0)
            acc = hl.dot(dz.to(x.dtype).T, x[tile_n, tile_k], acc=acc)
            acc_b = acc_b + torch.sum(dz, dim=0)
        dw[tile_v, tile_k] = acc.to(dw.dtype)
        db[tile_v] = acc_b  # equal values from every hidden block (see ce_kernels.ce_dw)
    return dw, db
