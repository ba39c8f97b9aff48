"""fp32 at matmul precision "high" on operands rounded to TF32 beforehand (issue 23 item 2):
x and W rounded by ``launch.round_to_tf32`` into scratch buffers (W in vocabulary chunks),
the fused kernels multiplying them with DOT_PRECISION "tf32". Checks: the rounding kernel
is the kernels' "tf32-round" bit for bit; the pre-rounded path gives bitwise the results
of rounding in the kernels (same tiles, same plan) with every option, kept columns and
chunks; the planner counts the scratch buffers against the budget; "highest" and the
truncating override are untouched."""

from __future__ import annotations

import contextlib
import dataclasses
import math

import pytest
import torch

import logitless
from logitless.options import CrossEntropyOptions
from logitless.planning import plans as _plans
from logitless.planning import tiles as _tiles
from logitless.planning.overrides import override
from logitless.triton_lib import launch
from tests.conftest import DEVICE
from tests.planning_seams import H100, reshaped
from tests.test_precision import _inputs, _round_to_tf32, matmul_precision


def test_round_kernel_is_the_kernels_rounding_bit_for_bit():
    """Random values over many binades, exact ties (the 14th mantissa bit alone: away
    from zero), values that carry into the exponent, zeros, infinities, NaN, and a
    strided (transposed) source: the kernel's output bits equal the torch emulation of
    ``gemm.round_to_tf32`` (and of cvt.rna.tf32.f32), and every output is TF32-exact."""
    g = torch.Generator().manual_seed(0)
    vals = torch.randn(37, 23, generator=g) * torch.exp2(torch.randint(-60, 60, (37, 23), generator=g).float())
    bits = vals.view(torch.int32)
    bits[0, :10] = (bits[0, :10] & ~0x1FFF) | 0x1000  # exact ties: round away from zero
    bits[1, :10] = bits[1, :10] | 0x1FFF  # all low bits set: carry (into the exponent for some)
    vals[2, :6] = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1.0 + 2.0**-11])
    vals[3, 0] = torch.finfo(torch.float32).max  # rounds up to inf, as cvt.rna does
    src = vals.to(DEVICE)
    for s in (src, src.T):
        out = launch.round_to_tf32(s)
        assert out.is_contiguous() and out.shape == s.shape
        want = _round_to_tf32(s.cpu())
        assert torch.equal(out.cpu().view(torch.int32), want.view(torch.int32))
        assert (out.cpu().view(torch.int32) & 0x1FFF).eq(0).logical_or(out.cpu().isnan()).all()
    assert launch.round_to_tf32(src)[2, 5].item() == 1.0 + 2.0**-10  # a tie: away from zero
    assert launch.round_to_tf32(torch.empty(0, 5, device=DEVICE)).shape == (0, 5)


def _recorder(monkeypatch):
    """Records each fused-kernel launch (a GEMM kernel: it takes DOT_PRECISION): (kernel,
    DOT_PRECISION, W_CHUNK, split0)."""
    seen = []
    real = launch.run_kernel

    def spy(kernel, grid, *args, **kwargs):
        if "DOT_PRECISION" in kwargs:
            seen.append((kernel.fn.__name__, kwargs.get("DOT_PRECISION"), kwargs.get("W_CHUNK", False),
                         kwargs.get("split0", 0)))
        return real(kernel, grid, *args, **kwargs)

    monkeypatch.setattr(launch, "run_kernel", spy)
    return seen


def _run(x, w, t, pre, reshape, **kw):
    # The interpreter's tiles also on a GPU: both paths then get the same tiles and plan.
    with override(tf32_preround=pre, tiles=_tiles.INTERPRETER_TILES), \
            reshaped(reshape) if reshape is not None else contextlib.nullcontext():
        out = logitless.linear_cross_entropy(x, w, t, backend="triton", **kw)
        inputs = [a for a in (x, w, kw.get("bias")) if a is not None]
        grads = torch.autograd.grad(out.sum(), inputs)
    return out, grads


