"""Both ops the way training loops call them: autocast, torch.compile, custom-op checks,
double backward, and what a newcomer tried (empty shifted sequences, torch's
(N, C, d1, ...) layout and ``weight=`` for cross_entropy).

CPU: autocast in bf16, compile with the torch backend and (small) with the Triton one
on the interpreter. On a GPU the same tests run on CUDA tensors.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging

import pytest
import torch
import torch.nn.functional as F

import logitless
from logitless import cross_entropy, linear_cross_entropy
from logitless.ops.common.contract import Needs
from logitless.ops.cross_entropy.reference import cross_entropy_reference
from logitless.ops.linear_cross_entropy.api import OPS as LCE
from logitless.ops.linear_cross_entropy.contract import LceCall
from logitless.ops.linear_cross_entropy.reference import linear_cross_entropy_reference
from logitless.options import CrossEntropyOptions, VocabParallelOptions
from tests.conftest import DEVICE, HAS_CUDA
from tests.helpers import assert_close_to_ref

BACKENDS = ["torch", "triton"]
DEV = DEVICE.type
#: The dtype autocast uses in these tests (bf16: what CPU and H100 training use).
AMP = torch.bfloat16


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _lce_inputs(lead, hidden, vocab, seed, dtype=torch.float32, bias=True):
    g = _gen(seed)
    x = torch.randn(*lead, hidden, generator=g).to(dtype).to(DEVICE).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=g) * hidden**-0.5 * 2).to(DEVICE).requires_grad_()
    b = (torch.randn(vocab, generator=g) * 0.5).to(DEVICE).requires_grad_() if bias else None
    t = torch.randint(0, vocab, lead, generator=g)
    t[torch.rand(lead, generator=g) < 0.2] = -100
    return x, w, b, t.to(DEVICE)


def _rounded_leaf(t, dtype=AMP):
    """A float64 leaf holding what autocast computes with: ``t`` rounded to ``dtype``."""
    return None if t is None else t.detach().to(dtype).double().requires_grad_()


# --------------------------------------------------------------------------- autocast


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("x_dtype", [torch.float32, AMP], ids=str)
@pytest.mark.parametrize("option", ["plain", "all"])
def test_autocast_linear_cross_entropy(backend, x_dtype, option):
    """fp32 parameters under autocast (x fp32: a Llama's final norm; or x bf16): computed
    in bf16 like F.linear, loss fp32, each gradient in its input's dtype."""
    kw = dict(label_smoothing=0.1, z_loss=1e-3, softcap=5.0, shift=True) if option == "all" else {}
    x, w, b, t = _lce_inputs((2, 9), 24, 67, seed=1, dtype=x_dtype, bias=option == "all")
    with torch.autocast(DEV, dtype=AMP):
        loss = linear_cross_entropy(x, w, t, b, backend=backend, **kw)
        # What a user writes in plain torch under autocast.
        theirs = _torch_autocast_lce(x, w, t, b, **kw)
    assert loss.dtype == torch.float32 and theirs.dtype == torch.float32
    xr, wr, br = _rounded_leaf(x), _rounded_leaf(w), _rounded_leaf(b)
    ref = linear_cross_entropy_reference(xr, wr, t, br, **kw)[0]
    assert_close_to_ref("loss", loss, theirs, ref, AMP)
    inputs = [i for i in (x, w, b) if i is not None]
    ours = torch.autograd.grad(loss, inputs)
    torch_g = torch.autograd.grad(theirs, inputs)
    refs = torch.autograd.grad(ref, [i for i in (xr, wr, br) if i is not None])
    for name, o, s, r, i in zip(["dx", "dW", "db"], ours, torch_g, refs, inputs):
        assert o.dtype == i.dtype, f"{name}: {o.dtype} for a {i.dtype} input"
        assert_close_to_ref(name, o, s, r, AMP)


def _torch_autocast_lce(x, w, t, b, label_smoothing=0.0, z_loss=0.0, softcap=None, shift=False):
    """F.linear + F.cross_entropy under autocast (the logits materialised)."""
    z = F.linear(x, w, b).float()
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    if shift:
        z, t = z[..., :-1, :], t[..., 1:]
    lse = torch.logsumexp(z, -1)
    valid = t != -100
    loss = F.cross_entropy(z.flatten(0, -2), t.flatten(), label_smoothing=label_smoothing,
                           reduction="sum")
    loss = loss + z_loss * (lse.square() * valid).sum()
    return loss / valid.sum()


def test_autocast_mixed_dtypes_only_inside_autocast():
    x, w, b, t = _lce_inputs((5,), 16, 30, seed=2, dtype=AMP)
    with pytest.raises(TypeError, match="autocast"):
        linear_cross_entropy(x, w, t)  # bf16 x, fp32 weight, no autocast
    with torch.autocast(DEV, dtype=AMP):
        linear_cross_entropy(x, w, t, b).backward()
    assert w.grad.dtype == torch.float32 and x.grad.dtype == AMP and b.grad.dtype == torch.float32
    # Autocast for another device type changes nothing here.
    other = "cuda" if DEV == "cpu" else "cpu"
    if other == "cpu" or HAS_CUDA:
        with torch.autocast(other, dtype=AMP), pytest.raises(TypeError, match="must match"):
            linear_cross_entropy(x, w, t)


def test_autocast_leaves_float64_alone():
    """As torch's autocast: float64 is not cast (the torch backend computes in fp64)."""
    x, w, b, t = _lce_inputs((4,), 12, 20, seed=3, dtype=torch.float64)
    w = w.detach().double().requires_grad_()
    with torch.autocast(DEV, dtype=AMP):
        loss = linear_cross_entropy(x, w, t, backend="torch")
    ref = linear_cross_entropy_reference(x, w, t)[0]
    assert loss.dtype == torch.float64
    torch.testing.assert_close(loss, ref, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("backend", BACKENDS)
def test_autocast_cross_entropy_on_autocast_logits(backend):
    """bf16 logits from an autocast matmul: as F.cross_entropy under autocast (fp32
    statistics, loss fp32), the logits' gradient in bf16, the parameters' in fp32."""
    x, w, _, t = _lce_inputs((3, 7), 20, 53, seed=4, bias=False)
    with torch.autocast(DEV, dtype=AMP):
        logits = x @ w.T
        assert logits.dtype == AMP
        logits.retain_grad()
        loss = cross_entropy(logits, t, backend=backend, label_smoothing=0.1)
        theirs = F.cross_entropy(logits.flatten(0, 1), t.flatten(), label_smoothing=0.1)
    assert loss.dtype == theirs.dtype == torch.float32
    leaf = logits.detach().double().requires_grad_()
    ref, _, _ = cross_entropy_reference(leaf, t, label_smoothing=0.1)
    assert_close_to_ref("loss", loss, theirs, ref, torch.float32)
    loss.backward(retain_graph=True)  # the matmul's graph serves both losses
    assert logits.grad.dtype == AMP and x.grad.dtype == w.grad.dtype == torch.float32
    ours = (logits.grad.clone(), x.grad.clone(), w.grad.clone())
    logits.grad = x.grad = w.grad = None
    theirs.backward()
    (ref_grad,) = torch.autograd.grad(ref, leaf)
    assert_close_to_ref("dlogits", ours[0], logits.grad, ref_grad, AMP)
    for a, b in zip(ours[1:], (x.grad, w.grad)):  # bf16 roundings of dlogits may differ
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-3)


# --------------------------------------------------------------------------- compile


class _LCEModel(torch.nn.Module):
    """Embedding -> norm -> head, the loss from linear_cross_entropy (a causal LM)."""

    def __init__(self, vocab=61, hidden=24, **loss_kw):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, hidden)
        self.norm = torch.nn.LayerNorm(hidden)
        self.head = torch.nn.Linear(hidden, vocab, bias=False)
        self.loss_kw = loss_kw

    def forward(self, ids, labels):
        h = self.norm(self.emb(ids))
        return linear_cross_entropy(h, self.head.weight, labels, shift=True, **self.loss_kw)


