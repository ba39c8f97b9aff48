"""Benchmark shapes of linear_cross_entropy, as data beside the op.

The LM-head shapes of /work/shared/ANCHORS.md (tokens B, hidden H, vocabulary V), in
bf16 as in training. ``python -m logitless_bench`` reads them from here.
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

#: Suite "models" (``python -m logitless_bench --suite models``): the anchors plus real
#: LM heads over the range the planner must cover (tokens 512-32768, V 32000-262144,
#: H 768-8192, odd and prime vocabularies, small batches). (tokens, hidden, vocab)
#: from each model's config.json; token counts are typical micro-batches.
MODEL_SHAPES: tuple[LceShape, ...] = SHAPES + (
    LceShape("llama3.1-8b-512", 512, 4096, 128256),  # small batch
    LceShape("llama3.1-8b-2k", 2048, 4096, 128256),
    LceShape("llama3.1-70b", 4096, 8192, 128256),
    LceShape("llama3.2-1b-32k", 32768, 2048, 128256),
    LceShape("llama3.2-3b", 8192, 3072, 128256),
    LceShape("llama2-7b", 4096, 4096, 32000),
    LceShape("mistral-7b-v0.3", 8192, 4096, 32768),
    LceShape("mistral-nemo-12b", 4096, 5120, 131072),
    LceShape("phi3-mini", 4096, 3072, 32064),
    LceShape("gpt2", 8192, 768, 50257),  # odd V, small H
    LceShape("gpt2-1k", 1024, 768, 50257),
    LceShape("pythia-1.4b", 2048, 2048, 50304),
    LceShape("qwen2.5-0.5b", 8192, 896, 151936),
    LceShape("qwen2.5-7b", 4096, 3584, 152064),
    LceShape("qwen3-tok-151665", 4096, 2048, 151665),  # V = tokenizer length (odd)
    LceShape("gemma2-2b", 4096, 2304, 256000),
    LceShape("gemma3-1b", 8192, 1152, 262144),
    LceShape("gemma3-27b", 2048, 5376, 262144),
    LceShape("olmo2-7b", 4096, 4096, 100352),
    LceShape("prime-100003", 3000, 2000, 100003),  # prime V, tokens/H not powers of two
)
MODEL_SHAPE_NAMES = frozenset(s.name for s in MODEL_SHAPES)

#: The small case run on a machine without a GPU (a smoke run, not the benchmark); fp32,
#: as bf16 matmuls on CPUs are emulated and warm up for dozens of calls.
CPU_SHAPES: tuple[LceShape, ...] = (LceShape("cpu-tiny", 256, 64, 1000, "float32"),)