OPTION_SETS = [
    dict(),
    dict(bias=True, softcap=4.0, reduction="sum"),
    dict(class_weight=True, label_smoothing=0.1, ignore_index=-100, z_loss=1e-3),
    dict(bias=True, softcap=3.0, class_weight=True, label_smoothing=0.2, reduction="none"),
]


@pytest.mark.parametrize("opts", range(len(OPTION_SETS)))
@pytest.mark.parametrize("layout", ["chunks+kept", "chunks", "whole"])
def test_prerounded_bitwise_equal_to_rounding_in_the_kernel(monkeypatch, opts, layout):
    """Same tiles, same plan (forced: splits, kept columns, backward chunks and, for the
    pre-rounded path, the W chunk of each forward launch): loss and every gradient are
    bitwise those of the in-kernel rounding, with each option set, V prime (131), H not
    a multiple of 16 (40), and the chunked launches really ran (W_CHUNK, split0 > 0).
    Bitwise on a GPU too: at the interpreter's tiles both paths' tl.dot lower to the same
    mma.sync m16n8k8 tf32 on register operands (``test_tf32_paths_lower_alike_on_sm90``),
    on identical TF32-exact values. The reference path's backward must run "tf32-round"
    under the forward's overrides (autograd's CUDA thread: ``glue.CustomOp``'s backward)."""
    x, w, t, _ = _inputs(37, 40, 131, torch.float32, seed=11 + opts)
    g = torch.Generator().manual_seed(opts)
    kw = dict(OPTION_SETS[opts])
    if kw.pop("bias", False):
        kw["bias"] = torch.randn(131, generator=g).to(DEVICE).requires_grad_(True)
    if kw.pop("class_weight", False):
        kw["class_weight"] = (torch.rand(131, generator=g) + 0.5).to(DEVICE)
    if "ignore_index" in kw:
        t = t.clone()
        t[::5] = kw["ignore_index"]
    keep, w_chunk = {"chunks+kept": (32, 64), "chunks": (0, 64), "whole": (0, 160)}[layout]

    def reshape(p):  # block_v 32 on the interpreter: 5 blocks, splits of 2 blocks
        return dataclasses.replace(p, vocab_splits=3, keep_cols=keep, vocab_chunk=64, w_chunk=w_chunk)

    seen = _recorder(monkeypatch)
    with matmul_precision("high"):
        ours, ours_g = _run(x, w, t, True, reshape, **kw)
        pre_launches = list(seen)
        ref, ref_g = _run(x, w, t, False, reshape, **kw)
    assert torch.equal(ours, ref), (ours - ref).abs().max()
    for a, b in zip(ours_g, ref_g):
        assert torch.equal(a, b), (a - b).abs().max()
    forward = [s for s in pre_launches if s[0] == "forward_stats_kernel"]
    if layout == "whole":
        assert forward == [("forward_stats_kernel", "tf32", False, 0)]
    else:  # 3 splits of 64 columns: one launch per split, each with its W chunk
        assert [(s[1], s[2], s[3]) for s in forward] == [("tf32", True, 0), ("tf32", True, 1), ("tf32", True, 2)]
    dl = [s for s in pre_launches if s[0] == "dlogits_kernel"]
    assert dl and all(s[1:3] == ("tf32", True) for s in dl)
    assert all(s[1] == "tf32-round" for s in seen[len(pre_launches):])  # the reference path


