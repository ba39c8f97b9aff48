"""The fused linear ops' default memory budget: 3% of a GPU's total memory (at least
DEFAULT_MEMORY_BUDGET), DEFAULT_MEMORY_BUDGET elsewhere, resolved once per call from the
input's device (``ops.common.validate.default_memory_budget``)."""

from types import SimpleNamespace

import pytest
import torch

import logitless
from logitless.ops.common import validate
from logitless.options import DEFAULT_MEMORY_BUDGET

MiB = 2**20


def test_cpu_default_is_the_constant():
    assert validate.default_memory_budget(torch.device("cpu")) == DEFAULT_MEMORY_BUDGET == 256 * MiB
    assert validate.memory_budget(None, torch.device("cpu")) == DEFAULT_MEMORY_BUDGET
    assert validate.memory_budget(12345, torch.device("cpu")) == 12345
    with pytest.raises(ValueError, match="memory_budget"):
        validate.memory_budget(0, torch.device("cpu"))


@pytest.mark.parametrize("total, expected", [
    (81559 * MiB, 2446 * MiB),        # an H100 80 GB: 3%, whole MiB
    (143771 * MiB, 4313 * MiB),       # an H200
    (4 * 2**30, DEFAULT_MEMORY_BUDGET),  # a small GPU: the floor
])
def test_gpu_default_is_three_percent_of_total_memory(monkeypatch, total, expected):
    asked = []

    def props(index):
        asked.append(index)
        return SimpleNamespace(total_memory=total)

    monkeypatch.setattr(torch.cuda, "get_device_properties", props)
    monkeypatch.setattr(validate, "_TOTAL_MEMORY", {})
    dev = torch.device("cuda", 1)
    assert validate.default_memory_budget(dev) == expected
    assert validate.default_memory_budget(dev) == expected
    assert asked == [1]  # a device property, read once per device


@pytest.mark.parametrize("op", ["linear_cross_entropy", "linear_log_probs", "linear_jsd"])
def test_each_fused_linear_op_takes_the_devices_default(monkeypatch, op):
    """memory_budget=None reaches the op as the device's default; an explicit one as given."""
    seen = []
    real = validate.default_memory_budget

    def recording(device):
        seen.append(device)
        return real(device)

    monkeypatch.setattr(validate, "default_memory_budget", recording)
    g = torch.Generator().manual_seed(0)
    x, w, t = torch.randn(6, 8, generator=g), torch.randn(11, 8, generator=g), torch.randint(0, 11, (6,), generator=g)

    def call(**kw):
        if op == "linear_cross_entropy":
            return logitless.linear_cross_entropy(x, w, t, backend="torch", **kw)
        if op == "linear_log_probs":
            return logitless.linear_log_probs(x, w, t, backend="torch", **kw)
        return logitless.linear_jsd(x, w, x * 0.5, w * 0.5, t, backend="torch", **kw)

    a = call()
    assert seen == [x.device]
    b = call(memory_budget=DEFAULT_MEMORY_BUDGET)
    assert seen == [x.device]  # not asked for an explicit budget
    torch.testing.assert_close(a, b, rtol=0, atol=0)
