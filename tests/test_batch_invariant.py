"""batch_invariant=True: a row's outputs are bitwise the same alone, inside batches of
other sizes, at other positions and beside other rows (torch path and the Triton
backend, on the CPU interpreter without a GPU)."""

from __future__ import annotations

import pytest
import torch

import logitless
from logitless.ops.common import invariant
from tests.conftest import DEVICE, exact_for_interpreter

BACKENDS = ["torch", "triton"]


def _data(n, h, v, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, h, generator=g).to(dtype).to(DEVICE)
    w = (torch.randn(v, h, generator=g) * h ** -0.5 * 3).to(dtype).to(DEVICE)
    b = (torch.randn(v, generator=g) * 0.3).to(dtype).to(DEVICE)
    t = torch.randint(0, v, (n,), generator=g).to(DEVICE)
    return x, w, b, t


def _rows(backend: str) -> int:
    """Rows per block of ``backend`` (its ``invariant_rows``) on the test device."""
    from logitless.ops.linear_cross_entropy.api import BACKENDS as LCE

    return invariant.rows(LCE[backend], DEVICE)


def _batches(backend, n_rows):
    """(indices of the rows of interest inside it, batch row order) for batches of other
    sizes and positions: alone, first of a small batch, in the middle of a batch larger
    than one block, at the end of an odd batch."""
    block = _rows(backend)
    big = block + 5
    return [
        [0], list(range(n_rows)), list(range(n_rows))[::-1] + list(range(n_rows, 3 + n_rows)),
        list(range(3, big)) + [0, 1, 2],
    ]