def test_prerounded_3d_one_token_and_empty():
    """3-D input, one token and no token at "high": the pre-rounded path matches the
    in-kernel rounding bitwise (planner's own plan), and an empty batch gives the
    empty/zero results of the op."""
    with matmul_precision("high"):
        for shape in ((2, 3), (1,)):
            x, w, t, _ = _inputs(math.prod(shape), 40, 131, torch.float32, seed=5)
            x3 = x.detach().reshape(*shape, 40).requires_grad_(True)
            t3 = t.reshape(shape)
            a = _run(x3, w, t3, True, None)
            b = _run(x3, w, t3, False, None)
            assert torch.equal(a[0], b[0]) and all(torch.equal(p, q) for p, q in zip(a[1], b[1]))
        x0 = torch.zeros(0, 40, device=DEVICE, requires_grad=True)
        w0 = torch.randn(131, 40, device=DEVICE, requires_grad=True)
        loss = logitless.linear_cross_entropy(x0, w0, torch.zeros(0, dtype=torch.long, device=DEVICE),
                                              backend="triton", reduction="sum")
        loss.backward()
        assert loss.item() == 0.0 and not w0.grad.any()


def test_prerounded_only_at_high_with_rounding():
    """"highest" (3xTF32) and 16-bit inputs plan no scratch; at
    "high" fp32 plans a W chunk when pre-rounding is forced (by default the planner
    chooses: tests/test_tf32_plan_choice.py)."""
    cpu = torch.device("cpu")
    args = (64, 1000, 48, 4, 2**20, cpu)
    with matmul_precision("high"):
        assert launch.tf32_prerounded(torch.float32)
        assert not launch.tf32_prerounded(torch.bfloat16)
        with override(tf32_preround=False):
            assert not launch.tf32_prerounded(torch.float32)
        with override(tf32_preround=True):
            assert launch.tf32_prerounded(torch.float32)
            assert _plans.triton_plan(*args, prerounded=True).w_chunk > 0
    with matmul_precision("highest"):
        assert not launch.tf32_prerounded(torch.float32)
    assert _plans.triton_plan(*args).w_chunk == 0


def _no_kept_columns(plan):
    """A plan that keeps no column (what a tiny budget gives; on GPUs the cost model may
    keep some at the minimum budget)."""
    return dataclasses.replace(plan, keep_cols=0)


