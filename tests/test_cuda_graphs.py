"""Every op under CUDA graphs: ``torch.compile(mode="reduce-overhead")`` (inductor's CUDA-graph
trees) of a function calling it, and a forward+backward captured by hand with
``torch.cuda.graph`` and replayed on new inputs: the loss and gradients equal eager's
(gradients bitwise; a loss reduced by compiled code to within float rounding). A truncated
``linear_log_probs`` call captured by hand takes the capture-safe path (no host syncs: the
threshold pass over every column, the dense backward), which rounds differently from the
eager search: there within bf16 rounding. These run on a GPU; on the CPU: the ops' tags and
the capture-safe route against the eager one."""

from __future__ import annotations

import pytest
import torch

import logitless

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")

N, H, V, K = 384, 200, 4099, 8  # V prime, H not a multiple of 16


def _inputs(seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, H, generator=g).to("cuda", torch.bfloat16)
    w = (torch.randn(V, H, generator=g) * 0.05).to("cuda", torch.bfloat16)
    return x, w


def _fixed():
    g = torch.Generator().manual_seed(99)
    t = torch.randint(0, V, (N,), generator=g)
    t[::7] = -100
    tx = torch.randn(N, H, generator=g).to("cuda", torch.bfloat16)
    tw = (torch.randn(V, H, generator=g) * 0.05).to("cuda", torch.bfloat16)
    ids = torch.stack([torch.randperm(V, generator=g)[:K] for _ in range(N)]).to("cuda")
    lp = torch.log_softmax(torch.randn(N, K, generator=g) * 2, -1).to("cuda")
    scale = torch.linspace(0.5, 1.5, N).to("cuda")
    return t.to("cuda"), tx, tw, ids, lp, scale


def _case(name):
    """loss(x, w) for op ``name``; x, w the differentiable inputs (logits ops: x @ w.T)."""
    t, tx, tw, ids, lp, scale = _fixed()

    def weighted(out):
        return (out.float() * scale).sum()

    return {
        "linear_cross_entropy": lambda x, w: logitless.linear_cross_entropy(x, w, t),
        "linear_cross_entropy_stats": lambda x, w: logitless.linear_cross_entropy(
            x, w, t, label_smoothing=0.1, z_loss=1e-4, softcap=30.0),
        "linear_log_probs": lambda x, w: weighted(logitless.linear_log_probs(x, w, t.clamp_min(0))),
        "linear_log_probs_entropy_top_p": lambda x, w: sum(
            weighted(o) for o in logitless.linear_log_probs(x, w, t.clamp_min(0), entropy=True, top_p=0.9)),
        "linear_jsd": lambda x, w: logitless.linear_jsd(x, w, tx, tw, t, beta=0.5),
        "linear_topk_kl": lambda x, w: logitless.linear_topk_kl(x, w, ids, lp, t),
        "cross_entropy": lambda x, w: logitless.cross_entropy(x @ w.T, t),
        "log_probs": lambda x, w: weighted(logitless.log_probs(x @ w.T, t.clamp_min(0), top_p=0.9)),
        "jsd": lambda x, w: logitless.jsd(x @ w.T, tx @ tw.T, t),
    }[name]


CASES = ["linear_cross_entropy", "linear_cross_entropy_stats", "linear_log_probs",
         "linear_log_probs_entropy_top_p", "linear_jsd", "linear_topk_kl", "cross_entropy", "log_probs", "jsd"]


def _eager(loss_fn, x0, w0):
    x, w = x0.clone().requires_grad_(True), w0.clone().requires_grad_(True)
    loss = loss_fn(x, w)
    loss.backward()
    return loss.detach().clone(), x.grad.clone(), w.grad.clone()


def _check(got, want, exact=True):
    loss, dx, dw = got
    torch.testing.assert_close(loss, want[0], rtol=1e-5 if exact else 1e-4, atol=1e-6)
    for g, ref in ((dx, want[1]), (dw, want[2])):
        if exact:
            assert torch.equal(g, ref), (g.float() - ref.float()).abs().max()
        else:  # (one bf16 rounding step of the largest gradient)
            err = (g.float() - ref.float()).abs().max()
            assert err <= 2 ** -7 * ref.float().abs().max(), err


@gpu
@pytest.mark.parametrize("name", CASES)
def test_reduce_overhead(name):
    """torch.compile(mode="reduce-overhead"): three steps on new inputs (the first records),
    each equal to eager on the same inputs."""
    torch._dynamo.reset()
    loss_fn = _case(name)
    step = torch.compile(loss_fn, mode="reduce-overhead")
    for seed in range(3):
        x0, w0 = _inputs(seed)
        want = _eager(loss_fn, x0, w0)
        x, w = x0.clone().requires_grad_(True), w0.clone().requires_grad_(True)
        loss = step(x, w)
        loss.backward()
        _check((loss.detach().clone(), x.grad.clone(), w.grad.clone()), want)


@gpu
@pytest.mark.parametrize("name", CASES)
def test_manual_capture(name):
    """A forward+backward captured with torch.cuda.graph (warm-up on a side stream), replayed
    after copying new inputs into the captured ones: equal to eager on those inputs."""
    loss_fn = _case(name)
    x0, w0 = _inputs(0)
    x, w = x0.clone().requires_grad_(True), w0.clone().requires_grad_(True)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            loss_fn(x, w).backward()
    torch.cuda.current_stream().wait_stream(side)
    x.grad = w.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        loss = loss_fn(x, w)
        loss.backward()
    for seed in (1, 2):
        x1, w1 = _inputs(seed)
        with torch.no_grad():
            x.copy_(x1)
            w.copy_(w1)
        graph.replay()
        torch.cuda.synchronize()
        _check((loss.detach().clone(), x.grad.clone(), w.grad.clone()), _eager(loss_fn, x1, w1),
               exact=name != "linear_log_probs_entropy_top_p")