class _CEModel(_LCEModel):
    """The same, with the logits materialised and cross_entropy on them."""

    def forward(self, ids, labels):
        logits = self.head(self.norm(self.emb(ids)))
        return cross_entropy(logits[:, :-1], labels[:, 1:], **self.loss_kw)


def _loss_and_grads(model, fn, ids, labels):
    model.zero_grad(set_to_none=True)
    loss = fn(ids, labels)
    if isinstance(loss, tuple):
        loss = loss[0] + loss[1].lse.nan_to_num().mean() * 0  # stats reach the graph too
    loss.backward()
    return [loss.detach()] + [p.grad.clone() for p in model.parameters()]


def _check_compiled(model, dynamic, shapes=((2, 9), (3, 5))):
    torch._dynamo.reset()
    g = _gen(0)
    ids = torch.randint(0, 61, shapes[0], generator=g).to(DEVICE)
    explained = torch._dynamo.explain(model)(ids, ids)
    assert explained.graph_break_count == 0, explained.break_reasons
    compiled = torch.compile(model, fullgraph=True, dynamic=dynamic)
    for shape in shapes:  # a second shape: recompiled (static) or reused (dynamic)
        ids = torch.randint(0, 61, shape, generator=g).to(DEVICE)
        labels = ids.clone()
        labels[0, 2] = -100
        eager = _loss_and_grads(model, model, ids, labels)
        comp = _loss_and_grads(model, compiled, ids, labels)
        for a, b in zip(eager, comp):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("model", ["lce", "ce"])
