"""The CuTe DSL forward (``cute_lib.forward_stats``) inside linear_cross_entropy and
linear_log_probs, on a Hopper GPU with nvidia-cutlass-dsl: ours vs float64 against torch
in the same dtype (``assert_close_to_ref``), equality to the Triton kernel within the
criterion, and proof that the CuTe kernel ran (``tests.planning_seams.cute_launches``).

Skipped on a CPU, off compute capability 9.x and without the DSL (each with its reason).
The selection logic is tested on the CPU in tests/test_cute_planning.py."""

from __future__ import annotations

import pytest
import torch

import logitless
from logitless.ops.linear_cross_entropy.reference import linear_cross_entropy_reference
from logitless.ops.linear_log_probs.reference import linear_log_probs_reference
from logitless.options import CrossEntropyOptions
from logitless.planning import cute
from logitless.planning.overrides import override
from tests.helpers import assert_close_to_ref
from tests.planning_seams import cute_launches

HAS_CUDA = torch.cuda.is_available()
pytestmark = [
    pytest.mark.skipif(not HAS_CUDA, reason="the CuTe DSL kernel needs a CUDA GPU"),
    pytest.mark.skipif(HAS_CUDA and torch.cuda.get_device_capability()[0] != 9,
                       reason="the CuTe DSL kernel is sm_90a (Hopper) only"),
    pytest.mark.skipif(HAS_CUDA and not cute.dsl_importable(),
                       reason="nvidia-cutlass-dsl (cutlass.cute) not installed: pip install logitless[hopper]"),
]

SHAPES = [(1, 72, 32003), (127, 4096, 32003), (129, 72, 1000), (300, 136, 257), (256, 4096, 512)]


def inputs(n, h, v, dtype=torch.bfloat16, seed=0, ignore=True):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(n, h, device="cuda", generator=g).to(dtype)
    w = (torch.randn(v, h, device="cuda", generator=g) * (2.0 / h ** 0.5)).to(dtype)
    t = torch.randint(0, v, (n,), device="cuda", generator=g)
    if ignore and n > 2:
        t[::5] = -100
    return x, w, t


@pytest.mark.parametrize("n, h, v, splits", [(1, 72, 1000, 3), (129, 136, 32003, 7), (256, 4096, 257, 2),
                                           (300, 8, 600, 5)])
@pytest.mark.parametrize("smooth, entropy, scale", [(False, False, 1.0), (True, True, 1 / 0.7)])
def test_raw_partials_match_the_model(n, h, v, splits, smooth, entropy, scale):
    """The kernel's (splits, N) partials vs ``cute_lib.reference`` in float64 (empty
    splits included: (v_tiles, splits) = (4, 3) leaves the last split empty)."""
    from logitless.cute_lib import launch as cute_launch
    from logitless.cute_lib.reference import forward_partials, split_bounds
    from logitless.triton_lib.launch import partials

    x, w, t = inputs(n, h, v)
    bufs = partials(5, splits, n, x.device)
    for b in bufs:
        b.fill_(float("nan"))
    cute_launch.forward_partials("test", x, w, t, bufs[:3], splits, scale=scale,
                                 smooth=bufs[3] if smooth else None, entropy=bufs[4] if entropy else None)
    torch.cuda.synchronize()
    want = forward_partials(x, w, t, splits, scale=scale, smooth=smooth, entropy=entropy)
    # q sums values of both signs: its fp32 rounding scales with sum |a| over the split
    abs_a = (x.double() @ w.double().T).abs() * scale
    q_scale = torch.stack([abs_a[:, lo:hi].sum(1) for lo, hi in split_bounds(v, splits)])
    for name, got, ref in zip("metqu", bufs, want):
        if ref is None:
            continue
        got = got.double()
        assert not torch.isnan(got).any(), f"{name}: unwritten (NaN) entries"
        inf = torch.isinf(ref)
        assert torch.equal(torch.isinf(got), inf) and torch.equal(got[inf], ref[inf]), f"{name}: -inf pattern"
        size = q_scale if name == "q" else ref.abs()
        err = ((got - ref).abs() / (1 + size))[~inf].max().item() if (~inf).any() else 0.0
        assert err < 1e-4, f"partial {name}: relative error {err:.3g}"


