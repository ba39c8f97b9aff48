"""Public API of the fused linear distillation loss: the function and its module.

The loss equals ``jsd(student_x @ student_weight.T + student_bias, teacher_x @
teacher_weight.T + teacher_bias, target, ...)`` without either head's (tokens x vocab)
logits ever being stored.

torch.compile: the work is two custom ops (``OPS``, over the call ``contract.LjsdCall``
and the bodies of ``custom_op.py``; in eager mode a plain autograd.Function around the
same bodies, bitwise the same); validation and autocast casts are plain Python/torch
around them, so ``fullgraph=True`` works. The reduction is inside the ops (fused with the
loss epilogue on the Triton backend).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
from torch import Tensor

from logitless.distributed import api as _tp
from logitless.ops.common import validate as _validate
from logitless.ops.common.autocast import cast_like_linear
from logitless.ops.common.contract import BackendTable, HelionKind, Lazy, Needs, TritonKind
from logitless.ops.common.module_form import ModuleForm
from logitless.ops.common.validate import resolve_backend
from logitless.options import JSDOptions, VocabParallelOptions

from . import custom_op
from .contract import LjsdBackend, LjsdCall
from .torch_backend import TorchBackend


def _triton() -> LjsdBackend:
    from .triton_backend import TritonBackend
    from .triton_grad_in_forward import forward_with_grad

    return TritonBackend(grad_in_forward=forward_with_grad)


def _helion() -> LjsdBackend:
    from .helion_backend import HelionBackend

    return HelionBackend(BACKENDS)


#: The implementations of linear_jsd, by ``backend=`` name (``contract.LjsdBackend``; "auto"
#: resolves to one of them, ``ops.common.validate.resolve_backend``). Triton's and Helion's
#: are made on first use (their modules need the optional packages).
BACKENDS: BackendTable[LjsdBackend] = BackendTable(triton=Lazy(TritonKind, _triton), torch=TorchBackend,
                                                   helion=Lazy(HelionKind, _helion))
#: The custom-op pair (logitless::linear_jsd_forward / linear_jsd_backward) over the table.
OPS = custom_op.define(BACKENDS)
#: A call on one device (no process_group, vocab_size or partial_dx; plain tensors).
NO_VOCAB_PARALLEL = VocabParallelOptions()


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
    process_group=None,
    vocab_size: Optional[int] = None,
    partial_dx: bool = False,
    teacher_grad: bool = False,
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
            ``F.linear``). The teacher is a constant (see ``teacher_grad``): an
            ordinary teacher head whose weight is an ``nn.Parameter``, or teacher
            hidden states computed with grad enabled, can be passed as they are.
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
        memory_budget: bytes of temporaries (default 256 MiB). Triton (and Helion's
            forward): the forward materialises both heads' fp32 logits for budget /
            (8 V) tokens at a time (then reduced to row statistics, each row split
            over several programs);
            with a budget that holds a token chunk's logits and dz ((8 + itemsize) x
            rows x V bytes) plus an fp32 dW accumulator beyond the dW it becomes
            ((4 - itemsize) V H_s, at least 4 V H_s in all; none for fp32 weights or
            one chunk), the cost model may pick gradient-in-forward
            ("mean"/"sum", eager): the forward also computes the student's gradients
            from those logits (4 GEMMs in all instead of 6), the backward scales them;
            the backward needs an fp32 dx accumulator (4 x tokens x H_s bytes) plus a
            dz chunk of at least 4096 columns (tokens x 4096 x itemsize); when that
            minimum exceeds the budget, the minimum is used.
        backend: "auto" (Triton on CUDA, PyTorch elsewhere), "triton", "torch" or
            "helion" (docs/helion.md; never chosen by "auto").
        process_group: both heads split over the vocabulary across this
            ``torch.distributed`` group (tensor parallelism): student_weight and
            teacher_weight (and biases) are this rank's blocks of the same rows of the
            full weights (in rank order; sizes may differ); x's and target are the
            same on every rank. DTensor heads (``Shard(0)`` weights, ``Replicate()`` or
            token-sharded x's on one 1-D mesh) need no argument. Per call: three
            collectives of O(tokens) floats in the forward (a MAX and a SUM merge the
            log-sum-exps; the mixture's sums need the global ones: a second pass over
            the local columns, 2 more GEMMs of this rank's rows, then a SUM), one
            all-reduce of the student's dx (fp32) in the backward. docs/tensor_parallel.md.
        vocab_size: the real classes of padded weights: rows at or beyond it of the
            full weights are excluded and get zero gradient. None: every row.
        partial_dx: with vocab-parallel heads, return this rank's partial gradient of
            student_x instead of the all-reduced one.
        teacher_grad: False (default): teacher_x, teacher_weight and teacher_bias are
            constants (detached; what every distillation trainer does), whether they
            require grad or not. True: ask for the teacher's gradients, which this op
            does not compute: a teacher tensor that requires grad (with grad enabled)
            then raises ``NotImplementedError`` instead of getting no gradient.

    Returns the loss (fp32 scalar, or per token for "none"; fp64 for fp64 inputs).
    Gradients reach student_x, student_weight and student_bias, never the teacher.

    Errors: wrong ranks, shapes, dtypes or devices, mismatched vocabularies, options
    out of range, and hard labels without a target raise ``ValueError``/``TypeError``;
    a teacher tensor that requires grad with ``teacher_grad=True`` raises
    ``NotImplementedError``. With hard labels, a target outside [0, V) that is not
    ignore_index raises on the CPU and makes that token's loss NaN on a GPU. NaN
    inputs give NaN. Empty inputs: "mean" NaN with zero gradients, "sum" 0.
    """
    opts = JSDOptions.checked(
        beta=beta, temperature=temperature, ignore_index=ignore_index, reduction=reduction,
        student_softcap=student_softcap, teacher_softcap=teacher_softcap,
        hard_label_weight=hard_label_weight)
    if process_group is None and vocab_size is None and partial_dx is False and _validate.plain(
            student_x, student_weight, student_bias, teacher_x, teacher_weight, teacher_bias, target):
        tp = NO_VOCAB_PARALLEL  # (the common case: one device, plain tensors)
    else:
        student_x, student_weight, student_bias, tp = _tp.prepare(
            "linear_jsd", ("student_x", "student_weight", "student_bias"), student_x, student_weight, student_bias,
            process_group=process_group, vocab_size=vocab_size, partial_dx=partial_dx)
        teacher_x, teacher_weight, teacher_bias, tp_t = _tp.prepare(
            "linear_jsd", ("teacher_x", "teacher_weight", "teacher_bias"), teacher_x, teacher_weight, teacher_bias,
            process_group=process_group, vocab_size=vocab_size, partial_dx=False)
        if tp_t.tp_group != tp.tp_group:
            raise ValueError("linear_jsd: the student's and the teacher's heads must be split over the same group "
                             "(DTensors on one mesh, or plain tensors with process_group=)")
        target = _tp.plain(target)
    for name, t in (("student_x", student_x), ("student_weight", student_weight),
                    ("teacher_x", teacher_x), ("teacher_weight", teacher_weight)):
        _validate.check_float(name, t)
    for side, x, w in (("student", student_x, student_weight), ("teacher", teacher_x, teacher_weight)):
        if x.dim() < 1:
            raise ValueError(f"{side}_x must have shape (..., H)")
        if w.dim() != 2:
            raise ValueError(f"{side}_weight must be 2-D (V, H), got shape {tuple(w.shape)}")
        if x.shape[-1] != w.shape[1]:
            hint = f"; it looks transposed ((H, V)): pass {side}_weight.T" if w.shape[0] == x.shape[-1] else ""
            raise ValueError(f"{side}_x has hidden size {x.shape[-1]} but {side}_weight is "
                             f"{tuple(w.shape)} (V, H){hint}")
    v = student_weight.shape[0]
    if v == 0 and not tp.parallel:
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
    teacher_x, teacher_weight, teacher_bias = _teacher_constant(teacher_grad, teacher_x=teacher_x,
                                                               teacher_weight=teacher_weight,
                                                               teacher_bias=teacher_bias)
    student_x, student_weight, student_bias, teacher_x, teacher_weight, teacher_bias = cast_like_linear(
        student_x, student_weight, student_bias, teacher_x, teacher_weight, teacher_bias)
    dtypes = {t.dtype for t in (student_x, student_weight, student_bias, teacher_x,
                                teacher_weight, teacher_bias) if t is not None}
    if len(dtypes) > 1:
        raise TypeError(f"student and teacher tensors must share one dtype, got "
                        f"{sorted(str(d) for d in dtypes)} (or run under torch.autocast)")
    if shift and student_x.dim() < 2:
        raise ValueError("shift=True needs x of shape (..., T, H) with a sequence dimension")
    memory_budget = _validate.memory_budget(memory_budget, student_x.device)
    if backend != "auto" and backend not in BACKENDS.entries:  # (the rest: ``resolve_backend``)
        raise ValueError(f"backend must be one of {('auto', *BACKENDS.names())}, got {backend!r}")
    lead = student_x.shape[:-1]
    if target is None:
        if opts.hard_label_weight != 0.0:
            raise ValueError("hard_label_weight > 0 needs a target")
        target = torch.zeros(lead, dtype=torch.int64, device=student_x.device)
        opts = dataclasses.replace(opts, ignore_index=-1)  # no label: no token is ignored
        # (but the shifted-out last one)
    else:
        _validate.check_target(target, lead, "the leading dimensions of student_x")
    if shift:
        pad = target.new_full(target.shape[:-1] + (1,), opts.ignore_index)
        target = torch.cat([target[..., 1:], pad], dim=-1)
    xs = student_x.reshape(-1, student_x.shape[-1])
    xt = teacher_x.reshape(-1, teacher_x.shape[-1])
    xs = xs if xs.stride(-1) == 1 else xs.contiguous()
    xt = xt if xt.stride(-1) == 1 else xt.contiguous()
    flat_target = target.reshape(-1).long()
    # (no tokens on one device: no backend runs)
    impl = resolve_backend(backend, xs.device, xs.dtype, BACKENDS) if xs.shape[0] or tp.parallel else "torch"
    # A backend's gradient work in the forward (``LjsdBackend.grad_in_forward``: the Triton
    # backend's) is allowed for a backward to come ("mean"/"sum"; one device's heads): its
    # kept dz columns ("keep") always, its gradient-in-forward strategy in eager mode only;
    # the op's Config decides whether the forward does either.
    need = Needs(xs.requires_grad, student_weight.requires_grad,
                 student_bias is not None and student_bias.requires_grad)
    keep = (torch.is_grad_enabled() and (need.need_dx or need.need_dw or need.need_db)
            and reduction != "none" and not tp.parallel and BACKENDS[impl].grad_in_forward is not None)
    in_forward = keep and not torch.compiler.is_compiling()
    call = LjsdCall(xs, student_weight, student_bias, xt, teacher_weight, teacher_bias, flat_target, opts,
                    reduction, memory_budget, impl, in_forward, need, tp, keep)
    loss = OPS(call).loss
    if reduction == "none":
        loss = loss.reshape(lead)
        return loss[..., :-1] if shift else loss
    return loss


