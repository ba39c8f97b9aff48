"""Public API of the fused linear distillation loss: function, module, torch.library ops.

The loss equals ``jsd(student_x @ student_weight.T + student_bias, teacher_x @
teacher_weight.T + teacher_bias, target, ...)`` without either head's (tokens x vocab)
logits ever being stored.

torch.compile: the work is two ``torch.library.custom_op``s,
``logitless::linear_jsd_forward`` (per-token loss, (6, N) statistics) and
``logitless::linear_jsd_backward`` (gradients of the student's x, weight, bias), with
fake kernels and autograd registered; validation, autocast casts and the reduction are
plain Python/torch around them, so ``fullgraph=True`` works.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn

from logitless.ops.common import validate as _validate
from logitless.ops.common.dispatch import BACKENDS, backend_module
from logitless.formulas.jsd import NUM_STATS, JSDOptions, reduce, token_loss, upstream


def _opts(beta, temperature, ignore_index, student_softcap, teacher_softcap, hard_label_weight):
    return JSDOptions(beta=beta, temperature=temperature, ignore_index=ignore_index,
                      student_softcap=student_softcap, teacher_softcap=teacher_softcap,
                      hard_label_weight=hard_label_weight)


def _loss_dtype(x: Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


@torch.library.custom_op("logitless::linear_jsd_forward", mutates_args=())
def linear_jsd_forward_op(
    student_x: Tensor, student_weight: Tensor, student_bias: Optional[Tensor],
    teacher_x: Tensor, teacher_weight: Tensor, teacher_bias: Optional[Tensor],
    target: Tensor, beta: float, temperature: float, ignore_index: int,
    student_softcap: Optional[float], teacher_softcap: Optional[float],
    hard_label_weight: float, budget: int, backend: str,
) -> tuple[Tensor, Tensor]:
    """(per-token loss (N,), statistics (6, N)) for 2-D x's; fp32 (fp64 for fp64)."""
    opts = _opts(beta, temperature, ignore_index, student_softcap, teacher_softcap, hard_label_weight)
    n, v = student_x.shape[0], student_weight.shape[0]
    dtype = _loss_dtype(student_x)
    if opts.hard_label_weight != 0.0:
        _validate.check_targets_in_range(target, v, ignore_index)  # CPU only: no sync
    if n == 0:
        stats = student_x.new_zeros(NUM_STATS, 0, dtype=dtype)
    else:
        impl = backend_module(__package__, backend, student_x.device, student_x.dtype)
        with torch.autocast(student_x.device.type, enabled=False):
            stats = impl.forward(student_x, student_weight, student_bias, teacher_x, teacher_weight,
                                 teacher_bias, target, opts, budget)
    return token_loss(stats, target, v, opts).to(dtype), stats.to(dtype)


@linear_jsd_forward_op.register_fake
def _(student_x, *args):
    dtype = _loss_dtype(student_x)
    n = student_x.shape[0]
    return student_x.new_empty(n, dtype=dtype), student_x.new_empty(NUM_STATS, n, dtype=dtype)


