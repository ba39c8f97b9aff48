"""Checks of the scalar options, shared by the PyTorch and the JAX side (imports neither).

Each returns the normalised value or raises a clear ``ValueError``/``TypeError``.
"""

from __future__ import annotations

from typing import Optional

REDUCTIONS = ("mean", "sum", "none")


def reduction(value: str) -> str:
    if value not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {value!r}")
    return value


def ignore_index(value: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"ignore_index must be an int, got {type(value).__name__}")
    return value


def in_unit_interval(name: str, value: float) -> float:
    value = float(value)
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} must be in [0, 1], got {value}")
    return value


def softcap(name: str, value: Optional[float]) -> Optional[float]:
    if value is None:
        return None
    value = float(value)
    if not value > 0.0 or value == float("inf"):
        raise ValueError(f"{name} must be a positive finite number or None, got {value}")
    return value


def non_negative(name: str, value: float) -> float:
    value = float(value)
    if not value >= 0.0 or value == float("inf"):
        raise ValueError(f"{name} must be a finite number >= 0, got {value}")
    return value