@pytest.mark.parametrize("n,h,v", [(4096, 4096, 128256), (512, 2048, 32000), (8192, 768, 50257), (16, 64, 1000)])
@pytest.mark.parametrize("budget", [2**20, 256 * 2**20, 2**31, 2**34])
@pytest.mark.parametrize("keep", [False, True])
def test_prerounded_plan_counts_the_scratch(monkeypatch, n, h, v, budget, keep):
    """The planner (an H100 as it sees one: the cost model's rule) with the scratch
    of the pre-rounded operands: x (4 N H bytes, when at most half the budget) + kept
    columns + one recomputed chunk (dz and its rounded W rows) <= budget, and x + kept
    columns + the forward's W chunk <= budget, unless at the floors (min-width chunks
    of dz and of W); the W chunk is whole splits (or all of W), the tiles
    CUDA_TILES_TF32's."""
    monkeypatch.setenv("LOGITLESS_TUNED", "0")  # the shipped tables (no GPU to name a tuned cache)
    with override(tf32_preround=True):
        p = _plans.triton_plan(n, v, h, 4, budget, H100, keep_allowed=keep, prerounded=True)
    assert (p.block_n, p.block_v, p.block_h, p.num_warps, p.num_stages) == _tiles.CUDA_TILES_TF32[keep]
    vocab_blocks = math.ceil(v / p.block_v)
    split_cols = math.ceil(vocab_blocks / p.vocab_splits) * p.block_v
    assert p.w_chunk % split_cols == 0 or p.w_chunk == vocab_blocks * p.block_v, p
    assert 0 < p.w_chunk <= vocab_blocks * p.block_v
    x_bytes = 4 * n * h if 4 * n * h <= budget // 2 else 0  # else beside the budget (x-sized)
    kept = p.keep_cols * n * (4 + 4 / p.block_v)
    min_cols = min(_tiles.MIN_CHUNK, max(p.block_v, vocab_blocks * p.block_v // 4 // p.block_v * p.block_v))
    floor = x_bytes + (n * 4 + 4 * h) * min_cols
    if p.keep_cols < v:  # the backward's chunk buffers: dz and W rows of min(chunk, V - kept) columns
        width = min(p.vocab_chunk, v - p.keep_cols)
        assert x_bytes + kept + width * (4 * n + 4 * h) <= max(budget, floor), p
    w_floor = math.ceil(min_cols / split_cols) * split_cols  # whole splits of min_cols or more
    assert x_bytes + kept + 4 * h * p.w_chunk <= max(budget, x_bytes + kept + 4 * h * w_floor), p
    assert p.w_chunk >= min(min_cols, v), p
    if not keep:
        assert p.keep_cols == 0
    if budget >= x_bytes + 4 * h * v + 4 * n * min_cols and not keep:
        assert p.w_chunk == vocab_blocks * p.block_v  # W whole when the budget holds it
    # Enough programs per forward launch: about WAVES per SM, or every tile of the chunk.
    per_launch = math.ceil(n / p.block_n) * (p.w_chunk // split_cols)
    assert per_launch >= min(_tiles.WAVES * 132 // 2, math.ceil(n / p.block_n) * p.w_chunk // p.block_v), p


def test_prerounded_plan_same_for_fake_forward_and_backward():
    """kept_shapes (the custom op's fake implementation) follows the pre-rounded plan:
    the kept buffers it announces are the ones the forward returns under the same plan."""
    from logitless.ops.linear_cross_entropy import triton_backend as tb

    x, w, t, _ = _inputs(37, 40, 131, torch.float32, seed=2)
    budget = 4 * 37 * 40 + 37 * 4 * 64 + 37 * 4 * 64 + 4 * 40 * 64
    # The interpreter's tiles and the budget rule on every device: with an H100's own
    # tiles (128 x 128 in fp32) this budget holds no kept tile, and the case is the kept
    # buffers. On an emulated H100 the forced plan keeps columns too:
    forced = dict(tiles=_tiles.INTERPRETER_TILES, tf32_preround=True)
    with matmul_precision("high"), override(**forced):
        gpu_plan = _plans.linear_plan(37, 131, 40, 4, budget, H100, keep_allowed=True, prerounded=True).forward
    assert gpu_plan.w_chunk > 0 and gpu_plan.keep_cols > 0, gpu_plan
    with matmul_precision("high"), override(**forced):
        plan = tb.plan(x, w, None, None, CrossEntropyOptions(), budget=budget, need_grad=True, need_argmax=False)
        shapes = tb.kept_shapes(plan, 37)
        _, kept = tb.forward(x.detach(), w.detach(), None, t, None, None, need_smooth=False, need_argmax=False,
                             plan=plan)
    assert kept is not None and shapes is not None, "the plan keeps no column"
    assert plan.keeps and plan.forward.w_chunk > 0 and plan.forward.keep_cols > 0
    assert shapes == (tuple(kept[0].shape), tuple(kept[1].shape))


@pytest.mark.parametrize("opts", [dict(), dict(entropy=True, softcap=4.0, temperature=0.7, bias=True)])
@pytest.mark.parametrize("keep", [0, 32])
def test_log_probs_prerounded_bitwise_equal_to_rounding_in_the_kernel(monkeypatch, opts, keep):
    """linear_log_probs takes the same pre-rounded path (chunked W, split0 > 0): log-probs,
    entropy and gradients bitwise those of the in-kernel rounding under the same plan."""
    x, w, t, _ = _inputs(37, 40, 131, torch.float32, seed=21)
    kw = dict(opts)
    if kw.pop("bias", False):
        kw["bias"] = torch.randn(131, generator=torch.Generator().manual_seed(1)).to(DEVICE).requires_grad_(True)

    def reshape(p):
        return dataclasses.replace(p, vocab_splits=3, keep_cols=keep, vocab_chunk=64, w_chunk=64)

    def run(pre):
        with override(tf32_preround=pre, tiles=_tiles.INTERPRETER_TILES), reshaped(reshape):
            out = logitless.linear_log_probs(x, w, t, backend="triton", **kw)
            outs = out if isinstance(out, tuple) else (out,)
            loss = sum((o * (i + 1.5)).sum() for i, o in enumerate(outs))
            inputs = [a for a in (x, w, kw.get("bias")) if a is not None]
            return outs, torch.autograd.grad(loss, inputs)

    seen = _recorder(monkeypatch)
    with matmul_precision("high"):
        a_out, a_g = run(True)
        pre = list(seen)
        b_out, b_g = run(False)
    for p, q in zip(a_out + a_g, b_out + b_g):
        assert torch.equal(p, q), (p - q).abs().max()
    fwd = [s for s in pre if s[0] == "logp_forward_kernel"]
    assert [(s[1], s[2], s[3]) for s in fwd] == [("tf32", True, 0), ("tf32", True, 1), ("tf32", True, 2)]
    assert all(s[1] == "tf32-round" for s in seen[len(pre):])


@pytest.mark.parametrize("op", ["linear_cross_entropy", "linear_log_probs"])
def test_backward_on_another_thread_follows_the_forward_overrides(monkeypatch, op):
    """Autograd runs a CUDA backward on a device thread of its own, outside the caller's
    ``override(...)`` context (the GPU failure of the in-kernel path: its backward took
    the pre-rounded one). Emulated here: the backward runs in a fresh thread with an empty
    context. It must still plan and round as its forward did: "tf32-round" in every
    kernel under ``override(tf32_preround=False)``, the forced tiles (BLOCK_V 64 here,
    not the interpreter's 32), and the same gradients as a backward in the caller's context."""
    import contextvars
    import threading

    seen = []
    real = launch.run_kernel

    def spy(kernel, grid, *args, **kwargs):
        if "DOT_PRECISION" in kwargs:  # (the GEMM kernels)
            seen.append((kernel.fn.__name__, kwargs.get("DOT_PRECISION"), kwargs.get("BLOCK_V")))
        return real(kernel, grid, *args, **kwargs)

    monkeypatch.setattr(launch, "run_kernel", spy)
    x, w, t, _ = _inputs(20, 24, 97, torch.float32, seed=3)
    fn = getattr(logitless, op)

    def grads(thread):
        with override(tf32_preround=False, tiles=(16, 64, 16, 4, 1)), reshaped(_no_kept_columns):
            loss = fn(x, w, t, backend="triton", memory_budget=2000).sum()  # keeps no column
            if not thread:
                return torch.autograd.grad(loss, (x, w))
            out = []
            worker = threading.Thread(target=contextvars.Context().run,
                                      args=(lambda: out.append(torch.autograd.grad(loss, (x, w))),))
            worker.start()
            worker.join()
            return out[0]

    with matmul_precision("high"):
        a = grads(thread=True)
        backward = [s for s in seen if s[0] in ("dlogits_kernel", "logp_dlogits_kernel")]
        b = grads(thread=False)
    assert backward and all(s[1:] == ("tf32-round", 64) for s in seen), seen
    assert all(torch.equal(p, q) for p, q in zip(a, b))


def test_tf32_paths_lower_alike_on_sm90():
    """The premise of the bitwise tests on a GPU, checked on the CPU: an AOT compile for
    sm_90 (Triton's bundled ptxas) of the forward and dlogits kernels of both ops at the
    interpreter's tiles gives the same MMA instruction and operand sources for the
    pre-rounded ("tf32") and the in-kernel ("tf32-round") paths
    (benchmarks/check_tf32_lowering.py; it exits 1 otherwise)."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    out = subprocess.run([sys.executable, os.path.join(root, "benchmarks", "check_tf32_lowering.py")],
                         capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    rows = [line.split(None, 4) for line in out.stdout.splitlines()[1:] if line.split()[1:2] == ["interpreter"]]
    assert len(rows) == 8 and all("mma.sync.aligned.m16n8k8" in r[4] and r[3] == "registers" for r in rows), out.stdout
