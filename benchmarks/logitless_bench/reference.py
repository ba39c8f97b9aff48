"""Float64 references for the error columns, computed on the device in token chunks.

Closed form of mean cross-entropy (no ignored tokens, as in the benchmark):
    loss  = mean_i (lse_i - z_i[t_i])
    dz    = (softmax(z) - onehot(t)) / N
    dx    = dz @ W,    dW = dz.T @ x
Only a chunk of rows of the float64 logits exists at a time, never the whole (N, V).
The ce suite regenerates its random logits chunk by chunk from per-chunk seeds
(``fill_logits``), so its reference needs no second copy of the logits.
"""

from __future__ import annotations

import math

import torch

#: Rows of float64 logits per chunk of the references (bytes per chunk = rows * V * 8).
REF_CHUNK_BYTES = 2**30

#: Rows per seeded block of the ce suite's logits (fixed: regeneration depends on it).
LOGITS_BLOCK_ROWS = 256


def _rows_per_chunk(vocab: int, chunk_bytes: int = REF_CHUNK_BYTES) -> int:
    return max(1, chunk_bytes // (vocab * 8))


def _loss_and_dz_(z: torch.Tensor, target: torch.Tensor, n: int):
    """Per-row loss ``lse - z[t]`` and dz = (softmax(z) - onehot(t)) / n of the mean over
    n rows, for float64 logits ``z`` of a chunk of rows (overwritten by dz)."""
    lse = torch.logsumexp(z, dim=-1)
    loss = lse - z.gather(1, target[:, None]).squeeze(1)
    dz = z.sub_(lse[:, None]).exp_()
    dz[torch.arange(dz.shape[0], device=dz.device), target] -= 1.0
    return loss, dz.div_(n)


@torch.no_grad()
def lce_reference(x: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, *, chunk_bytes: int = REF_CHUNK_BYTES):
    """Mean cross-entropy of ``x @ weight.T`` in float64: ``(loss, dx, dW)``.

    ``loss`` is a Python float; ``dx`` and ``dW`` are computed in float64 and stored
    in float32 (their rounding, ~6e-8 relative, is far below any bf16 error).
    """
    n, h = x.shape
    v = weight.shape[0]
    w64 = weight.double()
    dw64 = torch.zeros_like(w64)
    dx = torch.empty(n, h, dtype=torch.float32, device=x.device)
    loss_sum = torch.zeros((), dtype=torch.float64, device=x.device)
    rows = _rows_per_chunk(v, chunk_bytes)
    for i in range(0, n, rows):
        xc = x[i : i + rows].double()
        tc = target[i : i + rows].long()
        loss, dz = _loss_and_dz_(xc @ w64.T, tc, n)
        loss_sum += loss.sum()
        dx[i : i + rows] = (dz @ w64).float()
        dw64.addmm_(dz.T, xc)
        del dz, xc
    dw = dw64.float()
    del w64, dw64
    return loss_sum.item() / n, dx, dw


@torch.no_grad()
def rel_err(a: torch.Tensor, ref: torch.Tensor, *, chunk_elems: int = 2**27) -> float:
    """||a - ref|| / ||ref|| (Frobenius), accumulated in float64 over row chunks."""
    a2, r2 = a.reshape(a.shape[0], -1), ref.reshape(ref.shape[0], -1)
    rows = max(1, chunk_elems // max(1, r2.shape[1]))
    num = torch.zeros((), dtype=torch.float64, device=ref.device)
    den = torch.zeros((), dtype=torch.float64, device=ref.device)
    for i in range(0, r2.shape[0], rows):
        rc = r2[i : i + rows].double()
        num += (a2[i : i + rows].double() - rc).square().sum()
        den += rc.square().sum()
    return math.sqrt(num.item()) / max(math.sqrt(den.item()), 1e-300)


# --------------------------------------------------------------------------- ce suite


def _block_generator(device, seed: int, block: int) -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed(seed * 1_000_003 + block)
    return g


@torch.no_grad()
def fill_logits(logits: torch.Tensor, seed: int) -> None:
    """Fills (N, V) ``logits`` with N(0, 1) values, each block of LOGITS_BLOCK_ROWS rows
    from its own seed, so that ``logits_block`` can regenerate any block alone."""
    for b, i in enumerate(range(0, logits.shape[0], LOGITS_BLOCK_ROWS)):
        logits[i : i + LOGITS_BLOCK_ROWS].normal_(generator=_block_generator(logits.device, seed, b))


def logits_block(b: int, n: int, v: int, dtype, device, seed: int) -> torch.Tensor:
    """Block ``b`` of the logits that ``fill_logits`` writes (same values, bit for bit)."""
    rows = min(LOGITS_BLOCK_ROWS, n - b * LOGITS_BLOCK_ROWS)
    out = torch.empty(rows, v, dtype=dtype, device=device)
    return out.normal_(generator=_block_generator(device, seed, b))


def _ce_blocks(n, v, dtype, device, seed, target):
    """Yields (row slice, float64 softmax-minus-onehot / N, per-row loss) per block."""
    for b, i in enumerate(range(0, n, LOGITS_BLOCK_ROWS)):
        z = logits_block(b, n, v, dtype, device, seed).double()
        loss, dz = _loss_and_dz_(z, target[i : i + z.shape[0]].long(), n)
        yield slice(i, i + z.shape[0]), dz, loss


@torch.no_grad()
def ce_reference_loss(n, v, dtype, device, seed, target) -> float:
    """Float64 mean cross-entropy of the logits ``fill_logits(seed)`` makes."""
    total = sum(loss.sum().item() for _, _, loss in _ce_blocks(n, v, dtype, device, seed, target))
    return total / n


@torch.no_grad()
def ce_grad_rel_err(grad: torch.Tensor, seed: int, target: torch.Tensor) -> float:
    """||grad - dlogits_ref|| / ||dlogits_ref||, the reference rebuilt block by block."""
    n, v = grad.shape
    num = den = 0.0
    for rows, dz, _ in _ce_blocks(n, v, grad.dtype, grad.device, seed, target):
        num += (grad[rows].double() - dz).square().sum().item()
        den += dz.square().sum().item()
    return math.sqrt(num) / max(math.sqrt(den), 1e-300)
