"""Class indices out of range: the CPU always raises naming the value and its position;
on a GPU ``logitless.options.check_targets_on_gpu()`` opts in to the same error (one
host sync per call) instead of NaN for that token."""

from __future__ import annotations

import pytest
import torch

import logitless
from logitless import options
from tests.conftest import HAS_CUDA


@pytest.fixture
def gpu_check():
    previous = options.check_targets_on_gpu(True)
    yield
    options.check_targets_on_gpu(previous)


def _cases(device):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 12, generator=g).to(device)
    w = torch.randn(17, 12, generator=g).to(device)
    t = torch.randint(0, 17, (2, 3), generator=g)
    t[1, 1] = 17  # flat position 4
    t[0, 0] = -100
    t = t.to(device)
    yield "linear_cross_entropy", lambda: logitless.linear_cross_entropy(x, w, t), "target"
    yield "cross_entropy", lambda: logitless.cross_entropy(x @ w.T, t), "target"
    yield "linear_log_probs", lambda: logitless.linear_log_probs(x, w, t), "tokens"


@pytest.mark.parametrize("i", range(3))
def test_cpu_names_value_and_position(i):
    name, call, what = list(_cases("cpu"))[i]
    with pytest.raises(ValueError, match=rf"{what} contains 17, outside \[0, 17\) .* at position 4 \(flat index\)"):
        call()


def test_switch_validates_and_returns_the_previous_setting():
    assert options.check_targets_on_gpu(True) is False
    assert options.targets_checked_on_gpu() is True
    assert options.check_targets_on_gpu(False) is True
    with pytest.raises(TypeError):
        options.check_targets_on_gpu(1)


@pytest.mark.skipif(not HAS_CUDA, reason="the opt-in check is for GPU tensors (the CPU always checks)")
@pytest.mark.parametrize("i", range(3))
def test_gpu_opt_in_raises_with_the_position(i, gpu_check):
    name, call, what = list(_cases("cuda"))[i]
    with pytest.raises(ValueError, match=rf"{what} contains 17, .* at position 4 \(flat index\)"):
        call()
    options.check_targets_on_gpu(False)
    out = call()  # off: no sync, NaN where the index is bad
    assert torch.isnan(out).any()