def _teacher_constant(teacher_grad: bool, **tensors: Optional[Tensor]) -> tuple:
    """The teacher's tensors as constants: detached (teacher_grad=False), or refused
    when one would want a gradient the op does not compute (teacher_grad=True)."""
    if not isinstance(teacher_grad, bool):
        raise TypeError(f"teacher_grad must be a bool, got {teacher_grad!r}")
    if teacher_grad and torch.is_grad_enabled():
        for name, t in tensors.items():
            if t is not None and t.requires_grad:
                raise NotImplementedError(
                    f"linear_jsd(teacher_grad=True): {name} requires grad, but linear_jsd computes "
                    "no gradient for the teacher (only for the student). Leave teacher_grad=False "
                    "(the teacher is then a constant), or compute both heads' logits and a torch loss "
                    "if the teacher must be trained")
    return tuple(t.detach() if t is not None and t.requires_grad else t for t in tensors.values())


class LinearJSDLoss(ModuleForm):
    """Module form of :func:`linear_jsd`: holds the options, takes tensors.

    ``loss_fn = LinearJSDLoss(beta=0.5, temperature=1.0)``;
    ``loss = loss_fn(student_hidden, student.lm_head.weight, teacher_hidden,
    teacher.lm_head.weight, labels)``; the teacher is a constant (``teacher_grad``). Its
    keywords are the function's but the biases, which ``forward`` takes
    (``ops.common.module_form``); see the function for every argument and error.
    """

    function = staticmethod(linear_jsd)
    inputs = ("student_bias", "teacher_bias")

    def check(self, values: dict) -> dict:
        JSDOptions.checked(**{k: values[k] for k in (
            "beta", "temperature", "ignore_index", "reduction", "student_softcap", "teacher_softcap",
            "hard_label_weight")})
        return values

    def forward(self, student_x: Tensor, student_weight: Tensor, teacher_x: Tensor,
                teacher_weight: Tensor, target: Optional[Tensor] = None,
                student_bias: Optional[Tensor] = None, teacher_bias: Optional[Tensor] = None):
        return linear_jsd(student_x, student_weight, teacher_x, teacher_weight, target,
                          student_bias=student_bias, teacher_bias=teacher_bias, **self.kwargs)
