"""Benchmark shapes of linear_log_probs (``python -m logitless_bench --suite rl``): the
RL post-training LM heads of issue 20, at one long sequence per micro-batch, bf16."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RLShape:
    """x is (tokens, hidden), weight (vocab, hidden); log-probs at ``temperature``."""

    name: str
    tokens: int
    hidden: int
    vocab: int
    dtype: str = "bfloat16"
    temperature: float = 0.7

    @property
    def label(self) -> str:
        return f"{self.name} ({self.tokens}, {self.hidden}, {self.vocab})"


SHAPES: tuple[RLShape, ...] = (
    RLShape("qwen3-8b-8k", 8192, 4096, 151936),
    RLShape("qwen2.5-7b-16k", 16384, 3584, 152064),
    RLShape("llama3.1-8b-8k", 8192, 4096, 128256),
)

#: A smoke case without a GPU (fp32: CPU bf16 matmuls are emulated).
CPU_SHAPES: tuple[RLShape, ...] = (RLShape("cpu-tiny", 128, 64, 1003, "float32"),)
