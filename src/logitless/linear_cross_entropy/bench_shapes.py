"""Benchmark shapes of linear_cross_entropy, as data beside the op.

The LM-head shapes of /work/shared/ANCHORS.md (tokens B, hidden H, vocabulary V), in
bf16 as in training. ``python -m logitless.bench`` reads them from here.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LceShape:
    """One benchmark case: x is (tokens, hidden), weight is (vocab, hidden)."""

    name: str
    tokens: int  # B
    hidden: int  # H
    vocab: int  # V
    dtype: str = "bfloat16"  # a torch dtype name

    @property
    def label(self) -> str:
        return f"{self.name} ({self.tokens}, {self.hidden}, {self.vocab})"


#: The anchor shapes (ANCHORS.md), in the order of its table.
SHAPES: tuple[LceShape, ...] = (
    LceShape("llama3.1-8b", 4096, 4096, 128256),
    LceShape("qwen3-8b", 4096, 4096, 151936),
    LceShape("gemma3-4b", 4096, 2560, 262144),
    LceShape("gpt-oss-120b", 4096, 2880, 201088),
    LceShape("deepseek-v3", 8192, 7168, 128256),
    LceShape("llama3.1-8b-16k", 16384, 4096, 128256),
)

#: Shapes of the tokamax write-up that ANCHORS.md lists but does not measure.
EXTRA_SHAPES: tuple[LceShape, ...] = (LceShape("gemma3-7b", 4096, 3840, 262144),)

#: The small case run on a machine without a GPU (a smoke run, not the benchmark); fp32,
#: as bf16 matmuls on CPUs are emulated and warm up for dozens of calls.
CPU_SHAPES: tuple[LceShape, ...] = (LceShape("cpu-tiny", 256, 64, 1000, "float32"),)
