"""Public API of the fused linear cross-entropy: the function, its module, the dispatch.

The loss equals ``F.cross_entropy(softcap(x @ weight.T + bias), target, ...)`` plus the
z-loss term, without the (tokens x vocab) logits ever being stored.
"""

from __future__ import annotations

from typing import Optional, Union

import torch
from torch import Tensor

from logitless.distributed import api as _tp
from logitless.formulas.cross_entropy import LossStats, TokenStats, loss_stats
from logitless.ops.common import validate as _validate
from logitless.ops.common.autocast import cast_like_linear
from logitless.ops.common.contract import BackendTable, HelionKind, Lazy, Needs, TritonKind
from logitless.ops.common.docs import shared_doc
from logitless.ops.common.module_form import ModuleForm
from logitless.ops.common.validate import resolve_backend
from logitless.options import CrossEntropyOptions, VocabParallelOptions

from . import custom_op
from .contract import LceBackend, LceCall
from .torch_backend import TorchBackend


def _triton() -> LceBackend:
    from .triton_backend import TritonBackend
    from .triton_grad_in_forward import forward_with_grad

    return TritonBackend(grad_in_forward=forward_with_grad)


def _helion() -> LceBackend:
    from .helion_backend import HelionBackend

    return HelionBackend(BACKENDS)


#: The implementations of linear_cross_entropy, by ``backend=`` name (``contract.LceBackend``;
#: "auto" resolves to one of them, ``ops.common.validate.resolve_backend``). Triton's and
#: Helion's are made on first use (their modules need the optional packages).
#: A call on one device (no process_group, vocab_size or partial_dx; plain tensors).
NO_VOCAB_PARALLEL = VocabParallelOptions()

BACKENDS: BackendTable[LceBackend] = BackendTable(triton=Lazy(TritonKind, _triton), torch=TorchBackend,
                                                  helion=Lazy(HelionKind, _helion))
#: The custom-op pair (logitless::lce_forward / lce_backward) over the table.
OPS = custom_op.define(BACKENDS)


