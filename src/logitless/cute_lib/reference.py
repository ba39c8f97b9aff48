"""A torch model of what ``forward_stats`` writes: the same splits of 256-column tiles,
the same partials, in any dtype (float64 for tests). Test sizes only (it materialises
the (N, V) logits).

The tests check (CPU) that these partials, fed to the library's epilogues, give the ops'
float64 references (so the partials mean what the epilogues expect), and (GPU) that the
kernel's partials equal them within fp32 rounding."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

TILE_N = 256


def split_bounds(v: int, splits: int) -> list[tuple[int, int]]:
    """Column range [lo, hi) of each split (empty ranges for splits past the last tile)."""
    v_tiles = -(-v // TILE_N)
    per = -(-v_tiles // splits)
    return [(min(v, s * per * TILE_N), min(v, (s + 1) * per * TILE_N)) for s in range(splits)]


def forward_partials(x: Tensor, weight: Tensor, target: Tensor, splits: int, *, scale: float = 1.0,
                     smooth: bool = False, entropy: bool = False, dtype: torch.dtype = torch.float64
                     ) -> tuple[Tensor, Tensor, Tensor, Optional[Tensor], Optional[Tensor]]:
    """(m, e, t, q or None, u or None), each (splits, N) in ``dtype``: the module docstring
    of ``forward_stats`` (an empty split: m = -inf, the others 0)."""
    a = (x.to(dtype) @ weight.to(dtype).T) * scale
    n, v = a.shape
    kw = dict(dtype=dtype, device=a.device)
    m = torch.full((splits, n), float("-inf"), **kw)
    e, t, q, u = (torch.zeros(splits, n, **kw) for _ in range(4))
    tgt = target.long()
    inside = (tgt >= 0) & (tgt < v)
    a_t = a.gather(1, torch.where(inside, tgt, 0)[:, None])[:, 0]
    for s, (lo, hi) in enumerate(split_bounds(v, splits)):
        if hi <= lo:
            continue
        blk = a[:, lo:hi]
        m[s] = blk.max(dim=1).values
        p = torch.exp(blk - m[s][:, None])
        e[s] = p.sum(dim=1)
        u[s] = (p * (blk - m[s][:, None])).sum(dim=1)
        q[s] = blk.sum(dim=1)
        t[s] = torch.where(inside & (tgt >= lo) & (tgt < hi), a_t, torch.zeros_like(a_t))
    return m, e, t, q if smooth else None, u if entropy else None
