"""logitless.integrations.liger: liger-kernel 0.8.5's losses and modules on logitless.

Against a float64 implementation of Liger's semantics written here (its rules where
they differ from torch's: all-ignored "mean" = 0, the z-loss of a class-weighted mean
divided by the token count, token scaling, accuracy, predicted tokens -1 at ignored
tokens), on the torch backend (float64) and on the Triton interpreter (float32); and
against liger-kernel itself where it is importable (skipped otherwise: CI lacks it).
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
import torch.nn.functional as F

from logitless.integrations import liger

try:  # the peer itself, for side-by-side checks (its Triton kernels run on the interpreter)
    import liger_kernel.transformers.functional as peer_functional
except Exception:  # noqa: BLE001 - absent or broken: those checks skip
    peer_functional = None

needs_peer = pytest.mark.skipif(peer_functional is None, reason="liger-kernel is not installed")

V, H = 13, 12  # V prime, H not a multiple of 16


def _softcap(z, s):
    return z if s is None else s * torch.tanh(z / s)


def _reference(x, w, t, bias=None, ce_weight=None, ignore_index=-100, lse_square_scale=0.0,
               label_smoothing=0.0, reduction="mean", softcap=None, use_token_scaling=False, logits=None):
    """Liger's loss, z_loss, token_accuracy, predicted_tokens in float64 (loss
    differentiable with respect to x, w, bias or logits)."""
    if logits is None:
        z = x.double() @ w.double().T
        if bias is not None:
            z = z + bias.double()
    else:
        z = logits.double()
    z = _softcap(z, softcap).reshape(-1, z.shape[-1])
    t = t.reshape(-1)
    valid = t != ignore_index
    safe = torch.where(valid, t, torch.zeros_like(t))
    cw = None if ce_weight is None else ce_weight.double()
    ce = F.cross_entropy(z, safe, weight=cw, reduction="none", label_smoothing=label_smoothing)
    ce = torch.where(valid, ce, torch.zeros_like(ce))
    lse = torch.logsumexp(z, -1)
    zl = torch.where(valid, lse_square_scale * lse * lse, torch.zeros_like(lse))
    n = int(valid.sum())
    p = torch.ones_like(ce)
    if use_token_scaling:
        p = torch.where(valid, torch.softmax(z, -1).gather(-1, safe[:, None])[:, 0], torch.zeros_like(ce)).detach()
    if reduction == "none":
        loss, zloss = (ce + zl) * p, zl * p
    elif reduction == "sum":
        loss, zloss = ((ce + zl) * p).sum(), (zl * p).sum()
    else:
        wsum = valid.double().sum() if cw is None else torch.where(valid, cw[safe], torch.zeros_like(ce)).sum()
        if n == 0:
            loss, zloss = (ce * 0).sum(), (zl * 0).sum()
        else:
            loss, zloss = (ce * p).sum() / wsum + (zl * p).sum() / n, (zl * p).sum() / n
    pred = torch.where(valid, z.argmax(-1), torch.full_like(t, -1))
    correct = (pred == t) & valid
    if reduction == "none":
        acc = correct.double()
    else:
        acc = correct.double().sum() / n if n else torch.tensor(math.nan, dtype=torch.float64)
    return loss, zloss, acc, pred


def _data(n=7, ignored=2, bias=False, weight=False, dtype=torch.float64, seed=0, shape=None):
    g = torch.Generator().manual_seed(seed)
    shape = shape or (n,)
    x = torch.randn(*shape, H, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    w = torch.randn(V, H, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    b = torch.randn(V, generator=g, dtype=torch.float64).to(dtype).requires_grad_() if bias else None
    t = torch.randint(0, V, shape, generator=g)
    t.view(-1)[:ignored] = -100
    cw = (torch.rand(V, generator=g, dtype=torch.float64) + 0.5).to(dtype) if weight else None
    return x, w, b, t, cw


def _grads(loss, params):
    loss = loss.sum() if loss.dim() else loss
    return torch.autograd.grad(loss, [p for p in params if p is not None], retain_graph=True)


OPTION_SETS = {
    "plain": {},
    "smoothing": dict(label_smoothing=0.1),
    "z_loss": dict(lse_square_scale=1e-2),
    "class_weight": dict(weight=True),
    "weight_z_loss": dict(weight=True, lse_square_scale=1e-2),  # two normalisers in "mean"
    "softcap": dict(softcap=3.0),
    "token_scaling": dict(use_token_scaling=True),
    "bias": dict(bias=True),
    "all": dict(weight=True, bias=True, label_smoothing=0.1, lse_square_scale=1e-2, softcap=3.0,
                use_token_scaling=True),
}


def _run_fused(opts, reduction, ignored, dtype, n=7, shape=None):
    opts = dict(opts)
    x, w, b, t, cw = _data(n=n, ignored=ignored, bias=opts.pop("bias", False), weight=opts.pop("weight", False),
                           dtype=dtype, shape=shape)
    out = liger.liger_fused_linear_cross_entropy(
        x, w, t, b, cw, reduction=reduction, return_z_loss=True, return_token_accuracy=True,
        return_predicted_tokens=True, **opts)
    ref = _reference(x, w, t, b, cw, reduction=reduction, **opts)
    return out, ref, [x, w, b]


def _assert_matches(out, ref, params, tol):
    loss, zloss, acc, pred = ref
    torch.testing.assert_close(out.loss.double(), loss.detach().reshape(out.loss.shape), rtol=tol, atol=tol)
    torch.testing.assert_close(out.z_loss.double(), zloss.detach().reshape(out.z_loss.shape), rtol=tol, atol=tol)
    torch.testing.assert_close(out.token_accuracy.double(), acc.reshape(out.token_accuracy.shape), equal_nan=True)
    assert torch.equal(out.predicted_tokens.reshape(-1), pred)
    for g1, g2 in zip(_grads(out.loss, params), _grads(loss, params)):
        torch.testing.assert_close(g1.double(), g2.double(), rtol=tol, atol=tol)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("name", list(OPTION_SETS))
@pytest.mark.parametrize("ignored", [2, 7])  # some ignored; all ignored
def test_fused_matches_float64_liger_semantics(name, reduction, ignored):
    out, ref, params = _run_fused(OPTION_SETS[name], reduction, ignored, torch.float64)
    _assert_matches(out, ref, params, 1e-9)
    if reduction == "mean" and ignored == 7:  # Liger's rule: 0, not torch's NaN; zero gradients
        assert out.loss.item() == 0.0
        assert all(torch.count_nonzero(g) == 0 for g in _grads(out.loss, params))


@pytest.fixture
def triton_backend(monkeypatch):
    """The drop-ins' logitless calls on backend="triton" (the CPU interpreter here)."""
    if torch.cuda.is_available():  # (conftest turns the interpreter on only without CUDA)
        pytest.skip("the Triton interpreter on CPU tensors: on a GPU machine the drop-ins' Triton path is "
                    "the public ops' CUDA path, tested by their own test files")
    for name in ("_lce", "_ce", "_linear_jsd", "_linear_log_probs"):
        monkeypatch.setattr(liger, name, functools.partial(getattr(liger, name), backend="triton"))


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("name", ["plain", "weight_z_loss", "all"])
def test_fused_on_triton_interpreter(triton_backend, name, reduction):
    out, ref, params = _run_fused(OPTION_SETS[name], reduction, 2, torch.float32)
    _assert_matches(out, ref, params, 2e-5)


