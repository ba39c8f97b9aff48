"""Helion kernels of linear_cross_entropy: x @ W.T (+ b) tile by tile, never a logits tile in HBM.

The math is ``logitless.formulas.cross_entropy``'s (Triton twin: ``triton_lib.ce_math``):
- ``ce_forward``: per row tile, an online log-sum-exp over vocabulary tiles of the
  soft-capped logits z, with the target logit, sum_c w_c z_c (label smoothing) and the
  first argmax (return_stats) -> ``formulas.cross_entropy.TokenStats``;
- ``ce_dx`` / ``ce_dw``: the backward's recompute of z, then the one gradient line
  dz_c = (p_c A - B [c == t] - C w_c) (1 - (z_c / s)^2) with A, B, C from
  ``formulas.cross_entropy.grad_coefficients`` ((3, N) fp32, 0 at ignored tokens),
  fed straight into dX (accumulated over vocabulary tiles, per (row, hidden) block) and
  into dW and db (accumulated over row tiles, per (vocabulary, hidden) block). No atomics.

Optional tensors (bias, class weight) are ``None`` or a tensor; the flags are
``hl.constexpr`` so that each combination compiles its own kernel.
"""

from __future__ import annotations

import torch

import helion
import helion.language as hl

from logitless.helion_lib.runtime import kernel_settings

_SETTINGS = kernel_settings()


@helion.kernel(**_SETTINGS)
def ce_forward(
    x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, target: torch.Tensor,
    cw: torch.Tensor | None, softcap: float,
    HAS_SOFTCAP: hl.constexpr, NEED_SMOOTH: hl.constexpr, NEED_ARGMAX: hl.constexpr,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    n, h = x.size()
    v = w.size(0)
    lse = torch.empty([n], dtype=torch.float32, device=x.device)
    zt_out = torch.empty([n], dtype=torch.float32, device=x.device)
    smooth_out = torch.empty([n], dtype=torch.float32, device=x.device)
    argmax_out = torch.empty([n], dtype=torch.int64, device=x.device)
    for tile_n in hl.tile(n):
        t = target[tile_n]
        m = hl.full([tile_n], float("-inf"), dtype=torch.float32)
        s = hl.zeros([tile_n], dtype=torch.float32)
        zt = hl.zeros([tile_n], dtype=torch.float32)
        smooth = hl.zeros([tile_n], dtype=torch.float32)
        best = hl.full([tile_n], float("-inf"), dtype=torch.float32)
        best_idx = hl.zeros([tile_n], dtype=torch.int64)
        for tile_v in hl.tile(v):
            z = hl.zeros([tile_n, tile_v], dtype=torch.float32)
            for tile_h in hl.tile(h):
                z = hl.dot(x[tile_n, tile_h], w[tile_v, tile_h].T, acc=z)
            if bias is not None:
                z = z + bias[tile_v].to(torch.float32)[None, :]
            if HAS_SOFTCAP:
                z = softcap * (1.0 - 2.0 / (torch.exp(2.0 * z / softcap) + 1.0))
            cols = tile_v.index
            col_ok = cols < v
            z = torch.where(col_ok[None, :], z, float("-inf"))
            tile_max = torch.amax(z, dim=1)
            m_new = torch.maximum(m, tile_max)
            m_safe = torch.where(m_new == float("-inf"), 0.0, m_new)
            s = s * torch.exp(m - m_safe) + torch.sum(torch.exp(z - m_safe[:, None]), dim=1)
            m = m_new
            hit = cols[None, :] == t[:, None]
            zt = zt + torch.sum(torch.where(hit, z, 0.0), dim=1)
            if NEED_SMOOTH:
                if cw is not None:
                    wc = cw[tile_v].to(torch.float32)
                    smooth = smooth + torch.sum(torch.where(col_ok[None, :], z * wc[None, :], 0.0), dim=1)
                else:
                    smooth = smooth + torch.sum(torch.where(col_ok[None, :], z, 0.0), dim=1)
            if NEED_ARGMAX:
                idx = torch.amin(torch.where(z == tile_max[:, None], cols[None, :], v), dim=1)
                better = tile_max > best
                best_idx = torch.where(better, idx, best_idx)
                best = torch.where(better, tile_max, best)
        m_fin = torch.where(m == float("-inf"), 0.0, m)
        lse[tile_n] = m_fin + torch.log(s)
        zt_out[tile_n] = zt
        smooth_out[tile_n] = smooth
        argmax_out[tile_n] = best_idx
    return lse, zt_out, smooth_out, argmax_out


@helion.kernel(**_SETTINGS)
def ce_dx(
    x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, target: torch.Tensor,
    cw: torch.Tensor | None, lse: torch.Tensor, coef: torch.Tensor, softcap: float,
    HAS_SOFTCAP: hl.constexpr,
) -> torch.Tensor:
    n, h = x.size()
    v = w.size(0)
    dx = torch.empty_like(x)
    for tile_n, tile_k in hl.tile([n, h]):
        t = target[tile_n]
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
            p = torch.exp(z - row_lse[:, None])
            dz = p * ca[:, None] - torch.where(cols[None, :] == t[:, None], cb[:, None], 0.0)
            if cw is not None:
                dz = dz - cc[:, None] * cw[tile_v].to(torch.float32)[None, :]
            else:
                dz = dz - cc[:, None]
            if HAS_SOFTCAP:
                capped = z / softcap
                dz = dz * (1.0 - capped * capped)
            dz = torch.where((cols < v)[None, :], dz, 0.0)
            acc = hl.dot(dz.to(w.dtype), w[tile_v, tile_k], acc=acc)
        dx[tile_n, tile_k] = acc.to(dx.dtype)
    return dx


@helion.kernel(**_SETTINGS)
def ce_dw(
    x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, target: torch.Tensor,
    cw: torch.Tensor | None, lse: torch.Tensor, coef: torch.Tensor, softcap: float,
    HAS_SOFTCAP: hl.constexpr,
) -> tuple[torch.Tensor, torch.Tensor]:
    n, h = x.size()
    v = w.size(0)
    dw = torch.empty_like(w)
    db = torch.empty([v], dtype=torch.float32, device=w.device)
    for tile_v, tile_k in hl.tile([v, h]):
        acc = hl.zeros([tile_v, tile_k], dtype=torch.float32)
        acc_b = hl.zeros([tile_v], dtype=torch.float32)
        for tile_n in hl.tile(n):
            t = target[tile_n]
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
            p = torch.exp(z - row_lse[:, None])
            dz = p * ca[:, None] - torch.where(cols[None, :] == t[:, None], cb[:, None], 0.0)
            if cw is not None:
                dz = dz - cc[:, None] * cw[tile_v].to(torch.float32)[None, :]
            else:
                dz = dz - cc[:, None]
            if HAS_SOFTCAP:
                capped = z / softcap
                dz = dz * (1.0 - capped * capped)
            dz = torch.where((tile_n.index < n)[:, None], dz, 0.0)
            acc = hl.dot(dz.to(x.dtype).T, x[tile_n, tile_k], acc=acc)
            acc_b = acc_b + torch.sum(dz, dim=0)
        dw[tile_v, tile_k] = acc.to(dw.dtype)
        # Every hidden block of a vocabulary block computes the same db (same order): the
        # duplicate stores write equal values, so db needs neither a flag nor atomics.
        db[tile_v] = acc_b
    return dw, db
