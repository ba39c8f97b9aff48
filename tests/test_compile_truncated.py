"""torch.compile(fullgraph=True) of the truncated (top_k / top_p / min_p) and
batch-invariant paths: ``linear_log_probs``, ``log_probs`` and ``linear_cross_entropy``.

Those paths are custom ops with fixed output shapes (``logitless::llp_forward``/``llp_backward``
and ``lp_forward``/``lp_backward`` with truncation arguments, ``lce_forward``/``lce_backward``
with ``batch_invariant``): a
compiled function calling them traces with no graph break and gives the eager outputs and
gradients (x, weight, bias / logits) bitwise on the torch backend, and on the Triton
backend (the CPU interpreter off a GPU) at small sizes. ``torch.library.opcheck`` checks
their schemas, fakes and autograd registrations (a per-token ``top_k`` not read on the
host, ``k_max`` -1, included: the fake's padded candidate width is the implementation's).
"""

from __future__ import annotations

import pytest
import torch

import logitless
from logitless.ops.linear_log_probs.api import BACKENDS as LLP_BACKENDS
from tests.conftest import DEVICE


def _data(n, h, v, seed, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, h, generator=g)
    w = torch.randn(v, h, generator=g) * h ** -0.5 * scale
    b = torch.randn(v, generator=g) * 0.5
    t = torch.randint(0, v, (n,), generator=g)
    t[::3] = (x @ w.T + b).argmax(1)[::3]  # (kept by any truncation: finite log-probs)
    t[1] = -100
    k = torch.randint(0, 9, (n,), generator=g)
    p = torch.rand(n, generator=g, dtype=torch.float64) * 0.5 + 0.5
    return [u.to(DEVICE) for u in (x, w, b, t, k, p)]


def _loss(outs):
    """A scalar of the outputs with a different weight per token (-inf outputs: 0)."""
    g = torch.Generator().manual_seed(1)
    total = 0.0
    for o in outs:
        r = torch.randn(o.shape, generator=g).to(o.device)
        total = total + (torch.where(torch.isinf(o), torch.zeros_like(o), o) * r).sum()
    return total


def _eager_and_compiled(fn, inputs):
    """(outputs, gradients) of ``fn(*inputs)`` eagerly and under torch.compile(fullgraph=True)."""
    results = []
    for f in (fn, torch.compile(fn, fullgraph=True)):
        ins = [u.detach().clone().requires_grad_() for u in inputs]
        outs = f(*ins)
        outs = outs if isinstance(outs, tuple) else (outs,)
        grads = torch.autograd.grad(_loss(outs), ins, allow_unused=True)
        results.append(([o.detach() for o in outs], grads))
    torch._dynamo.reset()
    return results


def _assert_bitwise(eager, compiled):
    (oe, ge), (oc, gc) = eager, compiled
    assert len(oe) == len(oc)
    for a, c in zip(oe, oc):
        assert torch.equal(a, c), (a, c)
    assert ge[0] is not None
    for a, c in zip(ge, gc):
        assert (a is None and c is None) or torch.equal(a, c), (a - c).abs().max()


LLP = {
    "top_k": dict(top_k=5),
    "top_p": dict(top_p=0.8, entropy=True),
    "min_p": dict(min_p=0.1),
    "all_options": dict(top_k=7, top_p=0.9, min_p=0.02, temperature=0.7, softcap=3.0, entropy=True, bias=True),
    "per_token": dict(top_k="k", top_p="p", entropy=True, bias=True),
    "invariant": dict(batch_invariant=True, entropy=True, bias=True),
    "invariant_truncated": dict(batch_invariant=True, top_k="k", min_p=0.05, temperature=1.3),
}


def _llp(kw, backend, tokens, k, p):
    kw = dict(kw)
    use_bias = kw.pop("bias", False)
    kw = {n: (k if val == "k" else p if val == "p" else val) for n, val in kw.items()}

    def fn(x, w, b):
        return logitless.linear_log_probs(x, w, tokens, b if use_bias else None, backend=backend, **kw)

    return fn


@pytest.mark.parametrize("case", list(LLP))
def test_linear_log_probs_torch(case):
    x, w, b, t, k, p = _data(37, 16, 131, seed=3)
    eager, compiled = _eager_and_compiled(_llp(LLP[case], "torch", t, k, p), (x, w, b))
    _assert_bitwise(eager, compiled)
    lp = eager[0][0]
    if case.startswith("invariant") and case != "invariant_truncated":
        assert torch.isfinite(lp).all()
    else:
        assert torch.isinf(lp).any() and torch.isfinite(lp[lp != 0]).any()  # (tokens in and out of the set)