def test_fused_3d_one_token_and_empty():
    out, ref, params = _run_fused({}, "none", 3, torch.float64, shape=(2, 3))
    assert out.loss.shape == (2, 3) and out.predicted_tokens.shape == (2, 3)
    _assert_matches(out, ref, params, 1e-9)
    out, ref, params = _run_fused(dict(lse_square_scale=1e-2), "mean", 0, torch.float64, n=1)
    _assert_matches(out, ref, params, 1e-9)
    x, w, _, _, _ = _data(n=0, ignored=0)
    loss = liger.liger_fused_linear_cross_entropy(x, w, torch.zeros(0, dtype=torch.long))
    assert loss.item() == 0.0  # no token: Liger's 0


def test_module_argument_order_and_return_types():
    x, w, b, t, cw = _data(bias=True, weight=True)
    fn = liger.LigerFusedLinearCrossEntropyLoss(ce_weight=cw, lse_square_scale=1e-2, label_smoothing=0.1)
    loss = fn(w, x, t, b)  # Liger: the weight first
    assert isinstance(loss, torch.Tensor) and loss.dim() == 0
    ref = _reference(x, w, t, b, cw, lse_square_scale=1e-2, label_smoothing=0.1)[0]
    torch.testing.assert_close(loss.double(), ref.detach(), rtol=1e-9, atol=1e-9)
    out = liger.LigerFusedLinearCrossEntropyLoss(return_token_accuracy=True)(w, x, t, b)
    assert isinstance(out, liger.CrossEntropyOutput)
    assert out.z_loss is None and out.predicted_tokens is None and out.token_accuracy.dim() == 0
    loss, z, acc, pred = liger.LigerFusedLinearCrossEntropyFunction.apply(x, w, t, b, None, -100, 1e-2)
    assert z is None and acc is None and pred is None
    ref = _reference(x, w, t, b, lse_square_scale=1e-2)[0]
    torch.testing.assert_close(loss.double(), ref.detach(), rtol=1e-9, atol=1e-9)


