"""logitless.integrations.cce: cut-cross-entropy's ``linear_cross_entropy`` on logitless.

Against a float64 implementation of CCE's semantics (its test suite's reference:
``F.cross_entropy`` of the shifted, flattened logits), for every argument (bias,
soft-cap, shift as bool and int, each reduction and its shape, return_lse, ignored
tokens), on the torch backend (float64) and on the Triton interpreter (float32); and
against cut-cross-entropy's own torch_compile implementation where it is importable
(skipped otherwise: CI lacks it).
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

from logitless.integrations import cce

try:
    import cut_cross_entropy as peer
except Exception:  # noqa: BLE001 - absent or broken: those checks skip
    peer = None

V, H = 13, 12


def _reference(e, c, targets, bias=None, ignore_index=-100, softcap=None, reduction="mean", shift=0):
    """CCE's loss and lse in float64 (targets' shape, shortened by shift, for "none")."""
    shift = int(shift)
    if shift:
        e, targets = e[..., :-shift, :], targets[..., shift:]
    z = e.double() @ c.double().T
    if bias is not None:
        z = z + bias.double()
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    loss = F.cross_entropy(z.reshape(-1, z.shape[-1]), targets.reshape(-1), ignore_index=ignore_index,
                           reduction=reduction)
    lse = torch.where(targets != ignore_index, torch.logsumexp(z, -1), torch.zeros_like(targets, dtype=z.dtype))
    return (loss.reshape(targets.shape) if reduction == "none" else loss), lse


def _data(shape=(2, 5), bias=False, ignored=3, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    e = torch.randn(*shape, H, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    c = torch.randn(V, H, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    b = torch.randn(V, generator=g, dtype=torch.float64).to(dtype).requires_grad_() if bias else None
    t = torch.randint(0, V, shape, generator=g)
    t.view(-1)[:ignored] = -100
    return e, c, b, t


def _check(kw, shape=(2, 5), bias=False, ignored=3, dtype=torch.float64, tol=1e-9):
    e, c, b, t = _data(shape, bias, ignored, dtype)
    loss, lse = cce.linear_cross_entropy(e, c, t, b, return_lse=True, **kw)
    ref, ref_lse = _reference(e, c, t, b, **kw)
    assert loss.shape == ref.shape and lse.shape == ref_lse.shape
    torch.testing.assert_close(loss.double(), ref.detach(), rtol=tol, atol=tol, equal_nan=True)
    torch.testing.assert_close(lse.double(), ref_lse.detach(), rtol=tol, atol=tol)
    params = [p for p in (e, c, b) if p is not None]
    # the loss and the lse (a z-loss) both differentiate
    obj, ref_obj = loss.sum() + 0.1 * (lse ** 2).sum(), ref.sum() + 0.1 * (ref_lse ** 2).sum()
    if not torch.isnan(ref_obj):
        for a, r in zip(torch.autograd.grad(obj, params), torch.autograd.grad(ref_obj, params)):
            torch.testing.assert_close(a.double(), r.double(), rtol=tol, atol=tol)
    return loss


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("shift", [0, 1, 2, True, False])
@pytest.mark.parametrize("bias,softcap", [(False, None), (True, None), (True, 2.5)])
def test_matches_float64_cce_semantics(reduction, shift, bias, softcap):
    _check(dict(reduction=reduction, shift=shift, softcap=softcap), bias=bias)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_reduction_none_shape_with_shift(reduction):
    e, c, _, t = _data(shape=(3, 6))
    loss = cce.linear_cross_entropy(e, c, t, reduction="none", shift=4)
    assert loss.shape == (3, 2)
    loss = cce.linear_cross_entropy(e, c, t, reduction="none", shift=True)
    assert loss.shape == (3, 5)
    _check(dict(reduction=reduction, shift=3), shape=(3, 6))


def test_one_dim_three_dim_ignore_index_and_all_ignored():
    _check(dict(reduction="none"), shape=(7,), ignored=0)
    _check(dict(reduction="mean", shift=1), shape=(2, 2, 4))
    _check(dict(reduction="sum", ignore_index=4), shape=(2, 5), ignored=0)
    loss = _check(dict(reduction="mean"), ignored=10)  # every token ignored: NaN, as CCE (torch)
    assert torch.isnan(loss)
    assert _check(dict(reduction="sum"), ignored=10).item() == 0.0


@pytest.fixture
def triton_backend(monkeypatch):
    if torch.cuda.is_available():  # (conftest turns the interpreter on only without CUDA)
        pytest.skip("the Triton interpreter on CPU tensors: on a GPU machine the drop-ins' Triton path is "
                    "the public ops' CUDA path, tested by their own test files")
    monkeypatch.setattr(cce, "_lce", functools.partial(cce._lce, backend="triton"))


@pytest.mark.parametrize("reduction,shift", [("mean", 0), ("none", 2), ("sum", True)])
def test_on_triton_interpreter(triton_backend, reduction, shift):
    _check(dict(reduction=reduction, shift=shift, softcap=3.0), bias=True, dtype=torch.float32, tol=2e-5)


@pytest.mark.parametrize("impl", sorted(v.name.lower() for v in cce.LinearCrossEntropyImpl))
def test_every_impl_and_filter_option_is_accepted_and_exact(impl):
    e, c, _, t = _data()
    ref = cce.linear_cross_entropy(e, c, t)
    for kw in (dict(impl=impl), dict(impl=cce.LinearCrossEntropyImpl[impl.upper()]),
               dict(impl=impl, filter_eps=None, accum_e_fp32=True, accum_c_fp32=True),
               dict(impl=impl, filter_eps=1e-3, filter_e_grad=False, filter_c_grad=False),
               dict(impl=impl, filter_eps="high")):
        assert torch.equal(cce.linear_cross_entropy(e, c, t, **kw), ref)


def test_module():
    e, c, b, t = _data(bias=True)
    fn = cce.LinearCrossEntropy(reduction="none", shift=1, softcap=2.0, return_lse=True)
    loss, lse = fn(e, c, t, b)
    ref, ref_lse = _reference(e, c, t, b, reduction="none", shift=1, softcap=2.0)
    torch.testing.assert_close(loss, ref, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-9, atol=1e-9)


def test_bad_arguments_raise_as_cce_or_clearer():
    e, c, _, t = _data()
    with pytest.raises(NotImplementedError):
        cce.linear_cross_entropy(e, c, t, impl="fast")
    with pytest.raises(RuntimeError, match="Unknown eps"):
        cce.linear_cross_entropy(e, c, t, filter_eps="low")
    with pytest.raises(ValueError, match="Shift must be in the range"):
        cce.linear_cross_entropy(e, c, t, shift=5)
    with pytest.raises(ValueError, match="Shift must be in the range"):
        cce.linear_cross_entropy(e, c, t, shift=-1)
    with pytest.raises(ValueError, match="Bias"):
        cce.linear_cross_entropy(e, c, t, torch.zeros(V + 1, dtype=torch.float64))
    with pytest.raises(TypeError, match="ignore_index=... by keyword"):
        cce.linear_cross_entropy(e, c, t, -100)  # cut-cross-entropy 25.1's positional order
    with pytest.raises(ValueError, match="Expected c.size"):
        cce.linear_cross_entropy(e, c, t, vocab_parallel_options=cce.VocabParallelOptions(0, V - 1))


@pytest.mark.skipif(peer is None, reason="cut-cross-entropy is not installed")
@pytest.mark.parametrize("reduction,shift", [("mean", False), ("none", True), ("sum", True)])
def test_matches_cut_cross_entropy_torch_compile(reduction, shift):
    # cut-cross-entropy's own "cce" implementation needs CUDA; its torch_compile one runs here
    # (its 25.1 wheel: no bias, shift a bool).
    e, c, _, t = _data(dtype=torch.float32)
    ours = cce.linear_cross_entropy(e, c, t, reduction=reduction, shift=shift, softcap=2.0)
    theirs = peer.linear_cross_entropy(e, c, t, softcap=2.0, reduction=reduction, shift=shift,
                                       impl="torch_compile")
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    for a, b in zip(torch.autograd.grad(ours.sum(), [e, c]), torch.autograd.grad(theirs.sum(), [e, c])):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _vocab_parallel_worker(rank, world, device, reduce_e_grad):
    import torch.distributed as dist

    e, c, b, t = _data(bias=True)
    vp = cce.VocabParallelOptions.from_vocab(V, reduce_e_grad=reduce_e_grad)
    c_local = c.detach()[vp.start:vp.stop].clone().requires_grad_()
    b_local = b.detach()[vp.start:vp.stop].clone().requires_grad_()
    loss = cce.linear_cross_entropy(e, c_local, t, b_local, shift=1, vocab_parallel_options=vp)
    ref = _reference(e, c, t, b, shift=1)[0]
    torch.testing.assert_close(loss, ref, rtol=1e-9, atol=1e-9)
    de, dc, db = torch.autograd.grad(loss, [e, c_local, b_local])
    rde, rdc, rdb = torch.autograd.grad(ref, [e, c, b])
    torch.testing.assert_close(dc, rdc[vp.start:vp.stop], rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(db, rdb[vp.start:vp.stop], rtol=1e-9, atol=1e-9)
    if not reduce_e_grad:  # each rank keeps its partial gradient of e: they sum to the full one
        dist.all_reduce(de)
    torch.testing.assert_close(de, rde, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("reduce_e_grad", [True, False])
def test_vocab_parallel_options_two_ranks(reduce_e_grad):
    from tests._distributed import spawn

    spawn(_vocab_parallel_worker, 2, reduce_e_grad, backend="gloo")
