"""batch_invariant=True: a row's outputs are bitwise the same alone, inside batches of
other sizes, at other positions and beside other rows (torch path and the Triton
backend, on the CPU interpreter without a GPU)."""

from __future__ import annotations

import pytest
import torch

import logitless
from logitless.ops.common import invariant
from tests.conftest import DEVICE

BACKENDS = ["torch", "triton"]


def _data(n, h, v, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, h, generator=g).to(dtype).to(DEVICE)
    w = (torch.randn(v, h, generator=g) * h ** -0.5 * 3).to(dtype).to(DEVICE)
    b = (torch.randn(v, generator=g) * 0.3).to(dtype).to(DEVICE)
    t = torch.randint(0, v, (n,), generator=g).to(DEVICE)
    return x, w, b, t


def _batches(backend, n_rows):
    """(indices of the rows of interest inside it, batch row order) for batches of other
    sizes and positions: alone, first of a small batch, in the middle of a batch larger
    than one block, at the end of an odd batch."""
    block = invariant.invariant_rows(backend, DEVICE)
    big = block + 5
    return [
        [0], list(range(n_rows)), list(range(n_rows))[::-1] + list(range(n_rows, 3 + n_rows)),
        list(range(3, big)) + [0, 1, 2],
    ]


def _rows_equal(fn, backend, n=None):
    block = invariant.invariant_rows(backend, DEVICE)
    total = block + 8
    outs = {}
    for order in _batches(backend, 4):
        idx = torch.tensor(order, device=DEVICE)
        res = fn(idx)
        for pos, row in enumerate(order):
            if row < 3:
                vals = tuple(r[pos] for r in res)
                if row in outs:
                    for a, b in zip(outs[row], vals):
                        assert torch.equal(a, b), (row, order[:5], a, b)
                else:
                    outs[row] = vals
    assert set(outs) == {0, 1, 2}
    return total


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("trunc", [{}, {"top_k": 5, "top_p": 0.9}])
def test_linear_log_probs(backend, trunc):
    block = invariant.invariant_rows(backend, DEVICE)
    x, w, b, t = _data(block + 8, 19, 67, seed=1)

    def fn(idx):
        return logitless.linear_log_probs(x[idx], w, t[idx], b, entropy=True, temperature=0.8, softcap=6.0,
                                          backend=backend, batch_invariant=True, **trunc)

    _rows_equal(fn, backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_linear_log_probs_gradients_match_default(backend):
    """The blocked path's values and gradients agree with the default path (not bitwise)."""
    block = invariant.invariant_rows(backend, DEVICE)
    x, w, b, t = _data(block + 3, 19, 67, seed=2)
    grads = []
    outs = []
    for inv in (False, True):
        xs, ws, bs = (u.clone().requires_grad_() for u in (x, w, b))
        lp, ent = logitless.linear_log_probs(xs, ws, t, bs, entropy=True, backend=backend, batch_invariant=inv)
        (lp.sum() + 0.5 * ent.sum()).backward()
        outs.append((lp, ent))
        grads.append((xs.grad, ws.grad, bs.grad))
    for a, c in zip(outs[0] + grads[0], outs[1] + grads[1]):
        assert (a - c).abs().max() < 1e-4


@pytest.mark.parametrize("backend", BACKENDS)
def test_linear_cross_entropy(backend):
    block = invariant.invariant_rows(backend, DEVICE)
    x, w, b, t = _data(block + 8, 21, 61, seed=3)
    t[5] = -100

    def fn(idx):
        loss, st = logitless.linear_cross_entropy(x[idx], w, t[idx], b, reduction="none", return_stats=True,
                                                  softcap=5.0, label_smoothing=0.1, backend=backend,
                                                  batch_invariant=True)
        return loss, st.lse, st.correct

    _rows_equal(fn, backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_linear_cross_entropy_matches_default(backend, reduction):
    block = invariant.invariant_rows(backend, DEVICE)
    x, w, b, t = _data(block + 3, 21, 61, seed=4)
    t[::4] = -100
    cw = torch.rand(61, generator=torch.Generator().manual_seed(0)).to(DEVICE) + 0.5
    res = []
    for inv in (False, True):
        xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
        loss, st = logitless.linear_cross_entropy(xs, ws, t, b, reduction=reduction, class_weight=cw,
                                                  label_smoothing=0.05, return_stats=True, backend=backend,
                                                  batch_invariant=inv)
        (loss.sum()).backward()
        res.append((loss, st.lse, st.num_tokens, xs.grad, ws.grad))
    for a, c in zip(*res):
        assert (a.double() - c.double()).abs().max() < 1e-4


def test_log_probs():
    x, w, b, t = _data(invariant.invariant_rows("torch", DEVICE) + 16, 9, 53, seed=5)  # (_rows_equal's rows)
    logits = (x @ w.T).cpu()
    t = t.cpu()

    def fn(idx):
        idx = idx.cpu()  # (the logits are on the CPU: the torch path's blocks there)
        return logitless.log_probs(logits[idx], t[idx], entropy=True, temperature=0.9, backend="torch",
                                   batch_invariant=True, top_p=0.9)

    _rows_equal(fn, "torch")
