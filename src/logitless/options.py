"""The options of every op: checked once, held in frozen (hashable) dataclasses.

Framework-free (imports neither torch nor jax): the PyTorch ops, the JAX ops and the
integrations build their options here. The dataclasses are hashable, so they serve as
JAX static arguments as they are; a torch custom op takes ``opts.args()`` (plain
ints/floats/strings, in field order) and rebuilds them with ``Class(*args)``.

Each ``check_*``/``*.checked`` raises a clear ``ValueError``/``TypeError`` for a value
out of range and returns the normalised value or dataclass.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Optional

REDUCTIONS = ("mean", "sum", "none")

#: Default bytes of temporary memory an op may use beyond its inputs, outputs and
#: gradients. Large enough for full-speed chunks at LLM shapes, small next to the
#: 2-4 GB that materialised fp32 logits would take.
DEFAULT_MEMORY_BUDGET = 256 * 2**20

#: The fused linear ops' default budget on a GPU (``memory_budget=None``, torch and JAX):
#: this share of the device's total memory (never of its free memory: the plan, and so every
#: bit of the result, is the same in every run), at least ``DEFAULT_MEMORY_BUDGET``; an H100
#: (80 GB) gets 2.4 GiB, where every anchor shape keeps its logits' columns (docs/design.md
#: "Kept columns and the memory budget"). Other devices get ``DEFAULT_MEMORY_BUDGET``.
GPU_BUDGET_SHARE = 0.03


def budget_of_total_memory(total_bytes: int) -> int:
    """The default budget of a GPU with ``total_bytes`` of memory: ``GPU_BUDGET_SHARE`` of
    it in whole MiB, at least ``DEFAULT_MEMORY_BUDGET``."""
    return max(DEFAULT_MEMORY_BUDGET, int(total_bytes * GPU_BUDGET_SHARE) >> 20 << 20)


def check_reduction(value: str) -> str:
    if value not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {value!r}")
    return value


def check_ignore_index(value: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"ignore_index must be an int, got {type(value).__name__}")
    return value


def check_in_unit_interval(name: str, value: float) -> float:
    value = float(value)
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} must be in [0, 1], got {value}")
    return value


def check_softcap(name: str, value: Optional[float]) -> Optional[float]:
    if value is None:
        return None
    value = float(value)
    if not value > 0.0 or value == float("inf"):
        raise ValueError(f"{name} must be a positive finite number or None, got {value}")
    return value


def check_non_negative(name: str, value: float) -> float:
    value = float(value)
    if not value >= 0.0 or value == float("inf"):
        raise ValueError(f"{name} must be a finite number >= 0, got {value}")
    return value


def check_positive(name: str, value: float) -> float:
    value = float(value)
    if not value > 0.0 or value == float("inf"):
        raise ValueError(f"{name} must be a positive finite number, got {value}")
    return value


def check_memory_budget(value: Optional[int]) -> int:
    """Bytes of temporaries: the default for None, else a positive int."""
    if value is None:
        return DEFAULT_MEMORY_BUDGET
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"memory_budget must be a positive int of bytes, got {value!r}")
    return value


#: Per options class, its field names in order (``_field_names``: computed once per class).
_FIELD_NAMES: dict = {}


def _field_names(cls, instance=None) -> tuple:
    """``cls``'s field names, remembered. (From the instance when there is one: under
    torch.compile, dynamo traces ``dataclasses.fields`` of instances, not of classes. The
    library's classes are filled in at import, below.)"""
    names = _FIELD_NAMES[cls] = tuple(f.name for f in dataclasses.fields(cls if instance is None else instance))
    return names


class _Args:
    """``args()``: the fields in order, as a torch custom op takes them.

    It runs on the eager hot path (once or twice per call), so the field
    names are looked up once per class (``_field_names``), not with ``dataclasses.fields``
    and a generator per call (nor ``dataclasses.astuple``: it deep-copies each value).
    Plain list comprehensions (not ``operator`` getters): the public functions call
    ``args()`` under torch.compile too, which traces them."""

    def args(self) -> tuple:
        """The fields' values in order."""
        names = _FIELD_NAMES.get(type(self)) or _field_names(type(self), self)
        return tuple([getattr(self, name) for name in names])