@pytest.mark.parametrize("n, h, v, splits, group", [
    (3000, 72, 32003, 16, 16),  # 24 row blocks: a full group of 16, then a ragged one of 8
    (129, 136, 1000, 3, 16),    # fewer row blocks (2) than the group
    (300, 8, 600, 3, 1),        # group 1: split fastest
])
def test_grouped_order_gives_the_plain_grids_partials(n, h, v, splits, group):
    """``group`` changes which CTA computes which (row block, split) only: the partials are
    bitwise those of the plain grid, every (split, row) written once (NaN-filled first)."""
    from logitless.cute_lib import launch as cute_launch
    from logitless.triton_lib.launch import partials

    x, w, t = inputs(n, h, v)
    got = []
    for g in (0, group):
        bufs = partials(3, splits, n, x.device)
        for b in bufs:
            b.fill_(float("nan"))
        cute_launch.forward_partials("test", x, w, t, bufs, splits, group=g)
        got.append(bufs)
    torch.cuda.synchronize()
    for name, plain, grouped in zip("met", *got):
        assert not torch.isnan(grouped).any(), f"{name}: unwritten entries in the grouped order"
        assert torch.equal(plain, grouped), f"{name}: grouped order differs from the plain grid"


def ce_case(n, h, v, dtype=torch.bfloat16, **kw):
    x, w, t = inputs(n, h, v, dtype)
    if "ignore_index" in kw:  # the ignored rows carry the given index (-100 would be out of range)
        t = torch.where(t == -100, kw["ignore_index"], t)
    with torch.no_grad(), override(cute=True), cute_launches() as seen:
        ours = logitless.linear_cross_entropy(x, w, t, **kw)
    assert seen.ops() == ["linear_cross_entropy"], f"CuTe kernel not taken: {seen}"
    with torch.no_grad(), override(cute=False):
        tri = logitless.linear_cross_entropy(x, w, t, **kw)
    ref = linear_cross_entropy_reference(x, w, t, dtype=torch.float64, **kw)[0]
    same = linear_cross_entropy_reference(x, w, t, dtype=dtype, **kw)[0]
    assert_close_to_ref("cute loss", ours, same, ref, dtype)
    assert_close_to_ref("cute vs triton", ours, tri, ref, dtype)
    return seen


@pytest.mark.parametrize("n, h, v", SHAPES)
@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
def test_cross_entropy_shapes_and_reductions(n, h, v, reduction):
    ce_case(n, h, v, reduction=reduction)


@pytest.mark.parametrize("kw", [dict(label_smoothing=0.1), dict(z_loss=1e-3),
                                dict(label_smoothing=0.2, z_loss=1e-4, reduction="none"),
                                dict(ignore_index=3)])
def test_cross_entropy_options(kw):
    ce_case(129, 72, 32003, **kw)
    ce_case(127, 4096, 1000, **kw)


def test_cross_entropy_fp16():
    ce_case(127, 136, 32003, dtype=torch.float16, reduction="none")


def test_cross_entropy_3d():
    x, w, t = inputs(2 * 65, 72, 32003)
    x3, t3 = x.view(2, 65, 72), t.view(2, 65)
    with torch.no_grad(), override(cute=True), cute_launches() as seen:
        loss = logitless.linear_cross_entropy(x3, w, t3, reduction="none")
    assert seen.ops() == ["linear_cross_entropy"] and loss.shape == (2, 65)
    ref = linear_cross_entropy_reference(x, w, t, reduction="none", dtype=torch.float64)[0].view(2, 65)
    same = linear_cross_entropy_reference(x, w, t, reduction="none", dtype=torch.bfloat16)[0].view(2, 65)
    assert_close_to_ref("3-D loss", loss, same, ref, torch.bfloat16)


def test_unsupported_options_fall_back_to_triton():
    x, w, t = inputs(127, 72, 1000)
    with torch.no_grad(), override(cute=True), cute_launches() as seen:
        logitless.linear_cross_entropy(x, w, t, return_stats=True)  # argmax
        logitless.linear_cross_entropy(x, w, t, bias=torch.zeros(1000, device="cuda", dtype=x.dtype))
        logitless.linear_cross_entropy(x, w, t, softcap=30.0)
        logitless.linear_cross_entropy(x[:, :68].contiguous(), w[:, :68].contiguous(), t)  # H % 8 != 0
    assert seen == []


def test_training_forward_without_kept_columns_then_backward():
    """A gradient to come: the CuTe forward runs when the budget keeps no column; the
    backward (Triton) then matches the float64 gradient as the Triton forward's does."""
    x, w, t = inputs(129, 136, 32003)
    xs = x.clone().requires_grad_()
    with override(cute=True), cute_launches() as seen:
        loss = logitless.linear_cross_entropy(xs, w, t, reduction="none", memory_budget=1)
        loss.sum().backward()
    assert seen.ops() == ["linear_cross_entropy"]
    xr = x.double().requires_grad_()
    linear_cross_entropy_reference(xr, w, t, reduction="none", dtype=torch.float64)[0].sum().backward()
    xb = x.clone().requires_grad_()
    linear_cross_entropy_reference(xb, w, t, reduction="none", dtype=torch.bfloat16)[0].sum().backward()
    assert_close_to_ref("dx", xs.grad, xb.grad, xr.grad, torch.bfloat16)


