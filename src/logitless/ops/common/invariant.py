"""Batch invariance (``batch_invariant=True``): rows in blocks of a fixed size.

A row's bits may depend on the shapes its GEMMs and reductions run at (BLAS blocking,
the planners' tiles, splits and kept columns all follow the number of tokens), not on
the row's place inside one shape. So an op that runs its rows in blocks of a size that
depends on the backend and device only (``invariant_rows``), the last block padded
with zero rows whose tokens are ignored, gives every row the same bits whatever the
batch: the size, the row's position and its neighbours.
"""

from __future__ import annotations

import torch
from torch import Tensor

#: Rows per block: (backend, device type) -> rows (others: 1024).
INVARIANT_ROWS = {("torch", "cpu"): 64, ("torch", "cuda"): 1024, ("triton", "cuda"): 2048, ("triton", "cpu"): 16}


def invariant_rows(backend: str, device: torch.device) -> int:
    return INVARIANT_ROWS.get((backend, device.type), 1024)


def blocks(n: int, block):
    """(n0, n1, padding rows) of the row blocks; one block of n rows when ``block`` is None."""
    if not block:
        return [(0, n, 0)]
    return [(n0, min(n, n0 + block), max(0, n0 + block - n)) for n0 in range(0, n, block)]


def pad_rows(t: Tensor, n0: int, n1: int, pad: int, fill=0) -> Tensor:
    """t[n0:n1] with ``pad`` rows of ``fill`` after it."""
    t = t[n0:n1]
    if pad:
        t = torch.cat([t, t.new_full((pad, *t.shape[1:]), fill)])
    return t