@dataclass(frozen=True)
class CrossEntropyOptions(_Args):
    """The options that change the cross-entropy math (not the implementation)."""

    ignore_index: int = -100
    reduction: str = "mean"
    label_smoothing: float = 0.0
    softcap: Optional[float] = None
    z_loss: float = 0.0

    @property
    def needs_smooth_sum(self) -> bool:
        return self.label_smoothing > 0.0

    @classmethod
    def checked(cls, *, ignore_index: int = -100, reduction: str = "mean", label_smoothing: float = 0.0,
                softcap: Optional[float] = None, z_loss: float = 0.0) -> CrossEntropyOptions:
        return cls(
            ignore_index=check_ignore_index(ignore_index),
            reduction=check_reduction(reduction),
            label_smoothing=check_in_unit_interval("label_smoothing", label_smoothing),
            softcap=check_softcap("softcap", softcap),
            z_loss=check_non_negative("z_loss", z_loss),
        )


@dataclass(frozen=True)
class JSDOptions(_Args):
    """The options that change the distillation math (``formulas.jsd``)."""

    beta: float = 0.5
    temperature: float = 1.0
    ignore_index: int = -100
    student_softcap: Optional[float] = None
    teacher_softcap: Optional[float] = None
    hard_label_weight: float = 0.0

    @property
    def weights(self) -> tuple[float, float, float]:
        """(wq, wp, c0) of ``formulas.jsd``."""
        if self.beta == 0.0:
            return 1.0, 0.0, 1.0
        if self.beta == 1.0:
            return 0.0, 1.0, 0.0
        return self.beta, 1.0 - self.beta, 0.0

    @property
    def needs_lse1(self) -> bool:
        """The hard-label CE term needs lse(zs) (temperature 1) and zs[target]."""
        return self.hard_label_weight != 0.0

    @classmethod
    def checked(cls, *, beta: float = 0.5, temperature: float = 1.0, ignore_index: int = -100,
                reduction: str = "mean", student_softcap: Optional[float] = None,
                teacher_softcap: Optional[float] = None, hard_label_weight: float = 0.0) -> JSDOptions:
        """Checks every option (``reduction`` too, which the ops apply outside the math)."""
        check_reduction(reduction)
        return cls(
            beta=check_in_unit_interval("beta", beta),
            temperature=check_positive("temperature", temperature),
            ignore_index=check_ignore_index(ignore_index),
            student_softcap=check_softcap("student_softcap", student_softcap),
            teacher_softcap=check_softcap("teacher_softcap", teacher_softcap),
            hard_label_weight=check_non_negative("hard_label_weight", hard_label_weight),
        )


def check_bool(name: str, value: bool) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return value


def check_vocab_size(value: Optional[int]) -> int:
    """The number of real classes of a padded vocabulary: -1 for None (every row of the
    full weight is a class), else a positive int."""
    if value is None:
        return -1
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"vocab_size must be a positive int (the real classes of a padded vocabulary) or None, "
                         f"got {value!r}")
    return value


@dataclass(frozen=True)
class LogProbOptions(_Args):
    """The options that change the token log-prob math (``formulas.log_probs``):
    a = softcap(z) / temperature, log p(token) = a_token - logsumexp(a), and with
    ``entropy`` the entropy of softmax(a)."""

    temperature: float = 1.0
    entropy: bool = False
    softcap: Optional[float] = None
    ignore_index: int = -100

    @classmethod
    def checked(cls, *, temperature: float = 1.0, entropy: bool = False, softcap: Optional[float] = None,
                ignore_index: int = -100) -> LogProbOptions:
        if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
            raise TypeError(f"temperature must be a float, got {type(temperature).__name__}")
        return cls(
            temperature=check_positive("temperature", temperature),
            entropy=check_bool("entropy", entropy),
            softcap=check_softcap("softcap", softcap),
            ignore_index=check_ignore_index(ignore_index),
        )


#: ``linear_topk_kl``'s directions and tails (``formulas.topk_kl``).
TOPK_DIRECTIONS = ("forward", "reverse")
TOPK_TAILS = ("bucket", "renormalize", "none")


