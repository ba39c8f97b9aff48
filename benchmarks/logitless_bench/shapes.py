"""Every benchmark shape, as data, and how ``--shapes`` selects them.

- lce / models / precision: ``LceShape`` -- ``SHAPES`` (the anchor LM heads of docs/ANCHORS.md),
  ``EXTRA_SHAPES``, ``MODEL_SHAPES`` (suite models), ``CPU_SHAPES`` (the CPU smoke case);
- ce: ``CeCase`` -- cross-entropy on materialised logits (``CE_CASES``);
- distill: ``DistillShape`` -- ``DISTILL_SHAPES`` / ``CPU_DISTILL_SHAPES``;
- rl: ``RLShape`` -- ``RL_SHAPES`` / ``CPU_RL_SHAPES``;
- topk: ``TopKShape`` -- ``TOPK_SHAPES`` / ``CPU_TOPK_SHAPES``;
- jax / jax-sharded: ``JaxShape`` -- ``JAX_SHAPES`` / ``CPU_JAX_SHAPES``.

Pure data (no torch, no jax): the JAX suites import it without torch.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import NamedTuple

__all__ = [
    "LceShape", "CeCase", "DistillShape", "RLShape", "TopKShape", "JaxShape",
    "lce_shapes", "ce_cases", "default_names", "known_names", "unmatched", "select",
]


def _label(shape) -> str:
    """"name (tokens, hidden, vocab)": the label of a shape with one hidden size."""
    return f"{shape.name} ({shape.tokens}, {shape.hidden}, {shape.vocab})"


# --- lce (suites lce, models, precision) ---

@dataclass(frozen=True)
class LceShape:
    """One benchmark case: x is (tokens, hidden), weight is (vocab, hidden)."""

    name: str
    tokens: int  # B
    hidden: int  # H
    vocab: int  # V
    dtype: str = "bfloat16"  # a torch dtype name

    label = property(_label)


#: The anchor shapes (docs/ANCHORS.md), in the order of its table.
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

#: The cases of a machine without a GPU (not the benchmark); fp32, as bf16 matmuls on CPUs
#: are emulated and warm up for dozens of calls. The first is the default: Llama 3's
#: vocabulary with logits of 501 MiB, ~twice the default budget, so the memory column shows
#: what the library is for (a call takes ~1-3 s on one core); ``cpu-tiny`` (``--shapes
#: cpu-tiny``) checks the harness in a second.
CPU_SHAPES: tuple[LceShape, ...] = (LceShape("cpu-vocab128k", 1024, 128, 128256, "float32"),
                                    LceShape("cpu-tiny", 256, 64, 1000, "float32"))


# --- distill (suite distill): a teacher head into a student head of the same vocabulary, bf16 ---

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


DISTILL_SHAPES: tuple[DistillShape, ...] = (
    DistillShape("llama-8k->4k", 4096, 4096, 8192, 128256),
    DistillShape("qwen-2k->2k", 4096, 2048, 2048, 151936),
    DistillShape("llama-8k->4k-16k", 16384, 4096, 8192, 128256),
)

#: The small case run on a machine without a GPU (a smoke run, not the benchmark).
CPU_DISTILL_SHAPES: tuple[DistillShape, ...] = (DistillShape("cpu-tiny", 128, 32, 48, 1000, "float32"),)


# --- rl (suite rl): RL post-training LM heads, one long sequence per micro-batch, bf16 ---

@dataclass(frozen=True)
class RLShape:
    """x is (tokens, hidden), weight (vocab, hidden); log-probs at ``temperature``."""

    name: str
    tokens: int
    hidden: int
    vocab: int
    dtype: str = "bfloat16"
    temperature: float = 0.7

    label = property(_label)


RL_SHAPES: tuple[RLShape, ...] = (
    RLShape("qwen3-8b-8k", 8192, 4096, 151936),
    RLShape("qwen2.5-7b-16k", 16384, 3584, 152064),
    RLShape("llama3.1-8b-8k", 8192, 4096, 128256),
)

#: A smoke case without a GPU (fp32: CPU bf16 matmuls are emulated).
CPU_RL_SHAPES: tuple[RLShape, ...] = (RLShape("cpu-tiny", 128, 64, 1003, "float32"),)


# --- topk: top-k distillation (issue 64's shapes: 8k tokens, K = 20 and 100) ---

@dataclass(frozen=True)
class TopKShape:
    """x is (tokens, hidden), weight (vocab, hidden); the teacher's top-``k`` per token."""

    name: str
    tokens: int
    hidden: int
    vocab: int
    k: int
    dtype: str = "bfloat16"

    label = property(lambda self: f"{_label(self)} K={self.k}")


TOPK_SHAPES: tuple[TopKShape, ...] = (
    TopKShape("llama3.1-8b-k20", 8192, 4096, 128256, 20),
    TopKShape("llama3.1-8b-k100", 8192, 4096, 128256, 100),
    TopKShape("qwen3-8b-k20", 8192, 4096, 151936, 20),
    TopKShape("qwen3-8b-k100", 8192, 4096, 151936, 100),
)

#: A smoke case without a GPU (fp32: CPU bf16 matmuls are emulated).
CPU_TOPK_SHAPES: tuple[TopKShape, ...] = (TopKShape("cpu-tiny", 128, 64, 1003, 20, "float32"),)


# --- jax (suites jax, jax-sharded): the tokamax write-up's six, bf16 ---

class JaxShape(NamedTuple):
    """x is (tokens, hidden), weight (vocab, hidden)."""

    name: str
    tokens: int
    hidden: int
    vocab: int
    dtype: str = "bfloat16"

    label = property(_label)


#: The first five anchors and the write-up's gemma3-7b.
JAX_SHAPES: tuple[JaxShape, ...] = tuple(JaxShape(s.name, s.tokens, s.hidden, s.vocab)
                                         for s in SHAPES[:5] + EXTRA_SHAPES)

#: Small fp32 cases for a CPU smoke run (a harness check, not the benchmark); the
#: second one has a prime vocabulary.
CPU_JAX_SHAPES: tuple[JaxShape, ...] = (
    JaxShape("cpu-small", 512, 256, 8192, "float32"),
    JaxShape("cpu-prime", 256, 128, 4099, "float32"),
)


# --- ce (suite ce): cross-entropy on (tokens, vocab) logits ---


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

#: The CPU's ce cases, the default first. On one CPU thread cross-entropy is bound by its exp, not
#: by memory (one exp of 128 MiB of fp32 logits took 2.6x their copy, busy 2-core EPYC): no CPU case
#: measures a bandwidth-bound kernel, and the report says so (ce.run). 2048 x 16384 fp32 (128 MiB,
#: 4x a server L3) at least streams from memory like the 64 MiB copy unit, so its ratios compare
#: like with like and its peak-memory column shows the saving. 256 x 1000 (1 MiB) fits in an L2 and
#: a call's fixed cost dominates its time: it stays for quick harness tests, not for ratios.
CPU_CE_CASES: tuple[CeCase, ...] = (CeCase(2048, 16384, "float32"), CeCase(256, 1000, "float32"))


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
    chosen = (CPU_SHAPES[:1] + CPU_CE_CASES[:1]) if cpu else (SHAPES + CE_CASES)
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