def test_compile_fullgraph_same_as_eager(backend, dynamic, model):
    cls = _LCEModel if model == "lce" else _CEModel
    kw = dict(backend=backend, label_smoothing=0.1, z_loss=1e-3)
    _check_compiled(cls(**kw).to(DEVICE), dynamic)


@pytest.mark.parametrize("backend", BACKENDS)
def test_compile_return_stats_and_budget_modes(backend):
    """return_stats, reduction="none", and the Triton plan keeping part of the logits."""
    kw = dict(backend=backend, return_stats=True, memory_budget=6_000, softcap=6.0)
    torch.manual_seed(0)
    _check_compiled(_LCEModel(**kw).to(DEVICE), dynamic=True)
    _check_compiled(_CEModel(**kw).to(DEVICE), dynamic=False)


@pytest.mark.parametrize("backend", BACKENDS)
def test_compile_under_autocast(backend):
    """The usual training step: fp32 parameters, autocast bf16, a compiled model."""
    torch.manual_seed(1)
    model = _LCEModel(backend=backend).to(DEVICE)
    ids = torch.randint(0, 61, (2, 9)).to(DEVICE)
    compiled = torch.compile(model, fullgraph=True)
    with torch.autocast(DEV, dtype=AMP):
        eager = _loss_and_grads(model, model, ids, ids)
        comp = _loss_and_grads(model, compiled, ids, ids)
    for a, b in zip(eager, comp):
        assert b.dtype == a.dtype
        torch.testing.assert_close(a, b, rtol=2e-2, atol=1e-3)
    assert all(p.grad.dtype == torch.float32 for p in model.parameters())


def test_compile_module_forms_and_target_check():
    """The Module forms (class weights as buffers, weight= alias) compile whole; a bad
    target still raises the clear error on the CPU (the check runs inside the op)."""
    g = _gen(11)
    cw = torch.rand(40, generator=g).to(DEVICE) + 0.5
    lce = logitless.LinearCrossEntropyLoss(class_weight=cw, z_loss=1e-3)
    ce = logitless.CrossEntropyLoss(weight=cw, label_smoothing=0.1)

    def both(h, w, y):
        return lce(h, w, y) + ce(h @ w.T, y)

    h = torch.randn(9, 16, generator=g).to(DEVICE).requires_grad_()
    w = torch.randn(40, 16, generator=g).to(DEVICE).requires_grad_()
    y = torch.randint(0, 40, (9,), generator=g).to(DEVICE)
    torch._dynamo.reset()
    compiled = torch.compile(both, fullgraph=True)
    eager = [both(h, w, y)]
    eager += torch.autograd.grad(eager[0], (h, w))
    comp = [compiled(h, w, y)]
    comp += torch.autograd.grad(comp[0], (h, w))
    for a, b in zip(eager, comp):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    if DEVICE.type == "cpu":
        bad = y.clone()
        bad[4] = 40
        with pytest.raises(ValueError, match="outside"):
            compiled(h, w, bad)


