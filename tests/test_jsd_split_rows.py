"""Split-row distillation statistics (``triton_lib.jsd_rows.row_stats``, issue 23):
each row over several programs, merged, against float64 and the one-program kernel.

Runs on the GPU when there is one; otherwise on the Triton CPU interpreter, small.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import logitless
from logitless.formulas.jsd import row_stats as reference_row_stats
from logitless.options import JSDOptions
from logitless.planning import device
from logitless.planning.logits import JSDStatsPlan, jsd_stats_plan
from logitless.triton_lib.jsd_rows import row_stats
from tests.conftest import DEVICE
from tests.planning_seams import H100, on_device

BETAS = [0.0, 0.3, 1.0]


def _logits(n, v, seed, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    zs = torch.randn(n, v, generator=g) * scale
    zt = torch.randn(n, v, generator=g) * scale
    target = torch.randint(0, v, (n,), generator=g)
    return zs, zt, target


def _capped(z, cap):
    return z if cap is None else cap * torch.tanh(z / cap)


def _stats(zs, zt, target, opts, plan):
    stats = torch.full((6, zs.shape[0]), float("nan"), dtype=torch.float32, device=DEVICE)
    row_stats(zs.to(DEVICE), zt.to(DEVICE), target.to(DEVICE), stats, opts, plan)
    return stats.cpu()


def _tol(ref):
    return 2e-5 * (1 + ref.abs())


@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("option", ["plain", "temperature", "softcap", "hard", "all"])
@pytest.mark.parametrize("splits,per_split", [(1, 8), (2, 3), (5, 1), (3, 2)])
def test_split_statistics_match_float64(beta, option, splits, per_split):
    """Every split layout (one split; a ragged last split; one block per split) gives the
    float64 statistics, for each divergence mode and option."""
    n, v, block_v = 5, 37 * 3 + 4, 16  # 115 columns: 8 blocks of 16, the last one ragged
    blocks = math.ceil(v / block_v)
    splits = min(splits, math.ceil(blocks / per_split))
    kw = dict(beta=beta)
    if option in ("temperature", "all"):
        kw["temperature"] = 0.7
    if option in ("softcap", "all"):
        kw.update(student_softcap=4.0, teacher_softcap=5.0)
    if option in ("hard", "all"):
        kw["hard_label_weight"] = 0.5
    opts = JSDOptions(**kw)
    zs, zt, target = _logits(n, v, seed=splits * 10 + per_split)
    plan = JSDStatsPlan(block_n=2, block_v=block_v, num_warps=4, splits=splits, blocks_per_split=per_split)
    if splits > 1:
        plan = JSDStatsPlan(2, block_v, 4, math.ceil(blocks / per_split), per_split)
    ours = _stats(zs, zt, target, opts, plan)
    ref = reference_row_stats(_capped(zs.double(), opts.student_softcap), _capped(zt.double(), opts.teacher_softcap),
                              target, opts)
    rows = [0, 1, 2, 3] + ([4, 5] if opts.hard_label_weight else [])
    for r in rows:
        assert torch.all((ours[r].double() - ref[r]).abs() <= _tol(ref[r])), (r, ours[r], ref[r])


def test_split_and_single_agree_and_repeat():
    """The split launch and the one-program kernel agree to fp32 rounding; each is
    bitwise repeatable."""
    zs, zt, target = _logits(7, 300, seed=3)
    opts = JSDOptions(beta=0.5, hard_label_weight=0.2)
    one = JSDStatsPlan(4, 64, 4, 1, 5)
    split = JSDStatsPlan(4, 64, 4, 3, 2)
    a = _stats(zs, zt, target, opts, one)
    b = _stats(zs, zt, target, opts, split)
    assert torch.equal(b, _stats(zs, zt, target, opts, split))
    assert torch.allclose(a, b, rtol=1e-5, atol=1e-5)


def test_underflowing_split_and_nan_rows():
    """A split whose student logits all underflow adds nothing; a NaN poisons only its row."""
    zs, zt, target = _logits(4, 200, seed=5)
    zs[:, 64:130] = -1e30  # a whole split of the student with p == 0
    zs[2, 150] = float("nan")
    opts = JSDOptions(beta=1.0)  # reverse KL: the student weights the sum, q > 0 where p > 0
    plan = JSDStatsPlan(2, 64, 4, 4, 1)
    ours = _stats(zs, zt, target, opts, plan)
    ref = reference_row_stats(zs.double(), zt.double(), target, opts)
    assert torch.isnan(ours[0, 2]) and torch.isnan(ours[2, 2])
    ok = torch.tensor([0, 1, 3])
    for r in (0, 1, 2):
        assert torch.all((ours[r, ok].double() - ref[r, ok]).abs() <= _tol(ref[r, ok]))


def test_plan_splits_only_when_rows_are_few():
    """Few rows of a long vocabulary split; many rows keep one program per row block."""
    few = jsd_stats_plan(216, 151936, 4, H100)
    many = jsd_stats_plan(16384, 151936, 4, H100)
    jsd_bf16 = jsd_stats_plan(4096, 151936, 2, H100)  # the jsd op on 4096 rows of bf16 logits
    assert few.splits > 1 and few.splits * few.blocks_per_split * few.block_v >= 151936
    assert (few.splits - 1) * few.blocks_per_split * few.block_v < 151936  # no empty split
    assert math.ceil(216 / few.block_n) * few.splits >= 16 * 132 // 2
    assert many.splits == 1 and jsd_bf16.splits == 1


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_jsd_op_split_path_matches_reference(beta):
    """The public jsd on few long rows (forced split via a small device) equals float64.

    The vocabulary spans several column blocks of the device's plan (the interpreter's
    64 columns; CUDA's fp32 4096), so the rows really split on either."""
    from logitless.ops.common.reference import jsd_reference

    v = 8209 if DEVICE.type == "cuda" else 257  # primes: ragged last block
    zs, zt, target = _logits(3, v, seed=11)
    target[1] = -100
    zs, zt = zs.to(DEVICE).requires_grad_(), zt.to(DEVICE)
    with on_device(dataclasses.replace(device.facts(DEVICE), sms=8)):
        assert jsd_stats_plan(3, v, 4, DEVICE).splits > 1
        loss = logitless.jsd(zs, zt, target.to(DEVICE), beta=beta, backend="triton", hard_label_weight=0.3)
    ref = jsd_reference(zs.double(), zt.double(), target.to(DEVICE), beta=beta, hard_label_weight=0.3)
    assert abs(loss.item() - ref.item()) <= 1e-5 * (1 + abs(ref.item()))