@torch.library.custom_op("logitless::linear_jsd_backward", mutates_args=())
def linear_jsd_backward_op(
    grad_loss: Tensor, student_x: Tensor, student_weight: Tensor, student_bias: Optional[Tensor],
    teacher_x: Tensor, teacher_weight: Tensor, teacher_bias: Optional[Tensor],
    target: Tensor, stats: Tensor, beta: float, temperature: float, ignore_index: int,
    student_softcap: Optional[float], teacher_softcap: Optional[float],
    hard_label_weight: float, budget: int, backend: str,
    need_dx: bool, need_dw: bool, need_db: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """(dx, dW, db) of the student; an empty tensor for each one not asked for."""
    opts = _opts(beta, temperature, ignore_index, student_softcap, teacher_softcap, hard_label_weight)
    need_db = need_db and student_bias is not None
    none = student_x.new_empty(0)
    if student_x.shape[0] == 0:
        dx, dw = torch.zeros_like(student_x), torch.zeros_like(student_weight)
        db = torch.zeros_like(student_bias) if need_db else none
    else:
        g = upstream(grad_loss, target, ignore_index)
        impl = backend_module(__package__, backend, student_x.device, student_x.dtype)
        with torch.autocast(student_x.device.type, enabled=False):
            dx, dw, db = impl.backward(
                g, student_x, student_weight, student_bias, teacher_x, teacher_weight, teacher_bias,
                target, stats, opts, budget, need_dx, need_dw, need_db)
    return (dx if need_dx else none.clone(), dw if need_dw else none.clone(),
            db if need_db else none.clone())


@linear_jsd_backward_op.register_fake
def _(grad_loss, student_x, student_weight, student_bias, *args):
    need_dx, need_dw, need_db = args[-3:]
    none = student_x.new_empty(0)
    return (torch.empty_like(student_x) if need_dx else none,
            torch.empty_like(student_weight) if need_dw else none.clone(),
            torch.empty_like(student_bias) if need_db and student_bias is not None else none.clone())


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:7], output[1])
    ctx.options = inputs[7:]


def _backward(ctx, grad_loss, _grad_stats):
    xs, ws, bs, xt, wt, bt, target, stats = ctx.saved_tensors
    need_dx, need_dw, need_db = ctx.needs_input_grad[:3]
    dx = dw = db = None
    if need_dx or need_dw or need_db:
        dx, dw, db = linear_jsd_backward_op(
            grad_loss, xs, ws, bs, xt, wt, bt, target, stats, *ctx.options,
            need_dx, need_dw, need_db)
    return (dx if need_dx else None, dw if need_dw else None, db if need_db else None) + (None,) * 12


linear_jsd_forward_op.register_autograd(_backward, setup_context=_setup_context)


def _autocast(*ts: Optional[Tensor]):
    """F.linear's semantics: under autocast, cast x, weight, bias (autograd-tracked)."""
    dev = next(t for t in ts if t is not None).device.type
    if not torch.is_autocast_enabled(dev):
        return ts
    dtype = torch.get_autocast_dtype(dev)
    return tuple(t.to(dtype) if t is not None and t.is_floating_point() else t for t in ts)