@pytest.mark.parametrize("case", ["top_k", "per_token", "invariant"])
def test_linear_log_probs_triton(case):
    """The Triton backend (the candidates pass and the sparse backward; the blocked forward)."""
    x, w, b, t, k, p = _data(9, 13, 211, seed=5)
    kw = LLP[case] if case != "top_k" else dict(top_k=5, entropy=True, bias=True)
    eager, compiled = _eager_and_compiled(_llp(kw, "triton", t, k, p), (x, w, b))
    _assert_bitwise(eager, compiled)


def test_linear_log_probs_dynamic_shapes():
    """dynamic=True, two batch sizes: one graph, the eager values."""
    x, w, b, t, k, p = _data(37, 16, 131, seed=7)

    def fn(x, w, t, k):
        return logitless.linear_log_probs(x, w, t, backend="torch", top_k=k, top_p=0.9, entropy=True)

    compiled = torch.compile(fn, fullgraph=True, dynamic=True)
    for n in (37, 20):
        xe, xc = x[:n].clone().requires_grad_(), x[:n].clone().requires_grad_()
        outs_e, outs_c = fn(xe, w, t[:n], k[:n]), compiled(xc, w, t[:n], k[:n])
        for a, c in zip(outs_e, outs_c):
            assert torch.equal(a, c)
        (ge,), (gc,) = (torch.autograd.grad(_loss(o), (u,)) for o, u in ((outs_e, xe), (outs_c, xc)))
        assert torch.equal(ge, gc)
    torch._dynamo.reset()


LP = {
    "top_k": dict(top_k=5, entropy=True),
    "per_token": dict(top_k="k", top_p="p", min_p=0.05, temperature=0.7),
    "invariant": dict(batch_invariant=True, entropy=True),
}


@pytest.mark.parametrize("case", list(LP))
def test_log_probs(case):
    _, _, _, t, k, p = _data(37, 16, 131, seed=9)
    logits = torch.randn(37, 131, generator=torch.Generator().manual_seed(2)).to(DEVICE) * 2
    t[::3] = logits.argmax(1)[::3]  # (kept: finite log-probs, gradients)
    kw = {n: (k if val == "k" else p if val == "p" else val) for n, val in LP[case].items()}

    def fn(z):
        return logitless.log_probs(z, t, **kw)

    eager, compiled = _eager_and_compiled(fn, (logits,))
    _assert_bitwise(eager, compiled)
    assert compiled[1][0].abs().sum() > 0


@pytest.mark.parametrize("backend, reduction", [("torch", "mean"), ("torch", "none"), ("triton", "sum")])
def test_linear_cross_entropy_invariant(backend, reduction):
    x, w, b, t, _, _ = _data(21 if backend == "torch" else 9, 16, 67, seed=11)

    def fn(x, w, b):
        loss, stats = logitless.linear_cross_entropy(x, w, t, b, backend=backend, reduction=reduction, z_loss=1e-3,
                                                     batch_invariant=True, return_stats=True)
        return loss.reshape(-1), stats.lse

    eager, compiled = _eager_and_compiled(fn, (x, w, b))
    _assert_bitwise(eager, compiled)
    assert all(g is not None and g.abs().sum() > 0 for g in compiled[1])


# ---- opcheck of the custom ops ----

_FORWARD_UTILS = ("test_schema", "test_autograd_registration", "test_faketensor")  # (kept columns: as lce's)


