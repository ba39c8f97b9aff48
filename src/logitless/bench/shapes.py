"""The cases of both suites and how ``--shapes`` selects them.

lce shapes live beside the op (``logitless.linear_cross_entropy.bench_shapes``); the
cross-entropy-on-logits cases (issue 4) are defined here.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..linear_cross_entropy.bench_shapes import CPU_SHAPES, EXTRA_SHAPES, SHAPES, LceShape

__all__ = ["LceShape", "CeCase", "lce_shapes", "ce_cases", "known_names", "select"]


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
    return CPU_SHAPES if cpu else SHAPES + EXTRA_SHAPES


def ce_cases(cpu: bool) -> tuple[CeCase, ...]:
    return CPU_CE_CASES if cpu else CE_CASES


def known_names(cpu: bool) -> list[str]:
    return [c.name for c in lce_shapes(cpu)] + [c.name for c in ce_cases(cpu)]


def select(cases, names, *, quick=False):
    """The cases of one suite that ``names`` (the --shapes list) picks, in the user's order.

    Without names: every case except the extra shapes; with ``quick`` only the first.
    Names of the other suite are ignored here (``--shapes`` serves both suites).
    """
    if names:
        by_name = {c.name: c for c in cases}
        return [by_name[n] for n in names if n in by_name]
    chosen = [c for c in cases if c not in EXTRA_SHAPES]
    return chosen[:1] if quick else chosen
