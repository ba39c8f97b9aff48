"""The helpers the linear ops share (issue: duplicated code): kept buffers of the custom
ops' fakes, the Triton backends' plan tensor, column chunks and dz operands, the PyTorch
backends' chunked backward, and the interpreter's module copies for the JAX side.

The ops' own tests (test_linear_cross_entropy, test_linear_log_probs, ...) exercise them
end to end; these check each helper's contract directly, at tiny sizes.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from logitless.ops.common.glue import fake_grad_outputs, grad_outputs, zero_grads
from logitless.ops.common.kept import NOTHING_KEPT, fake_kept, nothing_kept
from logitless.ops.common.torch_tiles import chunked_backward, linear_torch_plan
from logitless.planning.plans import TorchPlan
from logitless.planning.tiles import TritonPlan


def test_nothing_kept_dummies():
    x = torch.randn(3, 5, dtype=torch.bfloat16)
    keep, keep_max = nothing_kept(x)
    assert keep.shape == NOTHING_KEPT and keep.dtype == torch.bfloat16
    assert keep_max.shape == NOTHING_KEPT and keep_max.dtype == torch.float32


def test_fake_kept_concrete_and_none():
    with FakeTensorMode():
        x, w = torch.empty(7, 4), torch.empty(11, 4)
        calls = []

        def shapes(n, v, h):
            calls.append((n, v, h))
            return (n, 16), (2, n)

        keep, keep_max = fake_kept(x, w, "", -1, shapes)
        assert calls == [(7, 11, 4)]
        assert keep.shape == (7, 16) and keep.dtype == x.dtype
        assert keep_max.shape == (2, 7) and keep_max.dtype == torch.float32
        keep, keep_max = fake_kept(x, w, "", -1, lambda n, v, h: None)
        assert keep.shape == NOTHING_KEPT and keep_max.shape == NOTHING_KEPT


def test_grad_outputs_distinct_empties():
    x, w, b = torch.randn(2, 3), torch.randn(4, 3), torch.randn(4)
    dx, dw, db = grad_outputs(x, x, None, None, True, False, False)
    assert dx is x and dw.shape == (0,) and db.shape == (0,) and dw.dtype == x.dtype
    assert dw is not db  # a custom op's outputs may not alias
    with FakeTensorMode():
        fx, fw, fb = torch.empty(2, 3), torch.empty(4, 3), torch.empty(4)
        out = fake_grad_outputs(fx, fw, fb, False, True, True)
        assert out[0].shape == (0,) and out[1].shape == (4, 3) and out[2].shape == (4,)
    zx, zw, zb = zero_grads(x, w, None)
    assert zb is None and not zx.any() and not zw.any() and zw.shape == w.shape
    assert zero_grads(x, w, b)[2].shape == b.shape


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("dx_acc", [False, True])
def test_chunked_backward_is_the_matmuls(dtype, dx_acc):
    """With dz given, dx = dz W, dW = dz^T x, db = column sums, over several chunks."""
    g = torch.Generator().manual_seed(0)
    n, h, v = 13, 9, 23
    x = torch.randn(n, h, generator=g).to(dtype)
    w = torch.randn(v, h, generator=g).to(dtype)
    b = torch.randn(v, generator=g).to(dtype)
    cd = torch.float64 if dtype == torch.float64 else torch.float32
    dz_full = torch.randn(n, v, generator=g, dtype=cd)
    seen = []

    def dz_of(x_c, w_v, b_v, n0, n1, v0):
        assert x_c.dtype == cd and w_v.dtype == cd and (b_v is None or b_v.dtype == cd)
        seen.append((n0, n1, v0))
        return dz_full[n0:n1, v0:v0 + w_v.shape[0]].clone()

    dx, dw, db = chunked_backward(x, w, b, TorchPlan(token_chunk=5, vocab_chunk=7), dz_of,
                                  need_dx=True, need_dw=True, need_db=True, dx_acc=dx_acc)
    assert len(seen) == 3 * 4  # ceil(13 / 5) token chunks x ceil(23 / 7) vocab chunks
    assert dx.dtype == (cd if dx_acc else dtype) and dw.dtype == dtype and db.dtype == dtype
    torch.testing.assert_close(dx, (dz_full @ w.to(cd)).to(dx.dtype))
    torch.testing.assert_close(dw, (dz_full.T @ x.to(cd)).to(dtype))
    torch.testing.assert_close(db, dz_full.sum(0).to(dtype))
    none = chunked_backward(x, w, None, TorchPlan(5, 7), dz_of, need_dx=False, need_dw=False, need_db=False)
    assert none == (None, None, None)


def test_linear_torch_plan_counts_the_upcast():
    x16, x32 = torch.empty(64, 32, dtype=torch.bfloat16), torch.empty(64, 32)
    p16 = linear_torch_plan(x16, 1000, 200_000, tiles=1, accumulators=1)
    p32 = linear_torch_plan(x32, 1000, 200_000, tiles=1, accumulators=0)
    assert p16.token_chunk * p16.vocab_chunk <= p32.token_chunk * p32.vocab_chunk


def test_backward_chunks_and_kept_shapes():
    launch = pytest.importorskip("logitless.triton_lib.launch", reason="needs triton")
    plan = TritonPlan(block_n=16, block_v=32, block_h=16, num_warps=4, num_stages=2, vocab_splits=1,
                      vocab_chunk=64, keep_cols=96)
    assert launch.backward_chunks(plan, 257, 96) == [(0, 96), (96, 160), (160, 224), (224, 257)]
    assert launch.backward_chunks(plan, 100, 0) == [(0, 64), (64, 100)]
    assert launch.kept_shapes_of(plan, 5) == ((5, 96), (3, 5))
    odd = dataclasses.replace(plan, keep_cols=33)
    assert launch.kept_shapes_of(odd, 5) == ((5, 40), (2, 5))  # rows padded to 8 elements
    x = torch.randn(5, 8)
    buf, keep, keep_max, op = launch.keep_buffers(odd, 5, x, use_tma=False)
    assert buf.shape == (5, 40) and keep.shape == (5, 33) and keep.data_ptr() == buf.data_ptr()
    assert keep_max.shape == (2, 5) and keep_max.dtype == torch.float32 and op is keep
    assert launch.dz_buffer(plan, 5, 257, 96, x).shape == (5, 64)
    assert launch.dz_buffer(plan, 5, 100, 70, x).shape == (5, 32)  # 30 columns left, padded to 32
    dz = launch.dz_buffer(plan, 5, 257, 96, x)[:, :50]
    assert launch.dz_operand(dz, plan, use_tma=True) == (dz, False)  # plan.dz_tma is off
    tiles, row_blocks = launch.dlogits_tiles(plan, 40, 70, x.device)
    assert (tiles, row_blocks) == (3 * 3, 3)


def test_interpreted_modules_add_helper_dependencies():
    interpret = pytest.importorskip("logitless.triton_lib.interpret", reason="needs triton")
    names = interpret._with_dependencies(("logitless.triton_lib.lce_kernels",))
    assert names[-1] == "logitless.triton_lib.lce_kernels"
    for dep in ("ce_math", "gemm", "tile_io"):
        assert f"logitless.triton_lib.{dep}" in names[:-1]
    assert names.index("logitless.triton_lib.ce_math") < names.index("logitless.triton_lib.gemm") \
        < names.index("logitless.triton_lib.tile_io")  # each after what it imports
    listed = ("logitless.triton_lib.ce_math", "logitless.triton_lib.gemm", "logitless.triton_lib.lce_kernels")
    assert interpret._with_dependencies(listed) == listed[:2] + ("logitless.triton_lib.tile_io",) + listed[2:]