@dataclass(frozen=True)
class TopKKLOptions(_Args):
    """The options that change the top-k distillation math (``formulas.topk_kl``):
    the direction (forward KL(p || q) or reverse KL(q || p)), what happens to the mass
    outside the teacher's top-k (``tail``), the student's temperature and soft-cap, the
    hard-label cross-entropy's weight, ignored targets and the reduction."""

    direction: str = "forward"
    tail: str = "bucket"
    temperature: float = 1.0
    ignore_index: int = -100
    reduction: str = "mean"
    hard_label_weight: float = 0.0
    softcap: Optional[float] = None

    @property
    def hard(self) -> bool:
        """The hard-label cross-entropy term is on."""
        return self.hard_label_weight != 0.0

    @property
    def hard_at_other_temperature(self) -> bool:
        """The hard-label term needs the log-sum-exp at temperature 1 besides the one at T."""
        return self.hard and self.temperature != 1.0

    @classmethod
    def checked(cls, *, direction: str = "forward", tail: str = "bucket", temperature: float = 1.0,
                ignore_index: int = -100, reduction: str = "mean", hard_label_weight: float = 0.0,
                softcap: Optional[float] = None) -> TopKKLOptions:
        if direction not in TOPK_DIRECTIONS:
            raise ValueError(f"direction must be one of {TOPK_DIRECTIONS}, got {direction!r}")
        if tail not in TOPK_TAILS:
            raise ValueError(f"tail must be one of {TOPK_TAILS}, got {tail!r}")
        if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
            raise TypeError(f"temperature must be a float, got {type(temperature).__name__}")
        return cls(
            direction=direction,
            tail=tail,
            temperature=check_positive("temperature", temperature),
            ignore_index=check_ignore_index(ignore_index),
            reduction=check_reduction(reduction),
            hard_label_weight=check_non_negative("hard_label_weight", hard_label_weight),
            softcap=check_softcap("softcap", softcap),
        )


@dataclass(frozen=True)
class VocabParallelOptions(_Args):
    """How an op's LM head is split over the vocabulary (``logitless.distributed``).

    tp_group: the c10d name of the process group whose ranks hold the blocks of rows of
        the full weight, in rank order ("" : not vocab-parallel, the single-GPU op);
    vocab_size: the real classes of the full vocabulary, rows at or beyond it are
        padding (-1: every row is a class);
    partial_dx: return this rank's partial gradient of x instead of the all-reduced one.
    """

    tp_group: str = ""
    vocab_size: int = -1
    partial_dx: bool = False

    @property
    def parallel(self) -> bool:
        return self.tp_group != ""


for _cls in (CrossEntropyOptions, JSDOptions, LogProbOptions, TopKKLOptions, VocabParallelOptions):
    _field_names(_cls)
del _cls


#: The PyTorch ops' target check on a GPU (``check_targets_on_gpu``); the environment
#: variable LOGITLESS_CHECK_TARGETS=1 turns it on at import.
_CHECK_TARGETS_ON_GPU = [os.environ.get("LOGITLESS_CHECK_TARGETS", "0") not in ("", "0")]


def check_targets_on_gpu(enabled: bool = True) -> bool:
    """Opt in (``enabled=True``) or out of checking the PyTorch ops' class indices
    (targets, tokens, labels) on a GPU: a value outside [0, V) that is not
    ``ignore_index`` then raises ``ValueError`` naming the value and its flat position,
    as the CPU always does, instead of giving that token a NaN loss. The check is one
    reduction and one host sync per call (off by default: the hot path never syncs);
    for debugging a data pipeline, not for CUDA-graph capture. Returns the previous
    setting. Also on at import with the environment variable LOGITLESS_CHECK_TARGETS=1."""
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled must be True or False, got {enabled!r}")
    previous = _CHECK_TARGETS_ON_GPU[0]
    _CHECK_TARGETS_ON_GPU[0] = enabled
    return previous


def targets_checked_on_gpu() -> bool:
    """Whether ``check_targets_on_gpu`` is on."""
    return _CHECK_TARGETS_ON_GPU[0]
