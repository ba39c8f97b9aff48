"""linear_jsd with fp32 inputs at matmul precision "high": the backward's fused kernel
multiplies operands rounded to TF32 beforehand (both x's once, each recomputed chunk's
rows of both weights: ``launch.prerounded_dlogits_operands``), with DOT_PRECISION
"tf32". Checks: bitwise the results of rounding in the kernel (same tiles, same
chunks) with every option; the launches really take the pre-rounded chunks; the
planner budgets the scratch; against float64 with torch's own "high" error as the bar.

Runs on the GPU when there is one; otherwise on the CPU interpreter (conftest.py).
"""

from __future__ import annotations

import pytest
import torch

import logitless
from logitless.ops.linear_jsd import planning as _ljsd_planning
from logitless.ops.linear_jsd import triton_backend
from logitless.ops.linear_jsd.reference import linear_jsd_reference
from logitless.planning import tiles as _tiles
from logitless.planning.overrides import override
from tests.conftest import DEVICE, HAS_CUDA
from tests.helpers import assert_close_to_ref, max_err
from tests.planning_seams import H100
from tests.test_linear_jsd import OPTIONS, make_inputs
from tests.test_precision import _round_to_tf32, matmul_precision


def _spy(monkeypatch):
    """Records each launch of the backward's fused kernel: (DOT_PRECISION, W_CHUNK)."""
    seen = []
    real = triton_backend.K.jsd_dlogits_kernel

    class Spy:
        fn = real.fn

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                seen.append((kwargs["DOT_PRECISION"], kwargs.get("W_CHUNK", False)))
                return real[grid](*args, **kwargs)
            return launch

    monkeypatch.setattr(triton_backend.K, "jsd_dlogits_kernel", Spy())
    return seen


def _run(opts, reduction, budget, preround, lead=(37,), seed=0):
    xs, ws, xt, wt, target, kw = make_inputs(lead, 40, 24, 131, torch.float32, opts, seed)
    with override(tf32_preround=preround, tiles=_tiles.INTERPRETER_TILES, strategy=("recompute", 0)):
        loss = logitless.linear_jsd(xs, ws, xt, wt, target, reduction=reduction, backend="triton",
                                    memory_budget=budget, **kw)
        inputs = [t for t in (xs, ws, kw.get("student_bias")) if t is not None]
        weights = torch.linspace(0.5, 1.5, loss.numel(), device=DEVICE).reshape(loss.shape)
        grads = torch.autograd.grad((loss * weights).sum(), inputs)
    return [loss.detach(), *grads]


CASES = [("plain", 0.5, "mean"), ("all", 0.3, "sum"), ("ignore", 0.0, "none"), ("bias", 1.0, "mean"),
         ("softcaps", 0.5, "sum"), ("hard", 0.7, "mean")]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1]}-{c[2]}")
@pytest.mark.parametrize("budget", [1 << 12, None], ids=["chunks", "whole"])
def test_prerounded_bitwise_equal_to_rounding_in_the_kernel(monkeypatch, case, budget):
    """Same tiles and chunks (the interpreter's; a tiny budget: V = 131
    (prime) in chunks of 32 columns; the default: one): loss and gradients are bitwise those of the in-kernel
    rounding ("tf32-round"), H_s = 40 and H_t = 24 (not multiples of 16), every option.
    The pre-rounded launches take "tf32" on W chunks, the reference ones "tf32-round"."""
    name, beta, reduction = case
    opts = dict(OPTIONS[name], beta=beta)
    opts.pop("shift", None) if reduction == "none" else None
    seen = _spy(monkeypatch)
    with matmul_precision("high"):
        ours = _run(opts, reduction, budget, True, seed=len(name))
        pre = list(seen)
        ref = _run(opts, reduction, budget, False, seed=len(name))
    for a, b in zip(ours, ref):
        assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a[~a.isnan()], b[~b.isnan()]), (a - b).abs().max()
    assert pre and all(s == ("tf32", True) for s in pre), pre
    assert (len(pre) > 1) if budget else len(pre) == 1  # several chunks (of 32 columns) or one
    assert seen[len(pre):] and all(s == ("tf32-round", False) for s in seen[len(pre):])


def test_highest_and_16_bit_take_no_scratch(monkeypatch):
    """"highest" (3xTF32) and bf16 inputs launch the kernel without W chunks."""
    seen = _spy(monkeypatch)
    with matmul_precision("highest"):
        _run({}, "mean", None, True)
    assert seen == [("tf32x3", False)]
    seen.clear()
    xs, ws, xt, wt, target, _ = make_inputs((9,), 24, 16, 67, torch.bfloat16, {}, 1)
    with matmul_precision("high"):
        logitless.linear_jsd(xs, ws, xt, wt, target, backend="triton").backward()
    assert len(seen) == 1 and seen[0][1] is False