@pytest.mark.skipif(not HAS_CUDA, reason="host syncs only exist with a GPU")
@pytest.mark.parametrize("model", ["lce", "ce"])
def test_compiled_step_has_no_host_sync(model):
    cls = _LCEModel if model == "lce" else _CEModel
    net = cls(vocab=1000, hidden=64, z_loss=1e-3, label_smoothing=0.1).cuda()
    ids = torch.randint(0, 1000, (2, 50), device="cuda")
    compiled = torch.compile(net, fullgraph=True)
    with torch.autocast("cuda", dtype=AMP):
        compiled(ids, ids).backward()  # compile first
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.autocast("cuda", dtype=AMP):
            compiled(ids, ids).backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.skipif(not HAS_CUDA, reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("budget", [None, 1 << 30], ids=["default", "keep-all"])
def test_cuda_graph_capture_replays_the_eager_step(budget):
    """A forward+backward captured in a CUDA graph (torch.cuda.graph, as training loops
    that capture whole steps do) replays with no host work and gives eager's loss and
    gradients bit for bit, with recomputed (default budget) and kept columns."""
    x = torch.randn(700, 136, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(3000, 136, device="cuda") * 0.1).to(torch.bfloat16).requires_grad_(True)
    t = torch.randint(0, 3000, (700,), device="cuda")
    t[::7] = -100

    def step():
        x.grad = w.grad = None
        loss = linear_cross_entropy(x, w, t, memory_budget=budget, z_loss=1e-4)
        loss.backward()
        return loss

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up (compiles kernels) off the capture
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    x.grad = w.grad = None
    with torch.cuda.graph(graph):
        loss = linear_cross_entropy(x, w, t, memory_budget=budget, z_loss=1e-4)
        loss.backward()
    with torch.no_grad():  # new inputs in the captured tensors, then replay
        x.copy_(torch.randn_like(x))
        t.copy_(torch.randint(0, 3000, (700,), device="cuda"))
    graph.replay()
    torch.cuda.synchronize()
    got = (loss.clone(), x.grad.clone(), w.grad.clone())
    expected = step()
    assert torch.equal(got[0], expected)
    assert torch.equal(got[1], x.grad) and torch.equal(got[2], w.grad)


def test_inference_uses_the_forward_that_keeps_nothing(monkeypatch):
    """Under no_grad (eager and compiled) the Triton forward is asked for no kept columns."""
    from logitless.ops.linear_cross_entropy.triton_backend import TritonBackend

    seen = []
    real = TritonBackend.plan

    def spy(*args, **kw):
        if kw.get("cute", True):  # (the forward's plan; the fake plans without the CuTe choice)
            seen.append(kw["need_grad"])
        return real(*args, **kw)

    monkeypatch.setattr(TritonBackend, "plan", staticmethod(spy))
    model = _LCEModel(backend="triton").to(DEVICE)
    ids = torch.randint(0, 61, (2, 6)).to(DEVICE)
    compiled = torch.compile(model, fullgraph=True)
    with torch.no_grad():
        model(ids, ids)
        compiled(ids, ids)
    model(ids, ids).backward()
    assert seen == [False, False, True]


@contextlib.contextmanager
def capture_logs(name: str):
    """The log records of logger ``name`` and its children while the block runs."""
    records = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = records.append
    logger = logging.getLogger(name)
    logger.addHandler(handler)
    try:
        yield records
    finally:
        logger.removeHandler(handler)


def test_inplace_backward_is_eager_only():
    """fullgraph=True raises our error; without it the call is a graph break that runs
    eagerly, gradient in place included."""
    logits = torch.randn(6, 20, device=DEVICE, requires_grad=True)
    t = torch.randint(0, 20, (6,), device=DEVICE)

    def f(z, y):
        return cross_entropy(z * 2.0, y, inplace_backward=True)

    torch._dynamo.reset()
    # Our message is the error (its first line), a RuntimeError, not Dynamo's "Observed exception".
    with pytest.raises(RuntimeError, match=r"^cross_entropy\(\.\.\., inplace_backward=True\) is not supported "
                       "under torch.compile"):
        torch.compile(f, fullgraph=True)(logits, t)
    (expected,) = torch.autograd.grad(cross_entropy(logits * 2.0, t), logits)
    # Without fullgraph: a quiet graph break (Dynamo never traces the op's target check,
    # whose host sync printed a ~20-line graph-break warning).
    with capture_logs("torch._dynamo") as records:
        (got,) = torch.autograd.grad(torch.compile(f)(logits, t), logits)
    torch.testing.assert_close(got, expected)
    assert not [r for r in records if r.levelno >= logging.WARNING], [r.getMessage()[:200] for r in records]


# --------------------------------------------------------------------------- custom ops


def test_backward_runs_with_the_forwards_plan():
    """The plan that laid out the kept columns (tiles may be tuned or forced while the
    forward runs) travels to the backward as a tensor, not re-derived there."""
    from logitless.planning.overrides import override

    x, w, b, t = _lce_inputs((37,), 40, 257, seed=13)
    kw = dict(backend="triton", memory_budget=30_000, label_smoothing=0.1, softcap=5.0)
    expected = torch.autograd.grad(linear_cross_entropy(x, w, t, b, **kw), (x, w, b))
    with override(tiles=(32, 64, 32, 4, 1)):
        loss = linear_cross_entropy(x, w, t, b, **kw)
    # the backward runs with the default tiles in force
    for a, e in zip(torch.autograd.grad(loss, (x, w, b)), expected):
        torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("chunk", [5, 13], ids=["chunks", "one-chunk"])
def test_grad_in_forward_through_the_op(chunk):
    """The Triton planner's gradient-in-forward strategy (eager): the op's extra outputs,
    scaled by the backward, give the gradients of the usual path."""
    from logitless.planning.overrides import override

    x, w, b, t = _lce_inputs((13,), 24, 101, seed=12)
    cw = (torch.rand(101, generator=_gen(12)) + 0.5).to(DEVICE)
    opts = CrossEntropyOptions(label_smoothing=0.1, softcap=4.0, z_loss=1e-3)
    call = LceCall(x, w, b, t, cw, opts, "triton", 1 << 20, need_argmax=False, need_grad=True,
                   grad_in_forward=True, need=Needs(True, True, True), batch_invariant=False,
                   tp=VocabParallelOptions())  # (the strategy allowed; the plan forced)
    with override(strategy=("grad_in_forward", chunk)):
        torch.library.opcheck(LCE.forward_op, LCE.args(call),
                              test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))
        out = LCE.outputs_of(LCE.forward_op(*LCE.args(call)))
    loss = out.loss
    assert out.gx.shape == x.shape  # gx: the forward used the strategy
    grads = torch.autograd.grad(loss * 0.5, (x, w, b))
    usual = LCE.forward_op(*LCE.args(dataclasses.replace(call, grad_in_forward=False)))[0]
    expected = torch.autograd.grad(usual * 0.5, (x, w, b))
    torch.testing.assert_close(loss, usual)
    for a, e in zip(grads, expected):
        torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_double_backward_raises_clearly(backend):
    x, w, b, t = _lce_inputs((6,), 16, 30, seed=7)
    loss = linear_cross_entropy(x, w, t, b, backend=backend)
    gx, gw, gb = torch.autograd.grad(loss, (x, w, b), create_graph=True)
    # First-order gradients with create_graph=True are the usual ones.
    for a, e in zip((gx, gw, gb), torch.autograd.grad(linear_cross_entropy(x, w, t, b, backend=backend),
                                                      (x, w, b))):
        assert torch.equal(a, e)
    with pytest.raises(RuntimeError, match="double backward .* not supported"):
        gx.square().sum().backward()

    logits = torch.randn(6, 30, device=DEVICE, requires_grad=True)
    (gz,) = torch.autograd.grad(cross_entropy(logits, t, backend=backend), logits, create_graph=True)
    with pytest.raises(RuntimeError, match="double backward .* not supported"):
        torch.autograd.grad(gz.square().sum(), logits)
    loss = cross_entropy(logits * 1.0, t, backend=backend, inplace_backward=True)
    with pytest.raises(RuntimeError, match="double backward .* not supported"):
        torch.autograd.grad(loss, logits, create_graph=True)


