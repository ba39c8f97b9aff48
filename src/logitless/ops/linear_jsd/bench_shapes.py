"""Benchmark shapes of linear_jsd (``python -m logitless_bench --suite distill``).

Distillation pairs from real use: a wide teacher head into a student head of the same
vocabulary (Llama 3 70B-class hidden 8192 -> 8B-class 4096, V = 128256) at 4096 and
16384 tokens (last: the most expensive), and a same-size pair (Qwen-class hidden 2048, V = 151936). bf16, as in
training.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DistillShape:
    """student_x (tokens, hidden_s), student_weight (vocab, hidden_s), and the teacher's
    (tokens, hidden_t), (vocab, hidden_t)."""

    name: str
    tokens: int
    hidden_s: int
    hidden_t: int
    vocab: int
    dtype: str = "bfloat16"

    @property
    def label(self) -> str:
        return f"{self.name} ({self.tokens}, {self.hidden_s}<-{self.hidden_t}, {self.vocab})"


SHAPES: tuple[DistillShape, ...] = (
    DistillShape("llama-8k->4k", 4096, 4096, 8192, 128256),
    DistillShape("qwen-2k->2k", 4096, 2048, 2048, 151936),
    DistillShape("llama-8k->4k-16k", 16384, 4096, 8192, 128256),
)

#: The small case run on a machine without a GPU (a smoke run, not the benchmark).
CPU_SHAPES: tuple[DistillShape, ...] = (DistillShape("cpu-tiny", 128, 32, 48, 1000, "float32"),)