def linear_jsd(
    student_x: Tensor,
    student_weight: Tensor,
    teacher_x: Tensor,
    teacher_weight: Tensor,
    target: Optional[Tensor] = None,
    *,
    beta: float = 0.5,
    temperature: float = 1.0,
    ignore_index: int = -100,
    reduction: str = "mean",
    student_bias: Optional[Tensor] = None,
    teacher_bias: Optional[Tensor] = None,
    student_softcap: Optional[float] = None,
    teacher_softcap: Optional[float] = None,
    hard_label_weight: float = 0.0,
    shift: bool = False,
    memory_budget: Optional[int] = None,
    backend: str = "auto",
) -> Tensor:
    """Distillation loss of a student and a teacher LM head, without their logits.

    Equals :func:`logitless.jsd` of ``student_x @ student_weight.T + student_bias`` and
    ``teacher_x @ teacher_weight.T + teacher_bias`` (generalized JSD with mixture
    m = beta * p_teacher + (1 - beta) * p_student; beta = 0 is exactly forward
    KL(teacher || student), beta = 1 reverse KL(student || teacher); temperature
    divides both soft-capped logits; no T**2 factor; plus ``hard_label_weight`` times
    the student's cross-entropy at temperature 1). Statistics are fp32.

    Args:
        student_x: (..., H_s) hidden states, float16/bfloat16/float32 (float64 on
            backend="torch"). student_weight: (V, H_s), as ``nn.Linear.weight``.
        teacher_x: (..., H_t) with the same leading shape; teacher_weight: (V, H_t).
            Hidden sizes may differ; vocabularies must match. All six tensors share
            one dtype and device (under autocast all are cast to its dtype, as
            ``F.linear``). The teacher gets no gradient: a teacher tensor that
            requires grad (with grad enabled) raises; detach it or use no_grad.
        target: optional (...) int64/int32 labels: tokens equal to ``ignore_index``
            count for nothing, and the hard-label term uses them. None: every token
            counts (hard_label_weight must be 0).
        beta: in [0, 1]. temperature: > 0.
        reduction: "mean" (over non-ignored tokens; NaN if none), "sum", or "none"
            (per token in the leading shape, 0 at ignored tokens; what TRL consumes).
        student_bias, teacher_bias: optional (V,) biases.
        student_softcap, teacher_softcap: optional s > 0: z -> s * tanh(z / s).
        hard_label_weight: weight of the student's cross-entropy on target.
        shift: causal-LM shift of the target only: position t uses target[t + 1] (for
            ignore_index and the hard label); the last position counts for nothing
            and, with reduction="none", is dropped (T - 1 positions).
        memory_budget: bytes of temporaries (default 256 MiB). Triton: the forward
            materialises both heads' fp32 logits for budget / (8 V) tokens at a time;
            the backward needs an fp32 dx accumulator (4 x tokens x H_s bytes) plus a
            dz chunk of at least 4096 columns (tokens x 4096 x itemsize); when that
            minimum exceeds the budget, the minimum is used.
        backend: "auto" (Triton on CUDA, PyTorch elsewhere), "triton" or "torch".

    Returns the loss (fp32 scalar, or per token for "none"; fp64 for fp64 inputs).
    Gradients reach student_x, student_weight and student_bias.

    Errors: wrong ranks, shapes, dtypes or devices, mismatched vocabularies, options
    out of range, a teacher that requires grad, and hard labels without a target raise
    ``ValueError``/``TypeError``. With hard labels, a target outside [0, V) that is not
    ignore_index raises on the CPU and makes that token's loss NaN on a GPU. NaN
    inputs give NaN. Empty inputs: "mean" NaN with zero gradients, "sum" 0.
    """
    opts = _validate.check_jsd_options(
        beta=beta, temperature=temperature, ignore_index=ignore_index, reduction=reduction,
        student_softcap=student_softcap, teacher_softcap=teacher_softcap,
        hard_label_weight=hard_label_weight)
    for name, t in (("student_x", student_x), ("student_weight", student_weight),
                    ("teacher_x", teacher_x), ("teacher_weight", teacher_weight)):
        _validate.check_float(name, t)
    for side, x, w in (("student", student_x, student_weight), ("teacher", teacher_x, teacher_weight)):
        if x.dim() < 1:
            raise ValueError(f"{side}_x must have shape (..., H)")
        if w.dim() != 2:
            raise ValueError(f"{side}_weight must be 2-D (V, H), got shape {tuple(w.shape)}")
        if x.shape[-1] != w.shape[1]:
            raise ValueError(f"{side}_x has hidden size {x.shape[-1]} but {side}_weight is "
                             f"{tuple(w.shape)} (V, H)")
    v = student_weight.shape[0]
    if v == 0:
        raise ValueError("student_weight has no rows: the vocabulary is empty")
    if teacher_weight.shape[0] != v:
        raise ValueError(f"vocabularies differ: student_weight has {v} rows, teacher_weight "
                         f"{teacher_weight.shape[0]}; distillation needs one vocabulary")
    if teacher_x.shape[:-1] != student_x.shape[:-1]:
        raise ValueError(f"teacher_x has leading shape {tuple(teacher_x.shape[:-1])} but "
                         f"student_x has {tuple(student_x.shape[:-1])}; tokens must match")
    _validate.check_class_vector("student_bias", student_bias, v)
    _validate.check_class_vector("teacher_bias", teacher_bias, v)
    _validate.check_same_device(student_x=student_x, student_weight=student_weight,
                                teacher_x=teacher_x, teacher_weight=teacher_weight, target=target,
                                student_bias=student_bias, teacher_bias=teacher_bias)
    _validate.check_teacher_frozen(teacher_x=teacher_x, teacher_weight=teacher_weight,
                                   teacher_bias=teacher_bias)
    student_x, student_weight, student_bias, teacher_x, teacher_weight, teacher_bias = _autocast(
        student_x, student_weight, student_bias, teacher_x, teacher_weight, teacher_bias)
    dtypes = {t.dtype for t in (student_x, student_weight, student_bias, teacher_x,
                                teacher_weight, teacher_bias) if t is not None}
    if len(dtypes) > 1:
        raise TypeError(f"student and teacher tensors must share one dtype, got "
                        f"{sorted(str(d) for d in dtypes)} (or run under torch.autocast)")
    if shift and student_x.dim() < 2:
        raise ValueError("shift=True needs x of shape (..., T, H) with a sequence dimension")
    memory_budget = _validate.check_memory_budget(memory_budget)
    if backend not in BACKENDS:  # the rest is checked inside the op (no import under compile)
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    lead = student_x.shape[:-1]
    if target is None:
        if opts.hard_label_weight != 0.0:
            raise ValueError("hard_label_weight > 0 needs a target")
        target = torch.zeros(lead, dtype=torch.int64, device=student_x.device)
        ignore_index = -1  # no label: no token is ignored (but the shifted-out last one)
    else:
        _validate.check_target(target, lead, "the leading dimensions of student_x")
    if shift:
        pad = target.new_full(target.shape[:-1] + (1,), ignore_index)
        target = torch.cat([target[..., 1:], pad], dim=-1)
    xs = student_x.reshape(-1, student_x.shape[-1])
    xt = teacher_x.reshape(-1, teacher_x.shape[-1])
    xs = xs if xs.stride(-1) == 1 else xs.contiguous()
    xt = xt if xt.stride(-1) == 1 else xt.contiguous()
    flat_target = target.reshape(-1).long()
    loss_tok, _ = linear_jsd_forward_op(
        xs, student_weight, student_bias, xt, teacher_weight, teacher_bias, flat_target,
        opts.beta, opts.temperature, ignore_index, opts.student_softcap, opts.teacher_softcap,
        opts.hard_label_weight, memory_budget, backend)
    loss = reduce(loss_tok, flat_target, reduction, ignore_index)
    if reduction == "none":
        loss = loss.reshape(lead)
        return loss[..., :-1] if shift else loss
    return loss