# --------------------------------------------------------------------------- newcomer bugs


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("seq", [0, 1])
def test_shift_on_empty_sequence_like_torch(backend, reduction, seq):
    """x of shape (2, 0, H) (or (2, 1, H): nothing left to predict) with shift=True."""
    x, w, _, t = _lce_inputs((2, seq), 16, 30, seed=8, bias=False)
    ours = linear_cross_entropy(x, w, t, shift=True, reduction=reduction, backend=backend)
    logits = (x @ w.T)[:, :-1]
    theirs = F.cross_entropy(logits.flatten(0, 1), t[:, 1:].flatten(), reduction=reduction)
    if reduction == "none":
        theirs = theirs.reshape(t[:, 1:].shape)
    assert ours.shape == theirs.shape
    assert torch.equal(torch.isnan(ours), torch.isnan(theirs))
    gx, gw = torch.autograd.grad(ours, (x, w), torch.ones_like(ours))
    assert gx.shape == x.shape and not gx.any() and not gw.any()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("lead", [(4, 5), (3, 4, 2)], ids=["N-C-d", "N-C-d1-d2"])
def test_cross_entropy_torch_layout_and_weight_alias(backend, lead):
    """F.cross_entropy's (N, C, d1, ...) layout with target (N, d1, ...) and weight=."""
    g = _gen(9)
    n, rest, c = lead[0], lead[1:], 7
    logits = torch.randn(n, c, *rest, generator=g).to(DEVICE).requires_grad_()
    t = torch.randint(0, c, (n, *rest), generator=g).to(DEVICE)
    t[0] = -100
    cw = (torch.rand(c, generator=g) + 0.5).to(DEVICE)
    for reduction in ("mean", "none"):
        kw = dict(weight=cw, reduction=reduction, label_smoothing=0.1)
        ours = cross_entropy(logits, t, backend=backend, **kw)
        theirs = F.cross_entropy(logits, t, **kw)
        ref = F.cross_entropy(logits.double(), t, **{**kw, "weight": cw.double()})
        assert ours.shape == theirs.shape
        assert_close_to_ref("loss", ours, theirs, ref, torch.float32)
        grad_out = torch.randn(ours.shape, generator=g).to(DEVICE)
        (a,) = torch.autograd.grad(ours, logits, grad_out)
        (b,) = torch.autograd.grad(theirs, logits, grad_out)
        (r,) = torch.autograd.grad(ref, logits, grad_out.double())
        assert a.shape == logits.shape
        assert_close_to_ref("dlogits", a, b, r, torch.float32)
    mod = logitless.CrossEntropyLoss(weight=cw, backend=backend)
    torch.testing.assert_close(mod(logits, t), F.cross_entropy(logits, t, weight=cw))


