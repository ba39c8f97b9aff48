"""The tree passes ruff with pyproject's rules ([tool.ruff]): imports sorted, no unused names,
lines within 120 columns, no Python-version-specific syntax (target 3.10). The `test` extra
pins ruff, so CI runs this check with every other test."""

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