@_validate.torch_weight_hint
@shared_doc
def linear_cross_entropy(
    x: Tensor,
    weight: Tensor,
    target: Tensor,
    bias: Optional[Tensor] = None,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    class_weight: Optional[Tensor] = None,
    softcap: Optional[float] = None,
    z_loss: float = 0.0,
    shift: bool = False,
    return_stats: bool = False,
    memory_budget: Optional[int] = None,
    backend: str = "auto",
    process_group=None,
    vocab_size: Optional[int] = None,
    partial_dx: bool = False,
    batch_invariant: bool = False,
) -> Union[Tensor, tuple[Tensor, LossStats]]:
    """Cross-entropy of ``x @ weight.T + bias`` against ``target``, without the logits.

    Equals ``F.cross_entropy(logits.flatten(0, -2), target.flatten(), weight=class_weight,
    ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing)``
    (reshaped to ``target``'s shape for "none") with ``logits = softcap * tanh((x @
    weight.T + bias) / softcap)`` when ``softcap`` is set, plus ``z_loss * lse**2`` per
    non-ignored token, reduced like the loss ("mean": divided by the same denominator).
    Logits, log-sum-exp and softmax are computed in fp32; gradients are accumulated in
    fp32 and cast once to the input dtype.

    In training loops:
        autocast: under ``torch.autocast(device_type, dtype)`` enabled for the inputs'
            device, x, weight and bias are cast to the autocast dtype as ``F.linear``
            does (autograd records the casts, so fp32 parameters get fp32 gradients; no
            copy is kept between calls): fp32 hidden states and an fp32 head weight run
            at bf16 speed. The loss stays fp32. Outside autocast, x and weight of
            different dtypes raise ``TypeError``.
        torch.compile: the op is a pair of custom ops (``logitless::lce_forward``,
            ``logitless::lce_backward``), so ``torch.compile(model, fullgraph=True)``
            and ``dynamic=True`` trace through it without graph breaks. (The Triton
            planner's gradient-in-forward strategy, where present, is used in eager
            mode only; compiled graphs use the keep/recompute strategies.)
        FSDP2: call it where the head weight is unsharded: inside the forward of the
            module that owns it (when that module is ``fully_shard``-ed with its
            parent, or is the root), or in a method of the head registered with
            ``torch.distributed.fsdp.register_fsdp_forward_method(head, "method")``.
            A sharded DTensor weight raises ``TypeError`` saying so.
        Double backward (differentiating the gradients after ``create_graph=True``)
            raises ``RuntimeError``: it is not supported.
        Tensor parallelism (a head split over the vocabulary): ``process_group=``, or
            DTensor inputs (a ``Shard(0)`` weight with a ``Replicate()`` or
            token-sharded x on the same 1-D mesh, as torchtitan's ``ColwiseParallel``
            head): docs/tensor_parallel.md and ``logitless.distributed``.

    Args:
        x: (..., H) hidden states, float16/bfloat16/float32 (float64 on backend="torch").
        weight: (V, H) LM-head weight, as ``nn.Linear.weight``; same dtype (autocast
            aside) and device as x.
        target: (...) int64 or int32 class indices, the leading shape of ``x``.
        bias: optional (V,), same dtype as ``weight``.
        {ce_options}
        shift: causal-LM shift: position t of ``x`` predicts ``target`` at t+1 along the
            last dim of ``target`` (the sequence); the last position predicts nothing.
            ``x`` is not copied. With reduction="none" the result has T-1 positions
            (none for T = 0 or 1; "mean" is then NaN and "sum" 0, as torch's).
        {return_stats}
        memory_budget: bytes of temporary memory beyond inputs, outputs and gradients
            (default 256 MiB). It sizes the chunks: with a budget of at least the
            logits in the input dtype (tokens x V x itemsize) the Triton backend keeps
            them from the forward and runs 3 GEMMs; below that it keeps what fits and
            recomputes the rest (up to 4 GEMMs), never allocating a tokens x vocab
            tensor. The backward needs at least an fp32 dx accumulator (4 x tokens x
            H bytes) plus one chunk of 4096 columns (tokens x 4096 x itemsize); when
            that minimum exceeds the budget, the minimum is used.
        backend: "auto" (Triton on CUDA, PyTorch elsewhere), "triton", "torch" or
            "helion" (docs/helion.md; never chosen by "auto").
        process_group: a ``torch.distributed.ProcessGroup`` over which the head is
            split by vocabulary: ``weight`` (and ``bias``) are this rank's contiguous
            block of rows of the full (V, H) weight (the blocks, in the group's rank
            order, concatenate to it; sizes may differ); ``x`` and ``target`` (global
            class ids) are the same on every rank; ``class_weight`` is the full (V,)
            vector on every rank. Every option keeps its meaning over the full
            vocabulary; the loss (and ``stats``) are identical on every rank. Per
            call: two collectives of O(tokens) floats in the forward (a third, of N
            int64, for ``return_stats``' argmax) and one all-reduce of x's gradient
            in fp32 (N x H) in the backward; the first call with a group (and local
            row count) also all-gathers the ranks' row counts, once (a host sync).
            All ranks must call the op together.
        vocab_size: the number of real classes when the weight's rows are padded
            (Megatron pads V to a multiple of 128 x the TP size): rows at or beyond
            ``vocab_size`` of the full weight are no class (excluded from the
            softmax) and get zero gradient; targets must be below it. None: every
            row is a class.
        partial_dx: with a vocab-parallel head, return this rank's partial gradient
            of x (the sum over its columns) instead of the all-reduced one, for
            frameworks that reduce it themselves (Megatron's column-parallel head).
        batch_invariant: the per-token loss and ``stats`` bitwise the same whatever the
            batch (its size, the token's position, its neighbours): the forward runs on
            row blocks of a fixed size; the backward is the default one, once over the
            batch (gradients deterministic, not batch-invariant); the reductions add the
            per-token losses; over a vocab-parallel head the ranks' sums are added in rank
            order; docs/rl.md.

    {ce_returns}
    """
    opts = CrossEntropyOptions.checked(
        ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing,
        softcap=softcap, z_loss=z_loss,
    )
    if batch_invariant is not False and batch_invariant is not True:
        raise TypeError(f"batch_invariant must be a bool, got {type(batch_invariant).__name__}")
    if process_group is None and vocab_size is None and partial_dx is False \
            and _validate.plain(x, weight, bias, target, class_weight):
        tp = NO_VOCAB_PARALLEL  # (the common case: one device, plain tensors)
    else:
        x, weight, bias, tp = _tp.prepare("linear_cross_entropy", ("x", "weight", "bias"), x, weight, bias,
                                          process_group=process_group, vocab_size=vocab_size, partial_dx=partial_dx)
        target, class_weight = _tp.plain(target), _tp.plain(class_weight)
    # (x, weight and bias are plain tensors now: prepare made DTensors local or raised.)
    parallel = tp.parallel
    _validate.check_float("x", x)
    _validate.check_float("weight", weight)
    # Autocast as F.linear: x, weight and bias in the autocast dtype (autograd-tracked
    # casts: each input's gradient comes back in its own dtype); the loss stays fp32.
    x, weight, bias = cast_like_linear(x, weight, bias)
    num_classes, hidden = _validate.check_linear_operands("linear_cross_entropy", x, weight, bias,
                                                         allow_empty=parallel)
    if isinstance(target, Tensor) and target.is_floating_point():
        raise TypeError(f"target must be int64 or int32 class indices, got {target.dtype}: class-probability "
                        "targets are not supported by the fused op; compute the logits and call "
                        "logitless.cross_entropy(logits, probs), which takes them")
    _validate.check_target(target, x.shape[:-1], "the leading dimensions of x")
    if parallel:  # the full vector: its length is checked in the op (the ranks know V together)
        if class_weight is not None:
            _validate.check_float("class_weight", class_weight)
    else:
        if class_weight is not None and tp.vocab_size > 0 and class_weight.dim() == 1 \
                and class_weight.shape[0] > num_classes:
            class_weight = class_weight[:num_classes]  # the padding rows' entries
        _validate.check_class_vector("class_weight", class_weight, num_classes)
    _validate.check_same_device(x=x, weight=weight, target=target, bias=bias, class_weight=class_weight)
    if shift and x.dim() < 2:
        raise ValueError("shift=True needs x of shape (..., T, H) with a sequence dimension")
    memory_budget = _validate.memory_budget(memory_budget, x.device)
    impl = resolve_backend(backend, x.device, x.dtype, BACKENDS)

    out_shape = target.shape
    if shift and target.shape[-1] > 0:
        # Target of position t is target[t + 1]; the last position is ignored. Only the
        # (small) target is copied, never x.
        pad = target.new_full(target.shape[:-1] + (1,), ignore_index)
        target = torch.cat([target[..., 1:], pad], dim=-1)
    x2d = x.reshape(-1, hidden)
    if x2d.stride(-1) != 1:
        x2d = x2d.contiguous()
    flat_target = target.reshape(-1).long()

    # Under no_grad (eval) nothing is kept for a backward, whatever requires_grad says.
    # (Written out, no generators: this runs at every call.)
    has_bias_grad = bias is not None and bias.requires_grad
    grad_wanted = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad or has_bias_grad)
    need = (grad_wanted and x2d.requires_grad, grad_wanted and weight.requires_grad, grad_wanted and has_bias_grad)
    # The Triton planner's gradient-in-forward strategy is allowed in eager mode only
    # (under torch.compile the keep/recompute strategies serve, as the strategy returns
    # extra state); the op's plan decides whether to use it.
    in_forward = grad_wanted and not parallel and not torch.compiler.is_compiling()
    call = LceCall(x2d, weight, bias, flat_target, class_weight, opts, impl, memory_budget, return_stats,
                   grad_wanted, in_forward and not batch_invariant, Needs(*need), batch_invariant, tp)
    loss, lse, argmax, *_ = OPS(call)

    def per_token(t: Tensor) -> Tensor:
        t = t.reshape(out_shape)
        return t[..., :-1] if shift else t

    if opts.reduction == "none":
        loss = per_token(loss)
    if not return_stats:
        return loss
    stats = loss_stats(TokenStats(lse, None, None, argmax), flat_target, opts)
    return loss, LossStats(per_token(stats.lse), per_token(stats.correct), stats.num_tokens, per_token(stats.argmax))


class LinearCrossEntropyLoss(ModuleForm):
    """Module form of :func:`linear_cross_entropy`: holds the options, takes tensors.

    ``loss_fn = LinearCrossEntropyLoss(ignore_index=-100, z_loss=1e-4)``;
    ``loss = loss_fn(hidden, lm_head.weight, labels)``. Its keywords are the function's
    (``ops.common.module_form``); see the function for the semantics of every argument
    and for what bad inputs do.
    """

    function = staticmethod(linear_cross_entropy)
    buffer_keywords = ("class_weight",)

    def check(self, values: dict) -> dict:
        CrossEntropyOptions.checked(
            ignore_index=values["ignore_index"], reduction=values["reduction"],
            label_smoothing=values["label_smoothing"], softcap=values["softcap"], z_loss=values["z_loss"],
        )
        return values

    def forward(self, x: Tensor, weight: Tensor, target: Tensor, bias: Optional[Tensor] = None):
        return linear_cross_entropy(x, weight, target, bias, class_weight=self.class_weight, **self.kwargs)