def test_cross_entropy_layout_ambiguity_and_bad_options():
    logits = torch.randn(2, 5, 5, device=DEVICE)  # (N, C, d) with C == d: both readings fit
    t = torch.randint(0, 5, (2, 5), device=DEVICE)
    with pytest.raises(ValueError, match="class_dim"):
        cross_entropy(logits, t)
    torch.testing.assert_close(cross_entropy(logits, t, class_dim=1), F.cross_entropy(logits, t))
    torch.testing.assert_close(cross_entropy(logits, t, class_dim=-1),
                               F.cross_entropy(logits.reshape(-1, 5), t.reshape(-1)))
    # (N, C) is one layout for both readings; (..., V) keeps working.
    z = torch.randn(3, 4, 6, device=DEVICE)
    y = torch.randint(0, 6, (3, 4), device=DEVICE)
    torch.testing.assert_close(cross_entropy(z, y), F.cross_entropy(z.reshape(-1, 6), y.reshape(-1)))
    with pytest.raises(ValueError, match="not both"):
        cross_entropy(z, y, weight=torch.ones(6), class_weight=torch.ones(6))
    with pytest.raises(ValueError, match="class_dim"):
        cross_entropy(z, y, class_dim=2)
    with pytest.raises(ValueError, match="target has shape"):
        cross_entropy(z, y[:, :3])


def test_backward_gets_no_zero_filled_gradients_for_side_outputs():
    """The kept columns, tile maxima, plan and statistics are outputs of the forward op
    that never receive a gradient: autograd must not materialise zero tensors of their
    shapes for the backward (a memset as large as the kept columns: 1 GB at llama3 with a
    logits-sized budget, measured on the H100)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    x, w, b, t = _lce_inputs((40,), 24, 104, seed=3)  # fp32
    budget = 1 << 30  # keeps every column on the Triton backend
    loss, stats = linear_cross_entropy(x, w, t, b, backend="triton", memory_budget=budget, return_stats=True)
    call = LceCall(x.detach(), w.detach(), b.detach(), t, None, CrossEntropyOptions(), "triton", budget,
                   need_argmax=False, need_grad=True, grad_in_forward=False, need=Needs(True, True, True),
                   batch_invariant=False, tp=VocabParallelOptions())
    kept = LCE.outputs_of(LCE.forward_op(*LCE.args(call))).keep
    assert kept.shape[0] == 40 and kept.shape[1] >= 104  # the forward did keep columns

    class Zeros(TorchDispatchMode):
        seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func.overloadpacket in (torch.ops.aten.zeros_like, torch.ops.aten.zeros, torch.ops.aten.new_zeros,
                                       torch.ops.aten.fill_, torch.ops.aten.zero_):
                self.seen.append(tuple(out.shape) if isinstance(out, torch.Tensor) else None)
            return out

    with Zeros():
        loss.backward()
    assert tuple(kept.shape) not in Zeros.seen, Zeros.seen
    assert x.grad is not None and w.grad is not None