class LinearJSDLoss(nn.Module):
    """Module form of :func:`linear_jsd`: holds the options, takes tensors.

    ``loss_fn = LinearJSDLoss(beta=0.5, temperature=1.0)``;
    ``loss = loss_fn(student_hidden, student.lm_head.weight, teacher_hidden,
    teacher.lm_head.weight, labels)``. See the function for every argument and error.
    """

    def __init__(self, *, beta: float = 0.5, temperature: float = 1.0, ignore_index: int = -100,
                 reduction: str = "mean", student_softcap: Optional[float] = None,
                 teacher_softcap: Optional[float] = None, hard_label_weight: float = 0.0,
                 shift: bool = False, memory_budget: Optional[int] = None, backend: str = "auto"):
        super().__init__()
        _validate.check_jsd_options(
            beta=beta, temperature=temperature, ignore_index=ignore_index, reduction=reduction,
            student_softcap=student_softcap, teacher_softcap=teacher_softcap,
            hard_label_weight=hard_label_weight)
        self.kwargs = dict(
            beta=beta, temperature=temperature, ignore_index=ignore_index, reduction=reduction,
            student_softcap=student_softcap, teacher_softcap=teacher_softcap,
            hard_label_weight=hard_label_weight, shift=shift, memory_budget=memory_budget,
            backend=backend)

    def forward(self, student_x: Tensor, student_weight: Tensor, teacher_x: Tensor,
                teacher_weight: Tensor, target: Optional[Tensor] = None,
                student_bias: Optional[Tensor] = None, teacher_bias: Optional[Tensor] = None):
        return linear_jsd(student_x, student_weight, teacher_x, teacher_weight, target,
                          student_bias=student_bias, teacher_bias=teacher_bias, **self.kwargs)

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v!r}" for k, v in self.kwargs.items())