def test_ignore_index_other_than_default_and_predicted_tokens():
    x, w, b, t, cw = _data(ignored=0)
    t[1] = 5
    out = liger.liger_fused_linear_cross_entropy(x, w, t, ignore_index=5, reduction="none",
                                                 return_predicted_tokens=True)
    assert out.predicted_tokens[1].item() == -1 and out.loss[1].item() == 0.0
    ref = _reference(x, w, t, ignore_index=5, reduction="none")
    torch.testing.assert_close(out.loss.double(), ref[0].detach(), rtol=1e-9, atol=1e-9)
    assert torch.equal(out.predicted_tokens, ref[3])


def test_predicted_tokens_tie_takes_first_index():
    # (ties across the op's column chunks: test_linear_cross_entropy's argmax tie test)
    x = torch.zeros(2, H, dtype=torch.float64)
    w = torch.randn(V, H, dtype=torch.float64)
    out = liger.liger_fused_linear_cross_entropy(x, w, torch.tensor([3, -100]), return_predicted_tokens=True)
    assert out.predicted_tokens.tolist() == [0, -1]  # all logits equal: first index, as Liger
    x, w, b, t, _ = _data(bias=True)  # and chunked == plain argmax on random data
    out = liger.liger_fused_linear_cross_entropy(x, w, t, b, softcap=2.0, return_predicted_tokens=True)
    assert torch.equal(out.predicted_tokens, _reference(x, w, t, b, softcap=2.0)[3])
    # the loss's own pass: no second pass over the head for the predicted tokens
    calls = []
    orig = liger._lce
    liger._lce = lambda *a, **k: calls.append(1) or orig(*a, **k)
    try:
        liger.liger_fused_linear_cross_entropy(x, w, t, b, return_predicted_tokens=True, return_z_loss=True)
    finally:
        liger._lce = orig
    assert len(calls) == 1


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("name", ["plain", "weight_z_loss", "smoothing", "softcap"])
def test_cross_entropy_on_logits(name, reduction):
    opts = dict(OPTION_SETS[name])
    _, _, _, t, cw = _data(weight=opts.pop("weight", False))
    logits = torch.randn(7, V, dtype=torch.float64, requires_grad=True)
    fn = liger.LigerCrossEntropyLoss(weight=cw, reduction=reduction, return_z_loss=True,
                                     return_token_accuracy=True, return_predicted_tokens=True, **opts)
    out = fn(logits, t)
    ref = _reference(None, None, t, ce_weight=cw, reduction=reduction, logits=logits, **opts)
    _assert_matches(out, ref, [logits], 1e-9)
    plain = liger.liger_cross_entropy(logits, t, cw, reduction=reduction, **opts)
    torch.testing.assert_close(plain, out.loss)


def test_cross_entropy_loss_dtype_is_the_input_dtype():
    logits = torch.randn(5, V, dtype=torch.bfloat16)
    assert liger.liger_cross_entropy(logits, torch.arange(5)).dtype == torch.bfloat16


