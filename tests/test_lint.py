"""The tree passes ruff with pyproject's rules ([tool.ruff]): imports sorted, no unused names,
lines within 120 columns, no Python-version-specific syntax (target 3.10); and mypy on the
PyTorch ops ([tool.mypy]: each op's backends against its Protocol in contract.py, Optional
handling, the declared calls). The `test` extra pins both, so CI runs these checks with
every other test."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHECKED = ("src", "tests", "tests_jax", "benchmarks", "scripts")


def test_ruff_clean():
    if importlib.util.find_spec("ruff") is None:
        pytest.skip("ruff is not installed: pip install -e '.[test]'")
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", *CHECKED], cwd=ROOT,
                          capture_output=True, text=True)
    assert proc.returncode == 0, f"ruff check {' '.join(CHECKED)}:\n{proc.stdout[-4000:]}{proc.stderr[-1000:]}"


def test_mypy_clean():
    """``mypy`` with pyproject's [tool.mypy] (src/logitless/ops; the modules it imports followed
    for their types only). ~20 s without its cache (.mypy_cache), ~1 s with it."""
    if importlib.util.find_spec("mypy") is None:
        pytest.skip("mypy is not installed: pip install -e '.[test]'")
    proc = subprocess.run([sys.executable, "-m", "mypy", "--config-file", "pyproject.toml"], cwd=ROOT,
                          capture_output=True, text=True)
    assert proc.returncode == 0, f"mypy (pyproject.toml [tool.mypy]):\n{proc.stdout[-6000:]}{proc.stderr[-1000:]}"
