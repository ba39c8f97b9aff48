"""Helion forward kernel of linear_log_probs: x @ W.T (+ b) tile by tile, never a logits tile in HBM.

The math is ``logitless.formulas.log_probs``'s (Triton twin: ``triton_lib.log_probs_math``),
with a = softcap(z) / T: ``logp_forward``, per (row tile, vocabulary split of ``span``
columns), the online (m, s, u) over the split's vocabulary tiles (s = sum e^(a - m),
u = sum e^(a - m) (a - m), rescaled when m grows) and a at the token: (splits, N) partials
that ``linear_log_probs.logp_forward`` merges (``formulas.log_probs.merge_splits``: lse =
m + log s, H = log s - u / s). The backward is ``grad_kernels``' (shared with
linear_cross_entropy).
"""
from __future__ import annotations

import helion
import helion.language as hl
import torch

from logitless.helion_lib.runtime import kernel_settings
from logitless.helion_lib.tile_math import finite_max, hit_mask, logits_epilogue

_SETTINGS = kernel_settings()


@helion.kernel(**_SETTINGS)
def logp_forward(
    x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, tokens: torch.Tensor,
    softcap: float, inv_t: float, span: int, HAS_SOFTCAP: hl.constexpr, ENTROPY: hl.constexpr,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    n, h = x.size()
    v = w.size(0)
    splits = (v + span - 1) // span
    m_out = torch.empty([splits, n], dtype=torch.float32, device=x.device)
    s_out = torch.empty([splits, n], dtype=torch.float32, device=x.device)
    u_out = torch.empty([splits, n], dtype=torch.float32, device=x.device)
    at_out = torch.empty([splits, n], dtype=torch.float32, device=x.device)
    for tile_n, tile_s in hl.tile([n, splits], block_size=[None, 1]):
        t = tokens[tile_n]
        m = hl.full([tile_n], float("-inf"), dtype=torch.float32)
        s = hl.zeros([tile_n], dtype=torch.float32)
        u = hl.zeros([tile_n], dtype=torch.float32)
        at = hl.zeros([tile_n], dtype=torch.float32)
        v0 = tile_s.begin * span
        for tile_v in hl.tile(v0, min(v0 + span, v)):
            z = hl.zeros([tile_n, tile_v], dtype=torch.float32)
            for tile_h in hl.tile(h):
                z = hl.dot(x[tile_n, tile_h], w[tile_v, tile_h].T, acc=z)
            z = logits_epilogue(z, bias, tile_v, softcap, HAS_SOFTCAP)
            a = torch.where((tile_v.index < v)[None, :], z * inv_t, float("-inf"))
            m_new = torch.maximum(m, torch.amax(a, dim=1))
            m_safe = finite_max(m_new)
            d = m - m_safe
            scale = torch.exp(d)
            shifted = a - m_safe[:, None]
            e = torch.exp(shifted)
            if ENTROPY:
                corr = torch.where(s > 0.0, d * s, 0.0)
                u = scale * (u + corr) + torch.sum(torch.where(e > 0.0, e * shifted, 0.0), dim=1)
            s = s * scale + torch.sum(e, dim=1)
            m = m_new
            at = at + torch.sum(torch.where(hit_mask(tile_v, t), a, 0.0), dim=1)
        m_out[tile_s.begin, tile_n] = m
        s_out[tile_s.begin, tile_n] = s
        u_out[tile_s.begin, tile_n] = u
        at_out[tile_s.begin, tile_n] = at
    return m_out, s_out, u_out, at_out
