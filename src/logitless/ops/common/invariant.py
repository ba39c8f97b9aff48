"""Batch invariance (``batch_invariant=True``): rows in blocks of a fixed size.

A row's bits may depend on the shapes its GEMMs and reductions run at (BLAS blocking,
the planners' tiles, splits and kept columns all follow the number of tokens), not on
the row's place inside one shape. So an op that runs its rows in blocks of a size that
depends on the backend and device only (``invariant_rows``), the last block padded
with zero rows whose tokens are ignored, gives every row the same bits whatever the
batch: the size, the row's position and its neighbours.
"""

from __future__ import annotations

import dataclasses
from typing import Generic, Optional, TypeVar

import torch
from torch import Tensor

#: Rows per block of a backend (its ``invariant_rows`` attribute: device type -> rows;
#: ``DEFAULT_ROWS`` for a device type it does not name): the torch backends', the Triton
#: backends' (the interpreter on CPUs: few rows keep it quick).
TORCH_ROWS = {"cpu": 64, "cuda": 1024}
TRITON_ROWS = {"cpu": 16, "cuda": 2048}
DEFAULT_ROWS = 1024

#: A backend's Config class (``Blocked``'s parameter).
C = TypeVar("C")


def rows(backend, device: torch.device) -> int:
    """Rows per block of ``backend`` (an op's backend object) on ``device``."""
    return backend.invariant_rows.get(device.type, DEFAULT_ROWS)


@dataclasses.dataclass(frozen=True)
class Blocked(Generic[C]):
    """The batch-invariant Config over a backend's Config ``C``: ``rows`` per block,
    ``forward`` (the Config of one block, which every block follows) and ``backward`` (the
    Config of the backward over the whole batch; None without a gradient)."""

    rows: int
    forward: Optional[C] = None
    backward: Optional[C] = None


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