def test_bad_options_raise_clear_errors():
    x, w, _, t, _ = _data()
    with pytest.raises(ValueError, match="reduction"):
        liger.LigerFusedLinearCrossEntropyLoss(reduction="avg")
    with pytest.raises(ValueError, match="label_smoothing"):
        liger.LigerCrossEntropyLoss(label_smoothing=1.5)
    with pytest.raises(ValueError, match="softcap"):
        liger.liger_fused_linear_cross_entropy(x, w, t, softcap=0.0)
    with pytest.raises(TypeError, match="return_z_loss"):
        liger.liger_fused_linear_cross_entropy(x, w, t, return_z_loss=1)
    with pytest.raises(ValueError, match="chunk_mem_const"):
        liger.liger_fused_linear_cross_entropy(x, w, t, chunk_mem_const=0)
    with pytest.raises(ValueError, match="shift_labels"):
        liger.liger_jsd(torch.zeros(3, V), torch.zeros(3, V), torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match="temperature"):
        liger.LigerFusedLinearJSD(temperature=0)


# ----------------------------------------------------------------------------- JSD


def _jsd_reference(log_q, log_p, labels, beta, ignore_index=-100):
    """Liger's JSD of log-probabilities (free variables), float64."""
    x, y = log_q.double(), log_p.double()
    q, p = x.exp(), y.exp()
    if beta == 0.0:
        rows = (p * (y - x)).sum(-1)
    elif beta == 1.0:
        rows = (q * (x - y)).sum(-1)
    else:
        log_m = torch.log(beta * p + (1 - beta) * q)
        rows = (beta * p * (y - log_m) + (1 - beta) * q * (x - log_m)).sum(-1)
    if labels is None:
        return rows.mean()
    valid = labels != ignore_index
    n = int(valid.sum())
    return (rows * valid).sum() / n if n else (rows * 0).sum()