def lp_case(n, h, v, temperature=0.7, entropy=True, dtype=torch.bfloat16):
    x, w, t = inputs(n, h, v, dtype)
    with torch.no_grad(), override(cute=True), cute_launches() as seen:
        ours = logitless.linear_log_probs(x, w, t, temperature=temperature, entropy=entropy)
    assert seen.ops() == ["linear_log_probs"], f"CuTe kernel not taken: {seen}"
    assert seen[0]["entropy"] == entropy and abs(seen[0]["scale"] - 1 / temperature) < 1e-12
    with torch.no_grad(), override(cute=False):
        tri = logitless.linear_log_probs(x, w, t, temperature=temperature, entropy=entropy)
    ref = linear_log_probs_reference(x, w, t, temperature=temperature)
    same = linear_log_probs_reference(x, w, t, temperature=temperature, dtype=dtype)
    ours, tri = (ours, tri) if entropy else ((ours,), (tri,))
    for i, name in enumerate(("logp", "entropy")[:len(ours)]):
        assert_close_to_ref(f"cute {name}", ours[i], same[i], ref[i], dtype)
        assert_close_to_ref(f"cute vs triton {name}", ours[i], tri[i], ref[i], dtype)


@pytest.mark.parametrize("n, h, v", SHAPES)
def test_log_probs_entropy_temperature(n, h, v):
    lp_case(n, h, v)


@pytest.mark.parametrize("temperature, entropy", [(1.0, False), (0.3, True), (1.7, False)])
def test_log_probs_options(temperature, entropy):
    lp_case(129, 4096, 32003, temperature=temperature, entropy=entropy)


def test_cuda_graph_capture():
    x, w, t = inputs(256, 136, 32003)
    with torch.no_grad(), override(cute=True), cute_launches() as seen:
        eager = logitless.linear_cross_entropy(x, w, t, reduction="none")  # warm-up: compiles the kernel
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            logitless.linear_cross_entropy(x, w, t, reduction="none")
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = logitless.linear_cross_entropy(x, w, t, reduction="none")
        x.copy_(x.flip(0))
        t.copy_(t.flip(0))
        graph.replay()
        torch.cuda.synchronize()
        again = logitless.linear_cross_entropy(x, w, t, reduction="none")
    assert len(seen) == 4
    torch.testing.assert_close(out, again, rtol=0, atol=0)
    torch.testing.assert_close(eager.flip(0), again, rtol=1e-5, atol=1e-5)


def test_torch_compile_step():
    x, w, t = inputs(129, 72, 32003)

    @torch.compile(fullgraph=True)
    def step(x, w, t):
        return logitless.linear_cross_entropy(x, w, t) * 2

    with torch.no_grad(), override(cute=True), cute_launches() as seen:
        got = step(x, w, t)
        want = logitless.linear_cross_entropy(x, w, t) * 2
    assert seen.ops() == ["linear_cross_entropy"] * 2
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_bitwise_repeatable():
    x, w, t = inputs(1000, 4096, 32003)
    with torch.no_grad(), override(cute=True):
        a = logitless.linear_cross_entropy(x, w, t, reduction="none")
        b = logitless.linear_cross_entropy(x, w, t, reduction="none")
    assert torch.equal(a, b)


# ----------------------------------------------------------------- kept columns (session 6)

def partial_budget(n, h, v, keep_allowed=True):
    """A memory budget whose Triton plan keeps some but not all columns, and its plan."""
    from logitless.planning.plans import linear_plan

    for mib in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64):
        plan = linear_plan(n, v, h, 2, mib << 20, torch.device("cuda"), keep_allowed=keep_allowed,
                           prerounded=False)
        if 0 < plan.forward.keep_cols < v:
            return mib << 20, plan
    pytest.fail(f"no budget of 1-64 MiB keeps part of {n} x {v}")


