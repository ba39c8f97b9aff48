"""Install hints: backend="triton" without triton installed, and ``logitless.X`` without
torch (simulated in a subprocess: ``sys.modules["torch"] = None`` makes ``import torch``
fail as it does where torch is not installed)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import logitless
from logitless.ops.common import validate as dispatch


def test_triton_backend_without_triton_names_pip_install(monkeypatch):
    monkeypatch.setattr(dispatch, "HAS_TRITON", False)
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the hint of the CPU error, followed
    z = torch.randn(3, 11)
    t = torch.tensor([0, 4, 10])
    with pytest.raises(ModuleNotFoundError, match="pip install triton") as err:
        logitless.cross_entropy(z, t, backend="triton")
    assert err.value.name == "triton"
    x, w = torch.randn(3, 8), torch.randn(11, 8)
    with pytest.raises(ImportError, match="pip install triton"):
        logitless.linear_cross_entropy(x, w, t, backend="triton")
    # "auto" never needs triton
    torch.testing.assert_close(logitless.cross_entropy(z, t), torch.nn.functional.cross_entropy(z, t))


def test_triton_on_cpu_without_interpreter_says_how(monkeypatch):
    from logitless.ops.linear_cross_entropy.api import BACKENDS as LCE

    monkeypatch.setattr(dispatch, "HAS_TRITON", True)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1.*backend='torch'"):
        dispatch.resolve_backend("triton", torch.device("cpu"), torch.float32, LCE)


_NO_TORCH = r"""
import sys
sys.modules["torch"] = None  # `import torch` now fails as when torch is not installed
import logitless
assert logitless.__all__ == []
try:
    logitless.linear_cross_entropy
except ImportError as e:
    assert e.name == "torch", e.name
    print("ATTR", e)
try:
    from logitless import LinearJSDLoss
except ImportError as e:
    print("FROM", e)
try:
    logitless.no_such_name
except AttributeError as e:
    assert not isinstance(e, ImportError)
    print("OTHER", e)
print("HASATTR", hasattr(logitless, "__path__"))
"""


def test_torch_free_import_says_pip_install_torch():
    src = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")
    env = dict(os.environ, PYTHONPATH=src + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", _NO_TORCH], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = dict(line.split(" ", 1) for line in out.stdout.strip().splitlines())
    for key, name in (("ATTR", "linear_cross_entropy"), ("FROM", "LinearJSDLoss")):
        assert f"logitless.{name} needs PyTorch: pip install torch" in lines[key]
        assert "logitless.jax" in lines[key]
    assert "no attribute 'no_such_name'" in lines["OTHER"]
    assert lines["HASATTR"] == "True"