def test_which_custom_ops_run_between_graph_partitions():
    """Every op's backward op plans its Config again (``glue.Replanned``): no Config crosses
    the custom ops as a CPU tensor, and inductor keeps them inside its CUDA-graph
    partitions; only the truncated log-prob calls' pairs carry torch's ``cudagraph_unsafe``
    tag (``glue.HOST_SYNCS``: their host syncs choose a faster route than a graph holds)."""
    from logitless.ops.common import glue

    inside = ("lce", "ce", "jsd", "linear_jsd", "topk_kl", "llp", "lp")
    between = ("llp_truncated", "lp_truncated")
    prefix = {name: name.split("::")[1].rsplit("_", 1)[0] for name in glue.EAGER}
    names = [name for name in glue.EAGER if prefix[name] in inside + between]
    assert len(names) == 2 * len(inside + between), sorted(glue.EAGER)
    for name in names:
        op = getattr(torch.ops.logitless, name.split("::")[1]).default
        assert (torch.Tag.cudagraph_unsafe in op.tags) == (prefix[name] in between), name


@gpu
def test_linear_cross_entropy_replays_inside_the_graph(monkeypatch):
    """Under reduce-overhead, once recorded, a step of linear_cross_entropy replays without
    running the backend's forward and backward (the ops are inside the CUDA graph), and its loss and
    gradients equal eager's bitwise at every replay, on new inputs."""
    from logitless.ops.linear_cross_entropy.api import OPS

    impl = OPS.table["triton"]
    bodies: list = []
    for body in ("forward", "backward"):
        real = getattr(impl, body)
        monkeypatch.setattr(impl, body, lambda *a, _real=real, _name=body, **k: (bodies.append(_name),
                                                                                _real(*a, **k))[1])
    torch._dynamo.reset()
    try:
        loss_fn = _case("linear_cross_entropy")
        compiled = torch.compile(loss_fn, mode="reduce-overhead")
        x, w = _inputs(0)
        x.requires_grad_()
        w.requires_grad_()
        for seed in range(5):
            x1, w1 = _inputs(seed)
            with torch.no_grad():
                x.copy_(x1)
                w.copy_(w1)
            x.grad = w.grad = None
            bodies.clear()
            loss = compiled(x, w)
            loss.backward()
            torch.cuda.synchronize()
            if seed >= 3:  # (warm-up and recording done: a replay)
                assert bodies == [], (seed, bodies)
            _check((loss.detach().clone(), x.grad.clone(), w.grad.clone()), _eager(loss_fn, x1, w1), exact=True)
    finally:
        torch._dynamo.reset()


def _no_syncs(monkeypatch) -> list:
    """What a truncated call sees while a CUDA graph is captured, on the CPU; the list of
    the devices asked about."""
    from logitless.formulas import truncation as formulas
    from logitless.ops.linear_log_probs import custom_op as llp_op
    from logitless.ops.linear_log_probs import truncation as llp_trunc

    asked: list = []

    def never(device):
        asked.append(device)
        return False

    for mod in (formulas, llp_op, llp_trunc):  # (its module, and those that imported it by name)
        monkeypatch.setattr(mod, "syncs_allowed", never)
    return asked


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("options", [dict(top_p=0.9), dict(top_k=torch.tensor([3, 50, 0, 7, 1, 200] * 7)),
                                     dict(min_p=0.05, top_p=0.8), dict(top_k=5, top_p=0.95, min_p=0.01)])
def test_capture_safe_truncation(options, backend, monkeypatch):
    """The capture-safe route of truncated log-probs (no host syncs: one threshold pass with
    every column a candidate, no Triton search, the dense backward) gives the eager route's
    log-probs, entropy and gradients (torch backends on the CPU in float64, Triton in
    float32 on the GPU or its CPU interpreter; V prime, H odd)."""
    if backend == "triton":
        pytest.importorskip("triton")
    dtype = torch.float64 if backend == "torch" else torch.float32
    tol = 1e-10 if backend == "torch" else 2e-5
    dev = "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(3)
    n, h, v = 42, 19, 1009
    x0 = torch.randn(n, h, generator=g, dtype=dtype).to(dev)
    w0 = (torch.randn(v, h, generator=g, dtype=dtype) * 0.7).to(dev)
    t = torch.randint(0, v, (n,), generator=g).to(dev)
    gl, ge = (torch.randn(n, generator=g, dtype=dtype).to(dev) for _ in range(2))
    options = {k: o.to(dev) if isinstance(o, torch.Tensor) else o for k, o in options.items()}

    def run():
        out = []
        x, w = x0.clone().requires_grad_(True), w0.clone().requires_grad_(True)
        lp, ent = logitless.linear_log_probs(x, w, t, entropy=True, temperature=0.8, backend=backend, **options)
        torch.autograd.backward([lp, ent], [gl, ge])
        out += [lp.detach(), ent.detach(), x.grad, w.grad]
        z = (x0 @ w0.T).requires_grad_(True)
        lp, ent = logitless.log_probs(z, t, entropy=True, temperature=0.8, backend=backend, **options)
        torch.autograd.backward([lp, ent], [gl, ge])
        return out + [lp.detach(), ent.detach(), z.grad]

    eager = run()
    assert torch.isinf(eager[0]).any() and torch.isinf(eager[4]).any()  # (tokens truncated away)
    asked = _no_syncs(monkeypatch)
    safe = run()
    assert len(asked) >= 2, asked  # (the threshold passes of both ops asked)
    for a, b in zip(safe, eager):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)