@pytest.mark.parametrize("backend, trunc, k_max, block", [
    ("torch", True, 5, 0), ("torch", False, 0, 64), ("torch", True, -1, 64),
    ("triton", True, 5, 0), ("triton", True, -1, 0), ("triton", True, 300, 0),
])
def test_opcheck_linear_log_probs(backend, trunc, k_max, block):
    """The truncated / batch-invariant calls of the one op pair: opcheck of both ops (the
    declared calls flattened, ``OPS.args``)."""
    from logitless.ops.common.contract import Needs
    from logitless.ops.linear_log_probs.api import OPS
    from logitless.ops.linear_log_probs.contract import LlpBackwardCall, LlpCall
    from logitless.ops.linear_log_probs.custom_op import planned, replan
    from logitless.options import LogProbOptions, VocabParallelOptions

    x, w, b, t, k, p = _data(13, 24, 104, seed=5)
    if k_max >= 0 and trunc:
        k = torch.full_like(k, k_max)
    mp = torch.zeros_like(p)
    tr = (k, p, mp) if trunc else (None, None, None)
    opts, tp = LogProbOptions(temperature=0.7, entropy=True), VocabParallelOptions()
    for need_grad in (True, False):
        # (12 kB: the kept columns and a copy of them for their dz, which the custom ops' plan
        # budgets beside them, ``glue.Owned``)
        call = LlpCall(x, w, b, t, opts, backend, 12_000, need_grad, True, *tr, checked=False, k_max=k_max,
                       block=block, tp=tp)
        torch.library.opcheck(OPS.forward_op, OPS.args(call), test_utils=_FORWARD_UTILS)
        out = OPS.outputs_of(OPS.forward_op(*OPS.args(call)))
        cand, cols = out.sparse[0].view(torch.float32), out.sparse[1]  # (the candidates' fp32 bits, their columns)
        sparse = backend == "triton" and trunc and need_grad and k_max < 256
        assert cand.shape == ((13, 104 if k_max < 0 else 64) if sparse else (0, 0))  # (C = 256 capped at V)
        assert out.inside.shape == ((13,) if sparse else (0,))
        if sparse:
            assert out.inside.any() and (cols[cand == -torch.inf] == 104).all()  # (the padding: column V)
        bcall = LlpBackwardCall(torch.randn_like(out.logp), torch.randn_like(out.entropy), x, w, b, t, out.lse,
                                out.entropy, out.keep, out.keep_max, None, opts, backend, Needs(True, True, True),
                                out.logp, out.tau, out.sparse, out.inside, tp, planned(call))
        main = getattr(replan(bcall, LLP_BACKENDS[backend]), "main", None)  # (the backward op's Config)
        assert (out.keep.shape != (1, 1)) == (backend == "triton" and k_max == 300 and need_grad) == bool(
            main is not None and main.keeps)
        torch.library.opcheck(OPS.backward_op, OPS.backward_args(bcall))


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("trunc", [True, False])
def test_opcheck_log_probs(trunc, backend):
    from logitless.ops.log_probs.api import BACKENDS as LP_BACKENDS
    from logitless.ops.log_probs.api import OPS
    from logitless.ops.log_probs.contract import LpBackwardCall, LpCall, LpPlanned
    from logitless.ops.log_probs.custom_op import replan
    from logitless.options import LogProbOptions

    _, _, _, t, k, p = _data(13, 24, 104, seed=5)
    logits = torch.randn(13, 104, generator=torch.Generator().manual_seed(4)).to(DEVICE).requires_grad_()
    tr = (k, p, torch.zeros_like(p)) if trunc else (None, None, None)
    opts = LogProbOptions(temperature=0.7, entropy=True)
    call = LpCall(logits, t, opts, backend, 1 << 20, *tr, checked=False, k_max=-1, batch_invariant=not trunc)
    torch.library.opcheck(OPS.forward_op, OPS.args(call))
    out = OPS.outputs_of([o.detach() for o in OPS.forward_op(*OPS.args(call))])
    bcall = LpBackwardCall(torch.randn_like(out.logp), torch.randn_like(out.entropy), logits.detach(), t, out.logp,
                           out.entropy, out.lse, out.tau, None, opts, backend, LpPlanned(1 << 20, trunc, not trunc))
    assert out.tau.shape == out.logp.shape and replan(bcall, LP_BACKENDS[backend]).blocks is not None
    torch.library.opcheck(OPS.backward_op, OPS.backward_args(bcall))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_opcheck_linear_cross_entropy_invariant(backend):
    """The batch-invariant call is a Config of the one op pair: opcheck of both ops with
    ``batch_invariant`` set."""
    from logitless.ops.common.contract import Needs
    from logitless.ops.linear_cross_entropy.api import OPS
    from logitless.ops.linear_cross_entropy.contract import LceBackwardCall, LceCall
    from logitless.ops.linear_cross_entropy.custom_op import planned
    from logitless.options import CrossEntropyOptions, VocabParallelOptions

    x, w, b, t, _, _ = _data(13, 24, 104, seed=5)
    cw = torch.rand(104, generator=torch.Generator().manual_seed(6)).to(DEVICE)
    x, w, b = (u.requires_grad_() for u in (x, w, b))
    opts = CrossEntropyOptions(reduction="none", label_smoothing=0.1, softcap=4.0, z_loss=1e-3)
    need, tp = Needs(True, True, True), VocabParallelOptions()
    call = LceCall(x, w, b, t, cw, opts, backend, 6_000, need_argmax=True, need_grad=True, grad_in_forward=False,
                   need=need, batch_invariant=True, tp=tp)
    # (not test_aot_dispatch_dynamic: as op_specs' lce case, the kept columns' dummies are
    # uninitialised outputs)
    torch.library.opcheck(OPS.forward_op, OPS.args(call),
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))
    out = OPS.outputs_of(OPS.forward_op(*OPS.args(call)))
    assert out.argmax.shape == (13,)
    bcall = LceBackwardCall(torch.randn_like(out.loss), torch.randn_like(out.lse), x.detach(), w.detach(), b.detach(),
                            t, cw, out.lse.detach(), out.w_t, out.keep, out.keep_max, None, opts, backend, True,
                            need, tp, planned(call))
    torch.library.opcheck(OPS.backward_op, OPS.backward_args(bcall))
