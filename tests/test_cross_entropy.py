"""cross_entropy (on logits) against the float64 reference, for every backend and option.

Runs on the GPU when there is one; otherwise the Triton backend runs on the CPU
interpreter (conftest.py), at small sizes.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import logitless
from logitless.ops.cross_entropy import CrossEntropyLoss, cross_entropy
from logitless.ops.cross_entropy.reference import cross_entropy_reference
from tests.conftest import DEVICE, HAS_CUDA
from tests.helpers import AllocationRecorder, assert_close_to_ref
from tests.op_specs import SPECS

BACKENDS = ["torch", "triton"]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]

#: The options of the contract suite (tests/op_specs.py), reused by the op-specific tests.
OPTIONS = SPECS["cross_entropy"].options


def make_inputs(lead, vocab, dtype, opts, seed, scale=3.0):
    """Fresh random leaf logits (..., V), targets and the op's keyword arguments."""
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(*lead, vocab, generator=g) * scale).to(dtype)
    target = torch.randint(0, vocab, lead, generator=g)
    if opts.get("_ignore"):
        target[torch.rand(lead, generator=g) < opts["_ignore"]] = opts.get("ignore_index", -100)
    kw = {k: v for k, v in opts.items() if not k.startswith("_")}
    if opts.get("_class_weight"):
        kw["class_weight"] = (torch.rand(vocab, generator=g) + 0.5).to(DEVICE)
    return logits.to(DEVICE).requires_grad_(), target.to(DEVICE), kw


def check_against_reference(backend, dtype, lead, vocab, opts, reduction, seed, budget=4096,
                            view=None):
    """Loss, stats and d(logits) against float64, with torch in the same dtype as the
    yardstick. ``view`` maps the leaf logits to the tensor passed in (strided inputs)."""
    leaf, target, kw = make_inputs(lead, vocab, dtype, opts, seed)
    logits = view(leaf) if view is not None else leaf
    target = target[..., : logits.shape[-2]] if logits.dim() > 1 else target
    loss, stats = cross_entropy(logits, target, reduction=reduction, backend=backend,
                                return_stats=True, memory_budget=budget, **kw)
    ref, ref_lse, ref_correct = cross_entropy_reference(logits, target, reduction=reduction, **kw)
    same, _, _ = cross_entropy_reference(logits, target, reduction=reduction, dtype=dtype, **kw)
    assert loss.dtype == torch.float32
    assert_close_to_ref("loss", loss, same, ref, dtype)
    assert_close_to_ref("lse", stats.lse, None, ref_lse, torch.float32)
    assert torch.equal(stats.correct.cpu(), ref_correct.cpu())  # same values in: same argmax
    assert stats.num_tokens.item() == (target != kw.get("ignore_index", -100)).sum().item()
    z = logits.detach().double()
    if kw.get("softcap") is not None:
        z = kw["softcap"] * torch.tanh(z / kw["softcap"])
    ref_argmax = torch.where(target != kw.get("ignore_index", -100), z.argmax(dim=-1), -1)
    assert stats.argmax.dtype == torch.int64 and torch.equal(stats.argmax.cpu(), ref_argmax.cpu())

    g = torch.Generator().manual_seed(seed + 1)
    grad_out = (torch.randn(loss.shape, generator=g) if reduction == "none" else torch.rand((), generator=g) + 0.5)
    grad_out = grad_out.to(DEVICE)
    (ours,) = torch.autograd.grad(loss, leaf, grad_out)
    (theirs,) = torch.autograd.grad(ref, leaf, grad_out.double())
    (same_g,) = torch.autograd.grad(same, leaf, grad_out.to(dtype))
    assert ours.dtype == dtype
    assert_close_to_ref("dlogits", ours, same_g, theirs, dtype)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("option", ["plain", "all"])
def test_reductions(backend, reduction, option):
    for dtype in DTYPES:
        check_against_reference(backend, dtype, (29,), 131, OPTIONS[option], reduction, seed=7)


