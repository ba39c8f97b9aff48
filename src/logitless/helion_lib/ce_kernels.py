"""Helion forward kernel of linear_cross_entropy: x @ W.T (+ b) tile by tile, never a logits tile in HBM.

The math is ``logitless.formulas.cross_entropy``'s (Triton twin: ``triton_lib.ce_math``):
``ce_forward``, per (row tile, vocabulary split of ``span`` columns), an online
log-sum-exp over the split's vocabulary tiles of the soft-capped logits z, with the target
logit, sum_c w_c z_c (label smoothing) and the first argmax (return_stats): (splits, N)
partials that ``linear_cross_entropy.lce_forward`` merges into
``formulas.cross_entropy.TokenStats``. The backward is ``grad_kernels``' (shared with
linear_log_probs).

Optional tensors (bias, class weight) are ``None`` or a tensor; the flags are
``hl.constexpr`` so that each combination compiles its own kernel.
"""

from __future__ import annotations

import helion
import helion.language as hl
import torch

from logitless.helion_lib.runtime import kernel_settings
from logitless.helion_lib.tile_math import hit_mask, logits_epilogue, lse_step

_SETTINGS = kernel_settings()


@helion.kernel(**_SETTINGS)
def ce_forward(
    x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, target: torch.Tensor,
    cw: torch.Tensor | None, softcap: float, span: int,
    HAS_SOFTCAP: hl.constexpr, NEED_SMOOTH: hl.constexpr, NEED_ARGMAX: hl.constexpr,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    n, h = x.size()
    v = w.size(0)
    splits = (v + span - 1) // span
    m_out = torch.empty([splits, n], dtype=torch.float32, device=x.device)
    s_out = torch.empty([splits, n], dtype=torch.float32, device=x.device)
    zt_out = torch.empty([splits, n], dtype=torch.float32, device=x.device)
    smooth_out = torch.empty([splits, n], dtype=torch.float32, device=x.device)
    best_out = torch.empty([splits, n], dtype=torch.float32, device=x.device)
    argmax_out = torch.empty([splits, n], dtype=torch.int64, device=x.device)
    for tile_n, tile_s in hl.tile([n, splits], block_size=[None, 1]):
        t = target[tile_n]
        m = hl.full([tile_n], float("-inf"), dtype=torch.float32)
        s = hl.zeros([tile_n], dtype=torch.float32)
        zt = hl.zeros([tile_n], dtype=torch.float32)
        smooth = hl.zeros([tile_n], dtype=torch.float32)
        best = hl.full([tile_n], float("-inf"), dtype=torch.float32)
        best_idx = hl.zeros([tile_n], dtype=torch.int64)
        v0 = tile_s.begin * span
        for tile_v in hl.tile(v0, min(v0 + span, v)):
            z = hl.zeros([tile_n, tile_v], dtype=torch.float32)
            for tile_h in hl.tile(h):
                z = hl.dot(x[tile_n, tile_h], w[tile_v, tile_h].T, acc=z)
            z = logits_epilogue(z, bias, tile_v, softcap, HAS_SOFTCAP)
            cols = tile_v.index
            col_ok = cols < v
            z = torch.where(col_ok[None, :], z, float("-inf"))
            tile_max = torch.amax(z, dim=1)
            m, s = lse_step(m, s, z, tile_max)
            zt = zt + torch.sum(torch.where(hit_mask(tile_v, t), z, 0.0), dim=1)
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
        m_out[tile_s.begin, tile_n] = m
        s_out[tile_s.begin, tile_n] = s
        zt_out[tile_s.begin, tile_n] = zt
        smooth_out[tile_s.begin, tile_n] = smooth
        best_out[tile_s.begin, tile_n] = best
        argmax_out[tile_s.begin, tile_n] = best_idx
    return m_out, s_out, zt_out, smooth_out, best_out, argmax_out
