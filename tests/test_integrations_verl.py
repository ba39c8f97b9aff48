"""logitless.integrations.verl.linear_cross_entropy: verl's fused-kernel signature and
conventions (verl 0.9.1), against our op and a plain torch implementation of verl's
semantics (float64 as the yardstick)."""

from __future__ import annotations

import pytest
import torch

import logitless
from logitless.integrations.verl import linear_cross_entropy


def _plain_verl(hidden, weight, labels, temperature, reduction):
    """verl's semantics in plain torch: flattened, +log p, entropy per token."""
    h = hidden.reshape(-1, hidden.shape[-1]).double()
    a = (h @ weight.double().T) / temperature
    lp = torch.log_softmax(a, -1)
    logp = lp.gather(-1, labels.reshape(-1, 1)).squeeze(-1)
    ent = -(lp.exp() * lp).sum(-1)
    if reduction == "sum":
        logp = logp.sum()
    elif reduction == "mean":
        logp = logp.mean()
    return logp, ent


def _inputs(shape=(2, 5), h=24, v=101, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(*shape, h, generator=g).to(dtype).requires_grad_()
    weight = (torch.randn(v, h, generator=g) / h ** 0.5).to(dtype).requires_grad_()
    labels = torch.randint(0, v, shape, generator=g)
    return hidden, weight, labels


@pytest.mark.parametrize("reduction", ["none", "sum", "mean", "MEAN"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_matches_plain_verl_semantics_and_our_op(reduction, temperature):
    hidden, weight, labels = _inputs()
    logp, ent = linear_cross_entropy(hidden, weight, labels, temperature, reduction)
    red = reduction.lower()
    assert logp.dtype == ent.dtype == torch.float32
    assert ent.shape == (10,) and logp.shape == ((10,) if red == "none" else ())
    rlogp, rent = _plain_verl(hidden, weight, labels, temperature, red)
    torch.testing.assert_close(logp.double(), rlogp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent.double(), rent, rtol=1e-5, atol=1e-5)
    # same numbers as the op itself (flattened)
    olp, oent = logitless.linear_log_probs(hidden, weight, labels, temperature=temperature, entropy=True)
    torch.testing.assert_close(ent, oent.reshape(-1), rtol=0, atol=0)
    if red == "none":
        torch.testing.assert_close(logp, olp.reshape(-1), rtol=0, atol=0)
        assert (logp <= 0).all()  # +log p, verl's sign
    # gradients from both outputs
    g1 = torch.randn(logp.shape, dtype=torch.float64)
    g2 = torch.randn(ent.shape, dtype=torch.float64)
    dh, dw = torch.autograd.grad((logp.double() * g1).sum() + (ent.double() * g2).sum(), (hidden, weight))
    h64, w64 = hidden.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    r1, r2 = _plain_verl(h64, w64, labels, temperature, red)
    rdh, rdw = torch.autograd.grad((r1 * g1).sum() + (r2 * g2).sum(), (h64, w64))
    torch.testing.assert_close(dh.double(), rdh, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(dw.double(), rdw, rtol=1e-4, atol=1e-5)


def test_bf16_and_flat_inputs():
    hidden, weight, labels = _inputs(shape=(7,), dtype=torch.bfloat16, seed=3)
    logp, ent = linear_cross_entropy(hidden, weight, labels, 0.9)
    rlogp, rent = _plain_verl(hidden, weight, labels, 0.9, "none")
    assert (logp.double() - rlogp).abs().max() < 1e-4 and (ent.double() - rent).abs().max() < 1e-4


def test_errors():
    hidden, weight, labels = _inputs()
    with pytest.raises(TypeError, match="process_group"):
        linear_cross_entropy(hidden, weight, labels, 1.0, "none", dist_process_group=object())
    with pytest.raises(ValueError, match="reduction"):
        linear_cross_entropy(hidden, weight, labels, 1.0, "avg")
    with pytest.raises(ValueError, match="temperature"):
        linear_cross_entropy(hidden, weight, labels, 0.0)
    with pytest.raises(ValueError, match="labels"):
        linear_cross_entropy(hidden, weight, labels[:, :3])
    with pytest.raises(ValueError):
        linear_cross_entropy(hidden, weight, labels.masked_fill(labels == labels[0, 0], 10_000))


def test_against_verls_own_kernel():
    try:
        from verl.utils.kernel.linear_cross_entropy import linear_cross_entropy as verl_lce
    except Exception as exc:  # verl is optional and not a dependency
        pytest.skip(f"verl not importable ({exc!r})")
    if not torch.cuda.is_available():
        pytest.skip("verl's kernel has no CPU path (it asserts CUDA tensors)")
    g = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(256, 256, device="cuda", generator=g, dtype=torch.bfloat16)
    weight = torch.randn(4096, 256, device="cuda", generator=g, dtype=torch.bfloat16) / 16
    labels = torch.randint(0, 4096, (256,), device="cuda", generator=g)
    ours = linear_cross_entropy(hidden, weight, labels, 0.7, "none")
    theirs = verl_lce(hidden, weight, labels, 0.7, "none")
    ref = _plain_verl(hidden, weight, labels, 0.7, "none")
    for o, t, r in zip(ours, theirs, ref):
        assert o.shape == t.shape and o.dtype == t.dtype
        assert (o.double() - r).abs().max() <= (t.double() - r).abs().max() + 1e-5


def _tp_worker(rank, world, device):
    """verl's TP contract (verl's tests/utils/test_special_linear_cross_entropy_tp.py,
    ported to gloo): each rank holds its rows of the weight, hidden and labels are the
    same everywhere; logprobs and entropy equal the unsharded call (bitwise the same on
    every rank); hidden's gradient is this rank's PARTIAL gradient, which the caller
    all-reduces ("all-reduce on hidden is conducted outside the kernel") to get the
    unsharded gradient; weight's gradient is this rank's rows of the unsharded one."""
    import torch.distributed as dist

    from tests._distributed import blocks, same_on_every_rank

    group = dist.group.WORLD
    for rows, shape in (([51, 50], (2, 5)), ([40] * world, (1, 7))):  # uneven; verl's equal blocks, 3-D
        hidden, weight, labels = _inputs(shape=shape, h=24, v=sum(rows), dtype=torch.float64, seed=4)
        hidden, weight, labels = hidden.detach().to(device), weight.detach().to(device), labels.to(device)
        mine = blocks(rows, rank)
        n = labels.numel()
        g = torch.Generator().manual_seed(7)  # verl broadcasts its upstream gradients: same seed
        g_entropy = (torch.rand(n, generator=g, dtype=torch.float64) - 0.5).to(device)
        g_logprobs = (torch.rand(n, generator=g, dtype=torch.float64) * 2 - 1).to(device)
        for reduction in ("none", "mean"):
            hl, wl = hidden.clone().requires_grad_(), weight[mine].clone().requires_grad_()
            logp, ent = linear_cross_entropy(hl, wl, labels, 1.5, reduction, dist_process_group=group)
            hs, ws = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
            logp1, ent1 = linear_cross_entropy(hs, ws, labels, 1.5, reduction)
            assert logp.shape == logp1.shape and ent.shape == ent1.shape
            same_on_every_rank("logprobs", logp.detach().reshape(-1))
            same_on_every_rank("entropy", ent.detach())
            torch.testing.assert_close(logp, logp1, rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(ent, ent1, rtol=1e-12, atol=1e-12)
            gl = g_logprobs if reduction == "none" else g_logprobs[0]
            tp_dh, tp_dw = torch.autograd.grad((ent, logp), (hl, wl), (g_entropy, gl))
            dh, dw = torch.autograd.grad((ent1, logp1), (hs, ws), (g_entropy, gl))
            # before the caller's reduction: the gradient through this rank's rows only
            hp = hidden.clone().requires_grad_()
            a = torch.cat([hp @ weight[:mine.start].T, hp @ weight[mine].T, hp @ weight[mine.stop:].T], -1)
            a = torch.cat([a[..., :mine.start].detach(), a[..., mine], a[..., mine.stop:].detach()], -1)
            rlp, rent = _plain_verl(a, torch.eye(a.shape[-1], dtype=a.dtype), labels, 1.5, reduction)
            (part,) = torch.autograd.grad((rent, rlp), (hp,), (g_entropy, gl))
            assert tp_dh.shape == hidden.shape
            torch.testing.assert_close(tp_dh, part, rtol=1e-10, atol=1e-12)
            dist.all_reduce(tp_dh, op=dist.ReduceOp.SUM, group=group)  # the caller's reduction
            torch.testing.assert_close(tp_dh, dh, rtol=1e-10, atol=1e-12)
            torch.testing.assert_close(tp_dw, dw[mine], rtol=1e-10, atol=1e-12)


def test_dist_process_group_two_ranks():
    """Gloo, 2 ranks (NCCL with 2 GPUs): the spawn helper of tests/_distributed.py."""
    from tests._distributed import spawn

    spawn(_tp_worker, 2)


def test_verl_drop_in_truncated_and_invariant():
    """The keyword-only extras reach linear_log_probs (top-k / top-p, batch invariance)."""
    import logitless
    from logitless.integrations.verl import linear_cross_entropy as verl_lce

    g = torch.Generator().manual_seed(0)
    h = torch.randn(2, 5, 16, generator=g)
    w = torch.randn(41, 16, generator=g)
    labels = torch.randint(0, 41, (2, 5), generator=g)
    lp, ent = verl_lce(h, w, labels, 0.8, top_k=4, top_p=0.9, batch_invariant=True)
    ref_lp, ref_ent = logitless.linear_log_probs(h.reshape(-1, 16), w, labels.reshape(-1), temperature=0.8,
                                                 entropy=True, top_k=4, top_p=0.9)
    assert torch.equal(torch.isinf(lp), torch.isinf(ref_lp))
    fin = torch.isfinite(ref_lp)
    assert torch.allclose(lp[fin], ref_lp[fin]) and torch.allclose(ent, ref_ent)
    plain, _ = verl_lce(h, w, labels, 0.8)
    assert torch.isfinite(plain).all()