@pytest.mark.parametrize("beta", [0.0, 0.3, 1.0])
@pytest.mark.parametrize("labels", ["none", "some", "all_ignored"])
def test_log_space_jsd_matches_liger_semantics(beta, labels):
    g = torch.Generator().manual_seed(1)
    log_q = torch.randn(6, V, generator=g, dtype=torch.float64).log_softmax(-1).requires_grad_()
    log_p = torch.randn(6, V, generator=g, dtype=torch.float64).log_softmax(-1)
    lab = None if labels == "none" else torch.randint(0, V, (6,), generator=g)
    if labels == "some":
        lab[:2] = -100
    elif labels == "all_ignored":
        lab[:] = -100
    loss = liger.LigerJSD(beta=beta)(log_q, log_p, lab)
    ref = _jsd_reference(log_q, log_p, lab, beta)
    torch.testing.assert_close(loss, ref.detach(), rtol=1e-12, atol=1e-12)
    # the gradient with respect to log_q as a free variable, as Liger's
    torch.testing.assert_close(torch.autograd.grad(loss, log_q)[0], torch.autograd.grad(ref, log_q)[0],
                               rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(liger.liger_jsd(log_q, log_p, lab, beta=beta), loss)


def _fused_jsd_reference(xs, ws, xt, wt, labels, beta, temperature, ignore_index=-100):
    log_q = torch.log_softmax((xs.double() @ ws.double().T) / temperature, -1)
    log_p = torch.log_softmax((xt.double() @ wt.double().T) / temperature, -1)
    return _jsd_reference(log_q, log_p, labels, beta, ignore_index)


@pytest.mark.parametrize("beta,temperature", [(0.0, 1.0), (0.5, 2.0), (1.0, 0.7)])
@pytest.mark.parametrize("labels", ["none", "some", "all_ignored"])
def test_fused_jsd_matches_float64(beta, temperature, labels):
    g = torch.Generator().manual_seed(2)
    xs = torch.randn(5, H, generator=g, dtype=torch.float64, requires_grad=True)
    ws = torch.randn(V, H, generator=g, dtype=torch.float64, requires_grad=True)
    xt = torch.randn(5, H + 3, generator=g, dtype=torch.float64)
    wt = torch.randn(V, H + 3, generator=g, dtype=torch.float64)
    lab = None if labels == "none" else torch.randint(0, V, (5,), generator=g)
    if labels == "some":
        lab[1] = -100
    elif labels == "all_ignored":
        lab[:] = -100
    loss = liger.LigerFusedLinearJSD(jsd_beta=beta, temperature=temperature)(xs, ws, xt, wt, lab)
    ref = _fused_jsd_reference(xs, ws, xt, wt, lab, beta, temperature)
    torch.testing.assert_close(loss.double(), ref.detach(), rtol=1e-9, atol=1e-9)
    for a, b in zip(torch.autograd.grad(loss, [xs, ws]), torch.autograd.grad(ref, [xs, ws])):
        torch.testing.assert_close(a.double(), b, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(liger.liger_fused_linear_jsd(xs, ws, xt, wt, lab, beta, -100, temperature), loss)


def test_fused_jsd_on_triton_interpreter(triton_backend):
    g = torch.Generator().manual_seed(3)
    xs = torch.randn(5, H, generator=g, requires_grad=True)
    ws = torch.randn(V, H, generator=g, requires_grad=True)
    xt, wt = torch.randn(5, H, generator=g), torch.randn(V, H, generator=g)
    lab = torch.tensor([1, -100, 4, 0, 12])
    loss = liger.liger_fused_linear_jsd(xs, ws, xt, wt, lab, 0.4, -100, 1.5)
    ref = _fused_jsd_reference(xs, ws, xt, wt, lab, 0.4, 1.5)
    torch.testing.assert_close(loss.double(), ref.detach(), rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- the peer itself


@needs_peer
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("name", ["plain", "smoothing", "z_loss", "token_scaling", "bias"])
def test_fused_matches_liger_kernel(name, reduction):
    # (Liger's kernel fails on the Triton interpreter with class weights or a soft-cap:
    # it calls .to() on Python floats; those options are covered by the float64 tests.)
    opts = dict(OPTION_SETS[name])
    x, w, b, t, _ = _data(bias=opts.pop("bias", False), dtype=torch.float32, ignored=2)
    kw = dict(reduction=reduction, return_z_loss=True, return_token_accuracy=True,
              return_predicted_tokens=True, **opts)
    ours = liger.liger_fused_linear_cross_entropy(x, w, t, b, **kw)
    theirs = peer_functional.liger_fused_linear_cross_entropy(x, w, t, b, **kw)
    for field in ("loss", "z_loss", "token_accuracy"):
        torch.testing.assert_close(getattr(ours, field).float(), getattr(theirs, field).float(),
                                   rtol=1e-5, atol=1e-6)
    assert torch.equal(ours.predicted_tokens, theirs.predicted_tokens)
    params = [x, w, b]
    for a, c in zip(_grads(ours.loss, params), _grads(theirs.loss, params)):
        torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-6)


@needs_peer
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_log_space_jsd_matches_liger_kernel(beta):
    g = torch.Generator().manual_seed(4)
    log_q = torch.randn(6, V, generator=g).log_softmax(-1).requires_grad_()
    log_p = torch.randn(6, V, generator=g).log_softmax(-1)
    lab = torch.tensor([1, -100, 3, 4, -100, 2])
    ours = liger.liger_jsd(log_q, log_p, lab, beta)
    theirs = peer_functional.liger_jsd(log_q, log_p, lab, beta)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(torch.autograd.grad(ours, log_q)[0], torch.autograd.grad(theirs, log_q)[0],
                               rtol=1e-5, atol=1e-7)


def test_out_of_bounds_target_is_ligers_assertion():
    """Liger's logits-input loss raises AssertionError ("out of bounds") for a target
    outside [0, V) that is not ignore_index; the drop-in's error is that and a ValueError;
    ignore_index itself (negative or not) is no error."""
    from logitless.integrations import liger

    x = torch.randn(6, 11)
    t = torch.tensor([0, 3, -7, 10, 4, 5])
    loss_fn = liger.LigerCrossEntropyLoss(ignore_index=-7)
    loss_fn(x, t)  # -7 is ignore_index: fine
    bad = t.clone()
    bad[4] = 11
    with pytest.raises(AssertionError, match="out of bounds") as excinfo:
        loss_fn(x, bad)
    assert isinstance(excinfo.value, ValueError) and "flat position 4" in str(excinfo.value)
    with pytest.raises(AssertionError, match="out of bounds"):
        liger.liger_cross_entropy(x, torch.tensor([0, 1, 2, -1, 4, 5]))