def _rows_equal(fn, backend, n=None):
    block = _rows(backend)
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
    block = _rows(backend)
    x, w, b, t = _data(block + 8, 19, 67, seed=1)
    if backend == "triton":  # (a CPU BLAS's bits may follow a row's place in the tile)
        x, w, b = exact_for_interpreter(x, w, b)

    def fn(idx):
        return logitless.linear_log_probs(x[idx], w, t[idx], b, entropy=True, temperature=0.8, softcap=6.0,
                                          backend=backend, batch_invariant=True, **trunc)

    _rows_equal(fn, backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_linear_log_probs_gradients_match_default(backend):
    """The blocked path's values and gradients agree with the default path (not bitwise)."""
    block = _rows(backend)
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
    block = _rows(backend)
    x, w, b, t = _data(block + 8, 21, 61, seed=3)
    if backend == "triton":  # (a CPU BLAS's bits may follow a row's place in the tile)
        x, w, b = exact_for_interpreter(x, w, b)
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
    block = _rows(backend)
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
    x, w, b, t = _data(_rows("torch") + 16, 9, 53, seed=5)  # (_rows_equal's rows)
    logits = (x @ w.T).cpu()
    t = t.cpu()

    def fn(idx):
        idx = idx.cpu()  # (the logits are on the CPU: the torch path's blocks there)
        return logitless.log_probs(logits[idx], t[idx], entropy=True, temperature=0.9, backend="torch",
                                   batch_invariant=True, top_p=0.9)

    _rows_equal(fn, "torch")


# Each option alone: values and gradients of batch_invariant=True against the default
# path (one backward over the batch, with the blocked forward's statistics).
OPTION_CASES = {
    "plain": {},
    "bias": {"bias": True},
    "class_weight": {"class_weight": True},
    "label_smoothing": {"label_smoothing": 0.1},
    "label_smoothing_class_weight": {"label_smoothing": 0.1, "class_weight": True},
    "z_loss": {"z_loss": 1e-2},
    "softcap": {"softcap": 4.0},
    "ignore_index": {"ignore_index": 7},
    "shift": {"shift": True},
    "lse_grad": {"lse_grad": True},
    "memory_budget": {"memory_budget": 1},
    "vocab_size": {"vocab_size": 53},
    "mean": {"reduction": "mean"},
    "sum": {"reduction": "sum"},
    "autocast": {"autocast": True},
    "float64": {"dtype": torch.float64},
    "combined": {"bias": True, "class_weight": True, "label_smoothing": 0.1, "z_loss": 1e-2, "softcap": 4.0,
                 "shift": True, "lse_grad": True, "memory_budget": 1, "vocab_size": 53, "reduction": "mean"},
}


def _option_run(backend, case, inv, x, w, b, t, r):
    opt = dict(OPTION_CASES[case])
    lse_grad, autocast = opt.pop("lse_grad", False), opt.pop("autocast", False)
    use_bias = opt.pop("bias", False)
    dtype = opt.pop("dtype", x.dtype)
    x, w, b = (u.to(dtype) for u in (x, w, b))
    if opt.pop("class_weight", False):
        gen = torch.Generator().manual_seed(1)
        opt["class_weight"] = torch.rand(opt.get("vocab_size", w.shape[0]), generator=gen).to(DEVICE) + 0.5
    opt.setdefault("reduction", "none")
    xs, ws, bs = (u.clone().requires_grad_() for u in (x, w, b))
    if opt.get("shift"):
        xs_in, t_in = xs.reshape(3, -1, x.shape[-1]), t.reshape(3, -1)
    else:
        xs_in, t_in = xs, t
    with torch.autocast(DEVICE.type if hasattr(DEVICE, "type") else str(DEVICE), dtype=torch.bfloat16,
                        enabled=autocast):
        loss, st = logitless.linear_cross_entropy(xs_in, ws, t_in, bs if use_bias else None, return_stats=True,
                                                  backend=backend, batch_invariant=inv, **opt)
    total = (loss * r[:loss.numel()].reshape(loss.shape)).sum() if loss.dim() else loss
    if lse_grad:
        total = total + 0.3 * (st.lse * r.flip(0)[:st.lse.numel()].reshape(st.lse.shape)).sum()
    total.backward()
    return [loss, st.lse, st.correct, xs.grad, ws.grad] + ([bs.grad] if use_bias else [])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", list(OPTION_CASES))
def test_linear_cross_entropy_option_gradients_match_default(backend, case):
    if case == "float64" and backend != "torch":
        pytest.skip("float64 runs on the torch backend only")
    block = _rows(backend)
    x, w, b, t = _data(3 * (block // 2 + 1), 21, 61, seed=6)  # 3 sequences (shift), over one block
    t[::5] = 7 if case == "ignore_index" else -100
    if case in ("vocab_size", "combined"):
        t = torch.where(t < 0, t, t % 53)
    r = torch.rand(t.numel(), generator=torch.Generator().manual_seed(2)).to(DEVICE) + 0.5
    ref = _option_run(backend, case, False, x, w, b, t, r)
    got = _option_run(backend, case, True, x, w, b, t, r)
    tol = 2e-2 if case == "autocast" else 1e-4  # (bf16 gradients)
    for name, a, c in zip(["loss", "lse", "correct", "dx", "dw", "db"], ref, got):
        assert a.shape == c.shape and a.dtype == c.dtype, name
        err = (a.double() - c.double()).abs().max().item() if a.numel() else 0.0
        assert err <= tol * max(1.0, a.double().abs().max().item()), (case, name, err)
    if case in ("vocab_size", "combined"):
        assert got[4][53:].abs().max() == 0  # the padding rows: no class, zero gradient


@pytest.mark.parametrize("backend", BACKENDS)
def test_linear_cross_entropy_one_backward_same_bits_with_grad(backend, monkeypatch):
    """Under a gradient the per-token outputs are the no-grad bits; the backward runs the
    backend's backward once over the batch (one dW), whatever the number of blocks."""
    from logitless.ops.linear_cross_entropy.api import BACKENDS as LCE

    block = _rows(backend)
    x, w, b, t = _data(2 * block + 5, 21, 61, seed=7)
    kw = dict(reduction="none", return_stats=True, softcap=5.0, z_loss=1e-3, backend=backend, batch_invariant=True)
    with torch.no_grad():
        loss0, st0 = logitless.linear_cross_entropy(x, w, t, b, **kw)
    impl = LCE[backend]
    calls, fwd = [], []
    real, real_fwd = impl.backward, impl.forward
    monkeypatch.setattr(impl, "backward", lambda *a, **k: calls.append(a[0].shape[0]) or real(*a, **k))
    monkeypatch.setattr(impl, "forward", lambda *a, **k: fwd.append(a[0].shape[0]) or real_fwd(*a, **k))
    xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
    loss, st = logitless.linear_cross_entropy(xs, ws, t, b, **kw)
    assert torch.equal(loss, loss0) and torch.equal(st.lse, st0.lse) and torch.equal(st.argmax, st0.argmax)
    assert fwd == [block] * 3  # fixed-size blocks, the last one padded
    loss.sum().backward()
    assert calls == [x.shape[0]] and fwd == [block] * 3  # one backward, no forward re-run
    assert xs.grad.shape == x.shape and ws.grad.shape == w.shape


@pytest.mark.parametrize("backend", BACKENDS)
def test_linear_cross_entropy_empty_and_errors(backend):
    x, w, b, t = _data(0, 21, 61, seed=8)
    xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
    loss = logitless.linear_cross_entropy(xs, ws, t, b, reduction="sum", backend=backend, batch_invariant=True)
    loss.backward()
    assert loss.item() == 0 and xs.grad.shape == x.shape and ws.grad.abs().max() == 0
    with pytest.raises(TypeError, match="batch_invariant"):
        logitless.linear_cross_entropy(x, w, t, backend=backend, batch_invariant=1)
    with pytest.raises(ValueError, match="target"):
        logitless.linear_cross_entropy(x, w, t[:, None], backend=backend, batch_invariant=True)
    x2, w2, _, t2 = _data(3, 21, 61, seed=8)
    with pytest.raises(RuntimeError):
        xs = x2.clone().requires_grad_()
        loss = logitless.linear_cross_entropy(xs, w2, t2, backend=backend, batch_invariant=True)
        (g,) = torch.autograd.grad(loss, xs, create_graph=True)
        g.sum().backward()
