"""Public API of top-k distillation without the student's logits: the function, its module,
the table of its backends (``BACKENDS``)."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from logitless.distributed import api as _tp
from logitless.ops.common import validate as _validate
from logitless.ops.common.autocast import cast_like_linear
from logitless.ops.common.contract import BackendTable, Lazy, Needs, TritonKind
from logitless.ops.common.module_form import ModuleForm
from logitless.ops.common.validate import resolve_backend
from logitless.options import TopKKLOptions, VocabParallelOptions

from . import custom_op
from .contract import TopKBackend, TopKCall
from .torch_backend import TorchBackend


def _triton() -> TopKBackend:
    from .triton_backend import TritonBackend

    return TritonBackend()


#: The implementations of linear_topk_kl, by ``backend=`` name (``contract.TopKBackend``;
#: "auto" resolves to one of them, ``ops.common.validate.resolve_backend``). Triton's is
#: made on first use (its module needs the optional package).
BACKENDS: BackendTable[TopKBackend] = BackendTable(triton=Lazy(TritonKind, _triton), torch=TorchBackend)
#: The custom-op pair (logitless::topk_kl_forward / topk_kl_backward) over the table.
OPS = custom_op.define(BACKENDS)
NO_VOCAB_PARALLEL = VocabParallelOptions()


def linear_topk_kl(
    hidden: Tensor,
    weight: Tensor,
    teacher_ids: Tensor,
    teacher_log_probs: Tensor,
    target: Optional[Tensor] = None,
    *,
    direction: str = "forward",
    tail: str = "bucket",
    temperature: float = 1.0,
    ignore_index: int = -100,
    reduction: str = "mean",
    hard_label_weight: float = 0.0,
    bias: Optional[Tensor] = None,
    softcap: Optional[float] = None,
    shift: bool = False,
    memory_budget: Optional[int] = None,
    backend: str = "auto",
    process_group=None,
) -> Tensor:
    """KL divergence between a teacher's top-k log-probabilities and the student's
    distribution, from the student's hidden states and LM-head weight, without its logits.

    The student: log q = log_softmax(softcap(hidden @ weight.T + bias) / temperature) over
    the full vocabulary (never materialised). The teacher: per token K distinct ids and their
    log-probabilities lp under the teacher's full distribution (vLLM's ``prompt_logprobs=k``,
    an offline pass's saved top-k). With p_i = exp(lp_i), q_i the student's probability of
    id i, P = sum p_i, Q = sum q_i, the per-token loss is

        tail="none"         forward  sum p_i (lp_i - log q_i)     (verl's truncated form)
                            reverse  sum q_i (log q_i - lp_i)
        tail="renormalize"  the same over p_i / P and q_i / Q
        tail="bucket"       the same over K + 1 bins, the last one (1 - P, 1 - Q)

    (0 log 0 = 0), plus ``hard_label_weight`` times the student's cross-entropy at
    temperature 1 on ``target``. log(1 - Q) comes from the log-sum-exp of the student's
    logits outside the ids, computed in the same pass, never from 1 - Q: a top-k that holds
    nearly all of the student's mass stays exact. The math and its gradient:
    ``logitless.formulas.topk_kl``.

    Cost (Triton, CUDA): the forward is one GEMM pass (the fused log-sum-exp of
    ``linear_cross_entropy`` with the ids' columns masked and their logits gathered in the
    same tiles) plus O(tokens x K) work; the backward is cross-entropy's (2 GEMMs, plus one
    for each column the budget did not keep), its dz chunks overwritten at the ids.

    In training loops (as ``linear_cross_entropy``): autocast casts hidden, weight and bias
    as ``F.linear``; ``torch.compile(fullgraph=True)`` traces the custom ops
    ``logitless::topk_kl_forward`` / ``topk_kl_backward``; double backward raises.
    Tensor parallelism: ``process_group=``, or DTensor inputs (a ``Shard(0)`` weight with a
    ``Replicate()`` or token-sharded hidden), docs/tensor_parallel.md.

    Args:
        hidden: (..., H) the student's last hidden states, float16/bfloat16/float32
            (float64 on backend="torch").
        weight: (V, H) the student's LM-head weight; same dtype (autocast aside) and
            device as hidden.
        teacher_ids: (..., K) int64 or int32, the teacher's top-k ids of each position,
            distinct per token, in [0, V); positions as ``hidden``'s (the teacher's
            distribution at the same position). Any order.
        teacher_log_probs: (..., K) float, the teacher's log-probabilities of those ids
            (<= 0), same shape. The teacher's tensors are constants (no gradient).
        target: optional (...) int64/int32 class ids: tokens whose target is
            ``ignore_index`` count for nothing; with ``hard_label_weight`` the hard
            labels (then required).
        direction: "forward" (KL(teacher || student)) or "reverse" (KL(student || teacher)).
        tail: "bucket", "renormalize" or "none" (above).
        temperature: finite float > 0: the student's logits are divided by it (the
            teacher's log-probs are taken as given).
        ignore_index: the target value of tokens that count for nothing.
        reduction: "mean" (over counted tokens; all tokens without ``target``), "sum"
            or "none" (per token, target's shape, 0 at ignored tokens).
        hard_label_weight: >= 0, the weight of the cross-entropy (temperature 1) on
            ``target``.
        bias: optional (V,) bias of the LM head, same dtype as weight.
        softcap: optional s > 0: logits become s * tanh(z / s) before the temperature.
        shift: causal-LM shift of ``target``: position t of ``hidden`` (and of the
            teacher's tensors) is scored against ``target`` at t + 1; the last position
            counts for nothing ("none" gives T - 1 positions), as ``linear_cross_entropy``.
        memory_budget: bytes of temporaries (default: 3% of a GPU's memory, 256 MiB
            elsewhere), as ``linear_cross_entropy``: with the logits' size in the input
            dtype the backward needs no recomputed GEMM; never a tokens x vocab tensor.
        backend: "auto" (Triton on CUDA, PyTorch elsewhere), "triton" or "torch".
        process_group: a ``torch.distributed.ProcessGroup`` over which the head is split
            by vocabulary: ``weight`` (and ``bias``) are this rank's contiguous block of
            rows (blocks in rank order, sizes may differ); hidden, the teacher's tensors
            (global ids) and target are the same on every rank. The loss is the full
            vocabulary's, the same bits on every rank; hidden's gradient is the full one
            (all-reduced in fp32), weight's this rank's rows. Per call: a MAX and a SUM of
            O(tokens x K) floats in the forward, one all-reduce of N x H in the backward.

    Returns:
        The loss (fp32; fp64 for fp64 inputs): a scalar, or per token for "none".

    Errors and special values: bad shapes, dtypes, devices or options raise
    ``ValueError``/``TypeError`` naming the argument (an unknown direction or tail names
    the choices). On the CPU, an id outside [0, V) or repeated within a token, a
    log-probability > 0 (logits passed by mistake?) and, with hard labels, a target
    outside [0, V) raise ``ValueError``. On a GPU nothing is checked that would need a
    host sync: an id outside [0, V) makes that token's loss and gradient NaN, a repeated
    id counts twice, P > 1 (rounding) counts as an empty tail bin. Empty inputs give an
    empty (or NaN "mean", 0 "sum") loss.
    """
    opts = TopKKLOptions.checked(direction=direction, tail=tail, temperature=temperature,
                                 ignore_index=ignore_index, reduction=reduction,
                                 hard_label_weight=hard_label_weight, softcap=softcap)
    if process_group is None and _validate.plain(hidden, weight, bias, teacher_ids, teacher_log_probs, target):
        tp = NO_VOCAB_PARALLEL
    else:
        hidden, weight, bias, tp = _tp.prepare("linear_topk_kl", ("hidden", "weight", "bias"), hidden, weight, bias,
                                               process_group=process_group, vocab_size=None, partial_dx=False)
        teacher_ids, teacher_log_probs, target = (_tp.plain(teacher_ids), _tp.plain(teacher_log_probs),
                                                  _tp.plain(target))
    _validate.check_float("hidden", hidden)
    _validate.check_float("weight", weight)
    hidden, weight, bias = cast_like_linear(hidden, weight, bias)
    num_classes, h = _validate.check_linear_operands("linear_topk_kl", hidden, weight, bias, allow_empty=tp.parallel)
    lead = hidden.shape[:-1]
    k = _check_teacher(teacher_ids, teacher_log_probs, lead, num_classes, tp.parallel)
    if target is not None:
        _validate.check_target(target, lead, "the leading dimensions of hidden")
    elif opts.hard:
        raise ValueError("hard_label_weight > 0 needs target (the hard labels)")
    _validate.check_same_device(hidden=hidden, weight=weight, teacher_ids=teacher_ids,
                                teacher_log_probs=teacher_log_probs, target=target, bias=bias)
    if shift and hidden.dim() < 2:
        raise ValueError("shift=True needs hidden of shape (..., T, H) with a sequence dimension")
    memory_budget = _validate.memory_budget(memory_budget, hidden.device)
    impl = resolve_backend(backend, hidden.device, hidden.dtype, BACKENDS)

    if target is None:  # every token counts (a class other than ignore_index; read only as a mask)
        target = torch.full(lead, 1 if ignore_index == 0 else 0, dtype=torch.int64, device=hidden.device)
    out_shape = target.shape
    if shift and target.shape[-1] > 0:  # position t scores target t + 1; the last counts for nothing
        pad = target.new_full(target.shape[:-1] + (1,), ignore_index)
        target = torch.cat([target[..., 1:], pad], dim=-1)
    x2d = hidden.reshape(-1, h)
    if x2d.stride(-1) != 1:
        x2d = x2d.contiguous()
    # Each token's ids in ascending order (the kernels walk a tile's ids in column order),
    # the log-probs with them: the loss is a sum over them, its order immaterial.
    ids, order = teacher_ids.reshape(-1, k).long().sort(dim=1)
    lp = teacher_log_probs.reshape(-1, k).gather(1, order)
    flat_target = target.reshape(-1).long()

    has_bias_grad = bias is not None and bias.requires_grad
    grad_wanted = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad or has_bias_grad)
    need = Needs(grad_wanted and x2d.requires_grad, grad_wanted and weight.requires_grad,
                 grad_wanted and has_bias_grad)
    call = TopKCall(x2d, weight, bias, ids, lp, flat_target, opts, impl, memory_budget, grad_wanted, need, tp)
    loss = OPS(call).loss
    if opts.reduction == "none":
        loss = loss.reshape(out_shape)
        if shift:
            loss = loss[..., :-1]
    return loss


def _check_teacher(ids: Tensor, lp: Tensor, lead: torch.Size, num_classes: int, parallel: bool) -> int:
    """K, or a clear error for the teacher's tensors (their values: ``custom_op.check_teacher``)."""
    if not isinstance(ids, Tensor):
        raise TypeError(f"teacher_ids must be a torch.Tensor, got {type(ids).__name__}")
    if ids.dtype not in _validate.TARGET_DTYPES:
        raise TypeError(f"teacher_ids must be int64 or int32 token ids, got {ids.dtype}")
    if not isinstance(lp, Tensor):
        raise TypeError(f"teacher_log_probs must be a torch.Tensor, got {type(lp).__name__}")
    if not lp.is_floating_point():
        raise TypeError(f"teacher_log_probs must be a float tensor, got {lp.dtype}")
    if ids.dim() != len(lead) + 1 or ids.shape[:-1] != lead:
        raise ValueError(f"teacher_ids has shape {tuple(ids.shape)}, expected {(*lead, 'K')} (the leading "
                         "dimensions of hidden, then the teacher's K ids)")
    if lp.shape != ids.shape:
        raise ValueError(f"teacher_log_probs has shape {tuple(lp.shape)} but teacher_ids has {tuple(ids.shape)}: "
                         "one log-probability per id")
    k = ids.shape[-1]
    if not parallel and k > num_classes:
        raise ValueError(f"teacher_ids has {k} ids per token but the vocabulary has {num_classes} classes: "
                         "the ids of a token must be distinct")
    _validate.check_teacher_frozen(teacher_log_probs=lp)
    return k


class LinearTopKKLLoss(ModuleForm):
    """Module form of :func:`linear_topk_kl`: holds the options, takes tensors.

    ``loss_fn = LinearTopKKLLoss(tail="bucket", temperature=1.0)``;
    ``loss = loss_fn(hidden, lm_head.weight, teacher_ids, teacher_log_probs, labels)``. Its
    keywords are the function's but ``bias``, which ``forward`` takes
    (``ops.common.module_form``); see the function for every argument and error.
    """

    function = staticmethod(linear_topk_kl)
    inputs = ("bias",)

    def check(self, values: dict) -> dict:
        TopKKLOptions.checked(**{k: values[k] for k in (
            "direction", "tail", "temperature", "ignore_index", "reduction", "hard_label_weight", "softcap")})
        return values

    def forward(self, hidden: Tensor, weight: Tensor, teacher_ids: Tensor, teacher_log_probs: Tensor,
                target: Optional[Tensor] = None, bias: Optional[Tensor] = None):
        return linear_topk_kl(hidden, weight, teacher_ids, teacher_log_probs, target, bias=bias, **self.kwargs)
