"""The PyTorch side never imports jax (the JAX side lives in logitless.jax)."""

import subprocess
import sys


def test_import_logitless_does_not_import_jax():
    code = ("import sys, logitless, logitless_bench\n"
            "assert 'jax' not in sys.modules, 'logitless imported jax'\n"
            "print(logitless.__all__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "linear_cross_entropy" in out.stdout