@pytest.mark.parametrize("n,hs,ht,v", [(4096, 4096, 8192, 128256), (4096, 2048, 2048, 151936), (16, 64, 32, 1000)])
@pytest.mark.parametrize("budget", [2**20, 256 * 2**20, 2**31])
def test_prerounded_plan_counts_the_scratch(n, hs, ht, v, budget):
    """The plan as an H100 sees it: with pre-rounding, the recomputed chunk's dz plus its
    rows of both weights (fp32) and the fp32 dx accumulator fit the budget (or the chunk
    is the floor), x's scratch is taken off while at most half the budget, and
    ``tiles.w_chunk`` marks the plan (the chunk's rows); without, no scratch."""
    plain = _ljsd_planning.linear_jsd_plan(n, v, hs, 4, budget, H100, hidden_t=ht)
    pre = _ljsd_planning.linear_jsd_plan(n, v, hs, 4, budget, H100, hidden_t=ht, prerounded=True)
    assert plain.tiles.w_chunk == 0 and pre.tiles.w_chunk == pre.vocab_chunk > 0
    assert pre.forward_rows == plain.forward_rows  # the forward's GEMMs are cuBLAS: no scratch
    assert pre.vocab_chunk <= plain.vocab_chunk
    floor = min(_tiles.MIN_CHUNK, max(pre.tiles.block_v, -(-v // pre.tiles.block_v) * pre.tiles.block_v // 4
                                      // pre.tiles.block_v * pre.tiles.block_v))
    x_scratch = 4 * n * (hs + ht)
    left = budget - (x_scratch if x_scratch <= budget // 2 else 0) - 4 * n * hs
    assert pre.vocab_chunk == floor or pre.vocab_chunk * (4 * n + 4 * (hs + ht)) <= left


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("budget", [1 << 12, None])
def test_high_matches_float64_within_torchs_own_high_error(reduction, budget):
    """At "high" against float64 with torch's own "high" error as the bar: the
    reference in fp32 with TF32 products (cuBLAS at "high" on a GPU; on the CPU, whose
    fp32 matmul ignores the setting, emulated by rounding its operands to TF32 as
    cuBLAS does). Every option combined; several backward chunks or one."""
    opts = dict(OPTIONS["all"], beta=0.4)
    if reduction == "none":
        opts.pop("shift")
    xs, ws, xt, wt, target, kw = make_inputs((3, 11), 40, 24, 131, torch.float32, opts, seed=7)
    bs = kw.pop("student_bias")
    bt = kw.pop("teacher_bias")
    ref = linear_jsd_reference(xs, ws, xt, wt, target, reduction=reduction, student_bias=bs, teacher_bias=bt, **kw)
    grad_out = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    inputs = (xs, ws, bs)
    refs = torch.autograd.grad(ref, inputs, grad_out.double())
    with matmul_precision("high"):
        ours = logitless.linear_jsd(xs, ws, xt, wt, target, reduction=reduction, backend="triton",
                                    memory_budget=budget, student_bias=bs, teacher_bias=bt, **kw)
        ours_g = torch.autograd.grad(ours, inputs, grad_out)
        if HAS_CUDA:
            args = (xs, ws, xt, wt)
        else:
            args = tuple(_round_to_tf32(t).requires_grad_(t.requires_grad) for t in (xs, ws, xt, wt))
        same = linear_jsd_reference(*args, target, reduction=reduction, dtype=torch.float32, student_bias=bs,
                                    teacher_bias=bt, **kw)
        same_in = (args[0], args[1], bs)
        same_g = torch.autograd.grad(same, same_in, grad_out)
    for name, o, s, r in zip(("loss", "dx", "dW", "db"), (ours, *ours_g), (same, *same_g), (ref, *refs)):
        if HAS_CUDA:  # Triton's and cuBLAS' TF32 products round alike but accumulate in other
            # orders: twice torch's error, as tests/test_precision.py's GPU bar at "high"
            scale = max(r.double().abs().max().item(), 1e-2)
            e_ours, e_same = max_err(o, r), max_err(s, r)
            assert e_ours <= 2 * e_same + 2e-5 * scale, f"{name}: {e_ours:.3g} vs torch {e_same:.3g}"
        else:
            assert_close_to_ref(name, o, s, r, torch.float32)