VIEWS = {
    # (N, V) with column stride N: read through the strides, no copy.
    "transposed": (lambda t: t.T.contiguous().T, (23,), 70),
    # Rows with padding between them (row stride V + 9): a view.
    "row-padding": (lambda t: F.pad(t, (0, 9))[:, :70], (23,), 70),
    # (B, T, V)[:, :-1]: leading dims that cannot merge; reshape copies.
    "shifted-3d": (lambda t: t[:, :-1], (3, 8), 70),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("view", list(VIEWS))
def test_strided_logits(backend, view):
    fn, lead, vocab = VIEWS[view]
    for reduction in ("mean", "none"):
        check_against_reference(backend, torch.bfloat16, lead, vocab, OPTIONS["all"], reduction,
                                seed=4, view=fn)


def _storage(t):
    return t.untyped_storage().data_ptr()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_inplace_backward(backend, reduction, dtype):
    logits, target, kw = make_inputs((4, 9), 83, dtype, OPTIONS["all"], seed=5)
    grad_out = torch.randn(4, 9, device=DEVICE) if reduction == "none" else None
    loss = cross_entropy(logits, target, reduction=reduction, backend=backend, **kw)
    (expected,) = torch.autograd.grad(loss, logits, grad_out)

    inplace = logits.detach().clone().requires_grad_()
    loss2 = cross_entropy(inplace, target, reduction=reduction, backend=backend,
                          inplace_backward=True, **kw)
    assert torch.equal(loss2, loss)
    (got,) = torch.autograd.grad(loss2, inplace, grad_out, retain_graph=True)
    assert torch.equal(got, expected)
    assert _storage(got) == _storage(inplace) and got.data_ptr() == inplace.data_ptr()
    assert torch.equal(inplace.detach(), expected)  # the logits are gone: they hold dz
    with pytest.raises(RuntimeError, match="only once"):
        torch.autograd.grad(loss2, inplace, grad_out)

    # .backward() on a leaf: the gradient is the logits' buffer (no new N x V tensor).
    leaf = logits.detach().clone().requires_grad_()
    cross_entropy(leaf, target, reduction=reduction, backend=backend, inplace_backward=True,
                  **kw).backward(grad_out)
    assert torch.equal(leaf.grad, expected) and leaf.grad.data_ptr() == leaf.data_ptr()


@pytest.mark.parametrize("backend", BACKENDS)
def test_inplace_backward_strided_and_through_lm_head(backend):
    for view in ("transposed", "row-padding"):
        fn, lead, vocab = VIEWS[view]
        leaf, target, kw = make_inputs(lead, vocab, torch.bfloat16, OPTIONS["all"], seed=6)
        (expected,) = torch.autograd.grad(cross_entropy(fn(leaf), target, backend=backend, **kw), leaf)
        base = leaf.detach().clone().requires_grad_()
        logits = fn(base)
        (got,) = torch.autograd.grad(
            cross_entropy(logits, target, backend=backend, inplace_backward=True, **kw), logits)
        assert got.data_ptr() == logits.data_ptr() and got.stride() == logits.stride()
        (got_leaf,) = torch.autograd.grad(fn(base), base, got)  # back through the view
        assert torch.equal(got_leaf, expected)

    # The intended use: logits = lm_head(h); its backward needs h and W, not the logits.
    g = torch.Generator().manual_seed(0)
    h = torch.randn(30, 16, generator=g).to(DEVICE).requires_grad_()
    w = torch.randn(90, 16, generator=g).to(DEVICE).requires_grad_()
    target = torch.randint(0, 90, (30,), generator=g).to(DEVICE)
    grads = [torch.autograd.grad(cross_entropy(h @ w.T, target, backend=backend, z_loss=1e-3,
                                               inplace_backward=inplace), (h, w))
             for inplace in (False, True)]
    for a, b in zip(*grads):
        assert torch.equal(a, b)


@pytest.mark.parametrize("backend", BACKENDS)
def test_inplace_backward_guards(backend):
    logits, target, _ = make_inputs((8,), 20, torch.float32, {}, seed=1)
    # A node that saved the logits would read the gradient: autograd raises instead.
    saved = torch.exp(logits)  # exp's backward uses its output
    loss = cross_entropy(saved, target, backend=backend, inplace_backward=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
    # Overlapping elements (an expanded row) cannot take the gradient in place.
    row = logits[:1].expand(8, 20)
    with pytest.raises(ValueError, match="overlap"):
        cross_entropy(row, target, backend=backend, inplace_backward=True)
    cross_entropy(row, target, backend=backend).backward()  # fine without inplace


@pytest.mark.parametrize("backend", BACKENDS)
def test_small_budget_many_chunks(backend):
    """A budget below one row: one row per chunk (torch), same result."""
    check_against_reference(backend, torch.float32, (17,), 211, OPTIONS["all"], "none", seed=13,
                            budget=1)


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_tokens_by_vocab_temporaries_inplace(backend):
    """With inplace_backward, not even the gradient is a new N x V tensor (the contract
    suite checks the usual path: the gradient only)."""
    n, v = 40, 160
    logits, target, kw = make_inputs((n,), v, torch.bfloat16, OPTIONS["all"], seed=1)
    with AllocationRecorder(threshold=n * v) as fwd:
        loss = cross_entropy(logits, target, backend=backend, memory_budget=4096,
                             inplace_backward=True, return_stats=True, **kw)[0]
    assert fwd.big == []
    with AllocationRecorder(threshold=n * v) as bwd:
        torch.autograd.grad(loss, logits)
    assert bwd.big == []


@pytest.mark.parametrize("backend", BACKENDS)
def test_bitwise_repeatable(backend):
    logits, target, kw = make_inputs((40,), 131, torch.bfloat16, OPTIONS["all"], seed=2)
    runs = []
    for _ in range(2):
        loss = cross_entropy(logits, target, backend=backend, memory_budget=3000, **kw)
        runs.append((loss, *torch.autograd.grad(loss, logits)))
    for a, b in zip(*runs):
        assert torch.equal(a, b)


@pytest.mark.parametrize("backend", BACKENDS)
def test_backward_twice_and_int32_targets(backend):
    logits, target, _ = make_inputs((20,), 50, torch.float32, {}, seed=4)
    loss = cross_entropy(logits, target.int(), backend=backend)
    g1 = torch.autograd.grad(loss, logits, retain_graph=True)
    g2 = torch.autograd.grad(loss, logits)
    assert torch.equal(loss, cross_entropy(logits, target, backend=backend))
    assert torch.equal(g1[0], g2[0])


def test_module_matches_function():
    logits, target, kw = make_inputs((2, 9), 70, torch.float32, OPTIONS["all"], seed=6)
    mod = CrossEntropyLoss(**kw)
    assert torch.equal(mod(logits, target), cross_entropy(logits, target, **kw))
    assert "z_loss=0.001" in repr(mod)
    loss, stats = CrossEntropyLoss(return_stats=True, reduction="none")(logits, target)
    assert loss.shape == stats.lse.shape == stats.correct.shape == (2, 9)


@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_and_inf_logits(backend):
    logits, target, _ = make_inputs((6,), 90, torch.float32, {}, seed=8)
    x = logits.detach().clone()
    x[2, 3] = float("nan")
    loss = cross_entropy(x, target, backend=backend, reduction="none")
    assert torch.isnan(loss[2]) and not torch.isnan(loss[[0, 1, 3, 4, 5]]).any()
    assert torch.isnan(cross_entropy(x, target, backend=backend))
    x[2, 3] = float("inf")
    assert torch.isnan(cross_entropy(x, target, backend=backend))

    # -inf logits (masked classes) are fine, also when a whole leading block is -inf.
    x = logits.detach().clone()
    target[:] = 80
    x[:, :70] = float("-inf")
    x[1, 75:] = float("-inf")
    x[1, 80] = 1.0
    x.requires_grad_()
    ours = cross_entropy(x, target, backend=backend, reduction="none")
    ref, _, _ = cross_entropy_reference(x, target, reduction="none")
    torch.testing.assert_close(ours.double(), ref, rtol=1e-6, atol=1e-6)
    (g,) = torch.autograd.grad(ours.sum(), x)
    (g_ref,) = torch.autograd.grad(ref.sum(), x)
    torch.testing.assert_close(g, g_ref, rtol=1e-6, atol=1e-6)


@pytest.mark.skipif(not HAS_CUDA, reason="the NaN path for bad targets is the GPU path")
def test_out_of_range_target_gives_nan_on_gpu():
    logits, target, _ = make_inputs((6,), 40, torch.bfloat16, {}, seed=10)
    target[3] = 40
    loss = cross_entropy(logits, target, reduction="none")
    assert torch.isnan(loss[3]) and not torch.isnan(loss[[0, 1, 2, 4, 5]]).any()
    assert torch.isnan(cross_entropy(logits, target))


@pytest.mark.skipif(HAS_CUDA, reason="checks the message given without CUDA and without the interpreter")
def test_triton_on_cpu_without_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="needs CUDA"):
        cross_entropy(torch.randn(4, 10), torch.zeros(4, dtype=torch.long), backend="triton")


def test_exported_from_package():
    if "CrossEntropyLoss" not in logitless.__all__:
        pytest.skip("logitless/__init__.py does not export cross_entropy yet")
    assert logitless.cross_entropy is cross_entropy and logitless.CrossEntropyLoss is CrossEntropyLoss


@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("option", ["all", "label_smoothing", "plain"])
def test_cuda_auto_is_triton_without_host_syncs(option):
    logits, target, kw = make_inputs((64, 5), 1000, torch.bfloat16, OPTIONS[option], seed=14)
    expected = cross_entropy(logits, target, backend="triton", return_stats=True, **kw)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for inplace in (False, True):
            x = logits.detach().clone().requires_grad_()
            loss, stats = cross_entropy(x, target, return_stats=True, inplace_backward=inplace, **kw)
            loss.backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(loss, expected[0]) and torch.equal(stats.lse, expected[1].lse)
    assert torch.equal(stats.correct, expected[1].correct)


@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA (too slow for the interpreter)")
def test_cuda_large_vocab():
    for reduction in ("mean", "none"):
        check_against_reference("triton", torch.bfloat16, (300,), 50257, OPTIONS["all"], reduction, seed=5)


@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA and about 5 GB of GPU memory")
def test_cuda_offsets_beyond_int32():
    """N * V > 2**31: rows near the end address past 32-bit offsets."""
    n, v = 16400, 131072
    logits = torch.randn(n, v, dtype=torch.bfloat16, device="cuda").requires_grad_()
    target = torch.randint(0, v, (n,), device="cuda")
    tail = logits.detach()[-3:].double().requires_grad_()
    ref, _, _ = cross_entropy_reference(tail, target[-3:], reduction="none")
    (g_ref,) = torch.autograd.grad(ref.sum(), tail)
    loss = cross_entropy(logits, target, reduction="none", inplace_backward=True, backend="triton")
    torch.testing.assert_close(loss[-3:].double(), ref, rtol=1e-5, atol=1e-5)
    (g,) = torch.autograd.grad(loss.sum(), logits)
    torch.testing.assert_close(g[-3:].double(), g_ref, rtol=2e-2, atol=1e-7)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("inplace", [False, True])
def test_stats_lse_is_differentiable(backend, inplace):
    """stats.lse carries its gradient (the softmax) into the logits, with the loss's."""
    g = torch.Generator().manual_seed(3)
    logits = (torch.randn(7, 33, generator=g) * 2).to(DEVICE).requires_grad_()
    target = torch.randint(0, 33, (7,), generator=g).to(DEVICE)
    r = torch.randn(7, generator=g).to(DEVICE)
    z = logits.clone() if inplace else logits
    loss, stats = cross_entropy(z, target, backend=backend, return_stats=True, softcap=5.0,
                                inplace_backward=inplace)
    (ours,) = torch.autograd.grad(loss + (stats.lse * r).sum(), logits)
    zd = 5.0 * torch.tanh(logits.double() / 5.0)
    ref = torch.nn.functional.cross_entropy(zd, target) + (torch.logsumexp(zd, -1) * r.double()).sum()
    (expected,) = torch.autograd.grad(ref, logits)
    torch.testing.assert_close(ours.double(), expected.double(), rtol=1e-5, atol=1e-6)


# ---- class-probability (soft) targets: torch's semantics ----

def _soft_inputs(shape, seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    z = (torch.randn(*shape, generator=g, dtype=torch.float64) * 2).to(dtype).requires_grad_()
    y = torch.rand(*shape, generator=g, dtype=torch.float64).softmax(-1 if len(shape) < 3 else 1)
    return z, y.to(dtype).requires_grad_()


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("opts", [{}, {"label_smoothing": 0.2}, {"class_weight": True},
                                  {"label_smoothing": 0.15, "class_weight": True}])
@pytest.mark.parametrize("shape", [(7, 13), (1, 13), (13,), (0, 13)])
def test_soft_targets_match_torch_float64(shape, opts, reduction):
    z, y = _soft_inputs(shape, seed=len(shape) * 10 + shape[0])
    kw = {"label_smoothing": opts.get("label_smoothing", 0.0)}
    if opts.get("class_weight"):
        kw["weight"] = torch.rand(shape[-1], generator=torch.Generator().manual_seed(3), dtype=torch.float64) + 0.5
    ours = cross_entropy(z, y, reduction=reduction, **kw)
    z2, y2 = z.detach().clone().requires_grad_(), y.detach().clone().requires_grad_()
    ref = F.cross_entropy(z2, y2, reduction=reduction, **kw)
    assert ours.shape == ref.shape and ours.dtype == torch.float64
    torch.testing.assert_close(ours, ref, rtol=1e-12, atol=1e-12, equal_nan=True)
    if z.numel():
        up = torch.randn(ours.shape, dtype=torch.float64)
        gz, gy = torch.autograd.grad((ours * up).sum(), (z, y))
        rz, ry = torch.autograd.grad((ref * up).sum(), (z2, y2))
        torch.testing.assert_close(gz, rz, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(gy, ry, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("class_dim", [1, -1])
def test_soft_targets_3d_layouts(class_dim):
    z, y = _soft_inputs((3, 11, 4), seed=5)  # torch's (N, C, d)
    ref = F.cross_entropy(z, y, reduction="none", label_smoothing=0.1)
    if class_dim == 1:
        ours = cross_entropy(z, y, reduction="none", label_smoothing=0.1, class_dim=1)
    else:
        ours = cross_entropy(z.movedim(1, -1), y.movedim(1, -1), reduction="none", label_smoothing=0.1,
                             class_dim=-1)
    assert ours.shape == ref.shape == (3, 4)
    torch.testing.assert_close(ours, ref, rtol=1e-12, atol=1e-12)


def test_soft_targets_softcap_z_loss_low_precision_and_module():
    z, y = _soft_inputs((5, 17), seed=8)
    ours = cross_entropy(z, y, softcap=3.0, z_loss=1e-2)
    zc = 3.0 * torch.tanh(z / 3.0)
    lse = torch.logsumexp(zc, -1)
    ref = F.cross_entropy(zc, y, reduction="none") + 1e-2 * lse ** 2
    torch.testing.assert_close(ours, ref.mean(), rtol=1e-12, atol=1e-12)
    zb = z.detach().to(torch.bfloat16).requires_grad_()
    lb = cross_entropy(zb, y.detach().to(torch.bfloat16))
    assert lb.dtype == torch.float32
    rb = F.cross_entropy(zb.detach().double(), y.detach().to(torch.bfloat16).double())
    assert abs(lb.double() - rb) < 1e-5
    lb.backward()
    assert zb.grad.dtype == torch.bfloat16
    mod = CrossEntropyLoss(label_smoothing=0.1, reduction="sum")
    torch.testing.assert_close(mod(z, y), F.cross_entropy(z, y, label_smoothing=0.1, reduction="sum"),
                               rtol=1e-12, atol=1e-12)


def test_soft_targets_check_options():
    z, y = _soft_inputs((3, 7), seed=1)
    with pytest.raises(ValueError, match="backend"):
        cross_entropy(z, y, backend="cuda")
    with pytest.raises(ValueError, match="memory_budget"):
        cross_entropy(z, y, memory_budget=0)
    with pytest.raises(ValueError, match="inplace_backward"):
        cross_entropy(z, y, inplace_backward=True)
    with pytest.raises(ValueError, match="label_smoothing"):
        cross_entropy(z, y, label_smoothing=1.5)
    with pytest.raises(ValueError, match="class_weight"):
        cross_entropy(z, y, weight=torch.ones(6, dtype=torch.float64))
    cw = torch.rand(7, dtype=torch.float64, requires_grad=True)
    cross_entropy(z, y, weight=cw).backward()
    assert cw.grad is None  # class weights receive no gradient, as with class indices
