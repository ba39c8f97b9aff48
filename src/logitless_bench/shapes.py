"""The cases of both suites and how ``--shapes`` selects them.

lce shapes live beside the op (``logitless.ops.linear_cross_entropy.bench_shapes``); the
cross-entropy-on-logits cases (issue 4) are defined here.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass

from logitless.ops.linear_cross_entropy.bench_shapes import CPU_SHAPES, EXTRA_SHAPES, MODEL_SHAPES, SHAPES, LceShape

__all__ = ["LceShape", "CeCase", "lce_shapes", "ce_cases", "default_names", "known_names", "unmatched", "select"]


@dataclass(frozen=True)
class CeCase:
    """cross_entropy on (tokens, vocab) logits of one dtype."""

    tokens: int  # N
    vocab: int  # V
    dtype: str  # a torch dtype name

    @property
    def name(self) -> str:
        short = {"bfloat16": "bf16", "float32": "fp32", "float16": "fp16"}.get(self.dtype, self.dtype)
        return f"{self.tokens}x{self.vocab}-{short}"

    @property
    def label(self) -> str:
        return self.name


CE_CASES: tuple[CeCase, ...] = tuple(
    CeCase(n, v, dt)
    for dt in ("bfloat16", "float32")
    for n in (4096, 16384)
    for v in (32000, 128256, 262144)
)

CPU_CE_CASES: tuple[CeCase, ...] = (CeCase(256, 1000, "float32"),)


def lce_shapes(cpu: bool) -> tuple[LceShape, ...]:
    """Every lce shape; ``select`` runs the defaults of the machine unless --shapes names others."""
    return (CPU_SHAPES + SHAPES + EXTRA_SHAPES) if cpu else (SHAPES + EXTRA_SHAPES + CPU_SHAPES)


def model_shapes(cpu: bool) -> tuple[LceShape, ...]:
    """Suite "models": every shape of MODEL_SHAPES (the CPU case first on a CPU)."""
    return (CPU_SHAPES + MODEL_SHAPES) if cpu else MODEL_SHAPES


def ce_cases(cpu: bool) -> tuple[CeCase, ...]:
    return (CPU_CE_CASES + CE_CASES) if cpu else (CE_CASES + CPU_CE_CASES)


def default_names(cpu: bool) -> set:
    """The cases run without --shapes: the anchors on a GPU, the small cases on the CPU."""
    chosen = (CPU_SHAPES + CPU_CE_CASES) if cpu else (SHAPES + CE_CASES)
    return {c.name for c in chosen}


def known_names(cpu: bool) -> list[str]:
    names = [c.name for c in lce_shapes(cpu)]
    names += [c.name for c in MODEL_SHAPES if c.name not in names]
    return names + [c.name for c in ce_cases(cpu)]


def unmatched(patterns, cpu: bool) -> list[str]:
    """The --shapes entries that name no case of either suite."""
    names = known_names(cpu)
    return [p for p in patterns if not fnmatch.filter(names, p)]


def select(cases, patterns, *, cpu: bool, quick: bool = False, every: bool = False):
    """The cases of one suite that ``patterns`` (the --shapes list: names or shell
    patterns such as ``*-fp32``) pick, in the user's order.

    Without patterns: the machine's defaults (``default_names``); with ``quick`` only
    the first; with ``every`` (suite "models" on a GPU) every case. Names of the other
    suite are ignored here (--shapes serves both suites).
    """
    if patterns:
        chosen = []
        for p in patterns:
            chosen += [c for c in cases if fnmatch.fnmatchcase(c.name, p) and c not in chosen]
        return chosen
    defaults = default_names(cpu)
    chosen = [c for c in cases if c.name in defaults or (every and not cpu)]
    return chosen[:1] if quick else chosen
