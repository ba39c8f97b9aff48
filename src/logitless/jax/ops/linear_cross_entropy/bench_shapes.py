"""Benchmark shapes of the JAX linear cross-entropy (the tokamax write-up's six), as data.

``python -m logitless_bench --suite jax`` reads them from here. bf16, as in training.
"""

from __future__ import annotations

from typing import NamedTuple


class JaxShape(NamedTuple):
    """x is (tokens, hidden), weight (vocab, hidden)."""

    name: str
    tokens: int
    hidden: int
    vocab: int
    dtype: str = "bfloat16"

    @property
    def label(self) -> str:
        return f"{self.name} ({self.tokens}, {self.hidden}, {self.vocab})"


SHAPES: tuple[JaxShape, ...] = (
    JaxShape("llama3.1-8b", 4096, 4096, 128256),
    JaxShape("qwen3-8b", 4096, 4096, 151936),
    JaxShape("gemma3-4b", 4096, 2560, 262144),
    JaxShape("gpt-oss-120b", 4096, 2880, 201088),
    JaxShape("deepseek-v3", 8192, 7168, 128256),
    JaxShape("gemma3-7b", 4096, 3840, 262144),
)

#: Small fp32 cases for a CPU smoke run (a harness check, not the benchmark); the
#: second one has a prime vocabulary.
CPU_SHAPES: tuple[JaxShape, ...] = (
    JaxShape("cpu-small", 512, 256, 8192, "float32"),
    JaxShape("cpu-prime", 256, 128, 4099, "float32"),
)