@pytest.mark.parametrize("n, h, v, budget", [
    (129, 136, 32003, None),         # every column kept (ragged V: the last kept tile is partial)
    (1, 72, 1000, None),
    (300, 4096, 32003, "partial"),   # 32000 of 32003 kept (H100 plan), 3 recomputed by Triton
    (1024, 4096, 32003, "partial"),  # 7936 kept
    (300, 136, 5003, "partial"),     # 4864 kept
])
@pytest.mark.parametrize("kw", [dict(), dict(label_smoothing=0.1, z_loss=1e-4)])
def test_training_forward_keeps_columns_like_triton(n, h, v, budget, kw):
    """A gradient to come with a budget that holds logits: the CuTe forward writes the kept
    exp(a - m) and maxima; the Triton backward turns them into dz. Loss, dx and dW vs float64
    against torch bf16's error, and vs the run with the Triton forward."""
    x, w, t = inputs(n, h, v)
    if budget == "partial":
        budget, _ = partial_budget(n, h, v)

    def run(use_cute):
        xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
        with override(cute=use_cute), cute_launches() as seen:
            loss = logitless.linear_cross_entropy(xs, ws, t, memory_budget=budget, **kw)
            loss.backward()
        return loss.detach(), xs.grad, ws.grad, seen

    loss, dx, dw, seen = run(True)
    assert seen.ops() == ["linear_cross_entropy"] and seen[0]["keep_cols"] > 0, seen
    tri_loss, tri_dx, tri_dw, _ = run(False)
    refs = {}
    for dt in (torch.float64, torch.bfloat16):
        xr = (x.double() if dt == torch.float64 else x.clone()).requires_grad_()
        wr = (w.double() if dt == torch.float64 else w.clone()).requires_grad_()
        lr = linear_cross_entropy_reference(xr, wr, t, dtype=dt, **kw)[0]
        lr.backward()
        refs[dt] = (lr.detach(), xr.grad, wr.grad)
    for i, (name, ours, tri) in enumerate((("loss", loss, tri_loss), ("dx", dx, tri_dx), ("dW", dw, tri_dw))):
        assert_close_to_ref(f"cute {name}", ours, refs[torch.bfloat16][i], refs[torch.float64][i], torch.bfloat16)
        assert_close_to_ref(f"cute vs triton {name}", ours, tri, refs[torch.float64][i], torch.bfloat16)


def test_kept_buffer_is_exp_of_a_minus_its_maxima():
    """The kept buffer itself: e[r, c] = exp(a[r, c] - m[c // block_v, r]) (bf16 rounding),
    and each m lies between the block's own max and the row's max (a running max)."""
    from logitless.ops.linear_cross_entropy import triton_backend as TB

    n, h, v = 300, 136, 5003
    x, w, t = inputs(n, h, v)
    budget, plan = partial_budget(n, h, v)
    with override(cute=True), cute_launches() as seen:
        call = TB.plan(x, w, None, None, CrossEntropyOptions(), budget=budget, need_grad=True, need_argmax=False)
        _, kept = TB.forward(x, w, None, t, None, None, need_smooth=False, need_argmax=False, plan=call)
    plan = plan.forward
    assert seen and seen[0]["keep_cols"] == plan.keep_cols
    keep_buf, keep_max = kept[0], kept[1]
    kc, bv = plan.keep_cols, plan.block_v
    z = x.double() @ w.double().T
    e = keep_buf[:, :kc].double()
    m = keep_max.double()  # (blocks, n)
    m_cols = m.T.repeat_interleave(bv, dim=1)[:, :kc]
    want = torch.exp(z[:, :kc] - m_cols)
    assert ((e - want).abs() <= 2 ** -8 * want + 1e-6).all(), (e - want).abs().max().item()
    block_max = torch.stack([z[:, b * bv:min(kc, (b + 1) * bv)].max(1).values for b in range(m.shape[0])])
    assert (m >= block_max - 1e-3).all() and (m <= z.max(1).values + 1e-3).all()


@pytest.mark.parametrize("n, h, v, budget", [(129, 136, 32003, None), (300, 4096, 32003, "partial")])
def test_log_probs_training_keeps_columns(n, h, v, budget):
    """linear_log_probs with entropy at T = 0.7, backward through log p and entropy: the CuTe
    forward keeps exp(a - m) (a = z / T); dx and dW vs float64 and vs the Triton forward's."""
    x, w, t = inputs(n, h, v, ignore=False)
    if budget == "partial":
        budget, _ = partial_budget(n, h, v)

    def run(use_cute, dt=None):
        xs = (x.double() if dt == torch.float64 else x.clone()).requires_grad_()
        ws = (w.double() if dt == torch.float64 else w.clone()).requires_grad_()
        if dt is not None:
            lp, ent = linear_log_probs_reference(xs, ws, t, temperature=0.7, dtype=dt)
            seen = None
        else:
            with override(cute=use_cute), cute_launches() as seen:
                lp, ent = logitless.linear_log_probs(xs, ws, t, temperature=0.7, entropy=True, memory_budget=budget)
        (lp.sum() + 0.1 * ent.sum()).backward()
        return xs.grad, ws.grad, seen

    dx, dw, seen = run(True)
    assert seen.ops() == ["linear_log_probs"] and seen[0]["keep_cols"] > 0, seen
    tdx, tdw, _ = run(False)
    rdx, rdw, _ = run(None, torch.float64)
    bdx, bdw, _ = run(None, torch.bfloat16)
    assert_close_to_ref("cute dx", dx, bdx, rdx, torch.bfloat16)
    assert_close_to_ref("cute dW", dw, bdw, rdw, torch.bfloat16)
    assert_close_to_ref("cute vs triton dx", dx, tdx, rdx, torch.bfloat16)
    assert_close_to_ref("cute vs triton dW", dw, tdw, rdw, torch.bfloat16)
