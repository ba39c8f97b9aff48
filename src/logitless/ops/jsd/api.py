"""Public API of jsd on logits the caller holds: the function and its module.

A bandwidth-bound distillation loss on (..., V) student and teacher logits: the forward
reads both twice (log-sum-exps, then the divergence sums) and keeps O(tokens)
statistics; the backward reads both once more and writes the student's gradient once.

torch.compile: the work is two custom ops (``OPS``: ``custom_op.py``'s bodies of the calls
declared in ``contract.py``) that run the backends of ``BACKENDS`` (``contract.JsdBackend``);
validation and the reduction are plain Python/torch around them, so ``fullgraph=True`` works.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
from torch import Tensor

from logitless.formulas.jsd import reduce
from logitless.ops.common import validate as _validate
from logitless.ops.common.contract import BackendTable, Lazy, TritonKind
from logitless.ops.common.module_form import ModuleForm
from logitless.ops.common.validate import resolve_backend
from logitless.options import JSDOptions, check_memory_budget

from . import custom_op
from .contract import JsdBackend, JsdCall
from .torch_backend import TorchBackend


def _triton() -> JsdBackend:
    from .triton_backend import TritonBackend

    return TritonBackend()


#: The implementations of jsd, by ``backend=`` name (``contract.JsdBackend``; "auto" resolves
#: to one of them, ``ops.common.validate.resolve_backend``). Triton's is made on first use
#: (its module needs the optional package).
BACKENDS: BackendTable[JsdBackend] = BackendTable(triton=Lazy(TritonKind, _triton), torch=TorchBackend)
#: The custom-op pair (logitless::jsd_forward / jsd_backward) over the table.
OPS = custom_op.define(BACKENDS)


def jsd(
    student_logits: Tensor,
    teacher_logits: Tensor,
    target: Optional[Tensor] = None,
    *,
    beta: float = 0.5,
    temperature: float = 1.0,
    ignore_index: int = -100,
    reduction: str = "mean",
    student_softcap: Optional[float] = None,
    teacher_softcap: Optional[float] = None,
    hard_label_weight: float = 0.0,
    memory_budget: Optional[int] = None,
    backend: str = "auto",
) -> Tensor:
    """Generalized Jensen-Shannon distillation loss between student and teacher logits.

    Per token, with p = softmax(softcap(student) / T), q = softmax(softcap(teacher) / T),
    m = beta * q + (1 - beta) * p:  beta * KL(q || m) + (1 - beta) * KL(p || m); exactly
    KL(q || p) for beta = 0 (forward KL) and KL(p || q) for beta = 1 (reverse KL); no
    T**2 factor; plus ``hard_label_weight * cross_entropy(softcap(student), target)``
    (temperature 1). The convention of TRL's ``generalized_jsd_loss`` and liger's JSD.
    Statistics and sums are fp32 (fp64 for fp64 inputs); derivation in ``formulas.jsd``.

    Args:
        student_logits: (..., V) float16/bfloat16/float32 (float64 on backend="torch").
        teacher_logits: (..., V), same shape and device; any float dtype. Receives no
            gradient: a teacher tensor that requires grad (with grad enabled) raises.
        target: optional (...) int64/int32 labels, the leading shape of the logits:
            tokens equal to ``ignore_index`` contribute no loss and no gradient, and the
            hard-label term uses them. None: every token counts (hard_label_weight must
            then be 0).
        beta: in [0, 1]. temperature: > 0, divides both logits.
        reduction: "mean" (over non-ignored tokens; NaN if none), "sum" or "none"
            (per token in target's shape, 0 at ignored tokens).
        student_softcap, teacher_softcap: optional s > 0, logits -> s * tanh(z / s),
            applied before the temperature.
        hard_label_weight: weight of the student's cross-entropy against target.
        memory_budget: bytes of temporaries (default 256 MiB) for the PyTorch backend's
            row chunks; the Triton kernels need none beyond O(tokens).
        backend: "auto" (Triton on CUDA, PyTorch elsewhere), "triton" or "torch".

    Returns the loss: fp32 scalar, or per token for "none" (fp64 for fp64 inputs).
    The gradient reaches ``student_logits`` only.

    Errors: wrong shapes, dtypes or devices, options out of range, a teacher that
    requires grad and hard labels without target raise ``ValueError``/``TypeError``.
    With hard labels, a target outside [0, V) that is not ignore_index raises on the
    CPU and gives that token a NaN loss on a GPU (no host sync). NaN inputs give NaN.
    """
    opts = JSDOptions.checked(
        beta=beta, temperature=temperature, ignore_index=ignore_index, reduction=reduction,
        student_softcap=student_softcap, teacher_softcap=teacher_softcap,
        hard_label_weight=hard_label_weight)
    _validate.check_float("student_logits", student_logits)
    _validate.check_float("teacher_logits", teacher_logits)
    if student_logits.dim() < 1 or student_logits.shape[-1] == 0:
        raise ValueError("student_logits must have shape (..., V) with V >= 1")
    if teacher_logits.shape != student_logits.shape:
        raise ValueError(
            f"teacher_logits has shape {tuple(teacher_logits.shape)} but student_logits has "
            f"{tuple(student_logits.shape)}; vocabularies (and token counts) must match")
    _validate.check_same_device(student_logits=student_logits, teacher_logits=teacher_logits, target=target)
    _validate.check_teacher_frozen(teacher_logits=teacher_logits)
    memory_budget = check_memory_budget(memory_budget)
    v = student_logits.shape[-1]
    lead = student_logits.shape[:-1]
    if target is None:
        if opts.hard_label_weight != 0.0:
            raise ValueError("hard_label_weight > 0 needs a target")
        # No label: no token is ignored (targets 0, an ignore_index that never matches).
        target = torch.zeros(lead, dtype=torch.int64, device=student_logits.device)
        opts = dataclasses.replace(opts, ignore_index=-1)
    else:
        _validate.check_target(target, lead, "the leading dimensions of the logits")
    impl = resolve_backend(backend, student_logits.device, student_logits.dtype, BACKENDS)
    zs = student_logits.reshape(-1, v)
    zt = teacher_logits.reshape(-1, v)
    flat_target = target.reshape(-1).long()
    loss_tok = OPS(JsdCall(zs, zt, flat_target, opts, memory_budget, impl)).loss
    loss = reduce(loss_tok, flat_target, reduction, opts.ignore_index)
    return loss.reshape(lead) if reduction == "none" else loss


class JSDLoss(ModuleForm):
    """Module form of :func:`jsd`: holds the options; ``loss_fn(student_logits,
    teacher_logits, target=None)``. Its keywords are the function's
    (``ops.common.module_form``); see the function for semantics and errors."""

    function = staticmethod(jsd)

    def check(self, values: dict) -> dict:
        JSDOptions.checked(**{k: values[k] for k in (
            "beta", "temperature", "ignore_index", "reduction", "student_softcap", "teacher_softcap",
            "hard_label_weight")})
        return values

    def forward(self, student_logits: Tensor, teacher_logits: Tensor, target: Optional[Tensor] = None):
        return jsd(student_logits, teacher_logits, target, **self.kwargs)
