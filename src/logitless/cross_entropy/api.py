"""Public API of cross_entropy on logits the caller holds: function, module, dispatch.

A bandwidth-bound drop-in for ``F.cross_entropy`` / ``nn.CrossEntropyLoss`` on (..., V)
logits: the forward reads the logits once and keeps O(tokens) statistics, the backward
reads them once and writes the gradient once (optionally over the logits themselves).
"""

from __future__ import annotations

from typing import Optional, Union

import torch
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

from .. import _validate
from .._loss_math import (
    LossStats,
    TokenStats,
    grad_coefficients,
    loss_stats,
    reduce_loss,
    token_loss,
    upstream_per_token,
)
from .._dispatch import backend_module


def _disjoint(t: Tensor) -> bool:
    """No two elements of the 2-D ``t`` share memory (a sufficient test: row-major-like
    or column-major-like strides), so writing a gradient over ``t`` has no races."""
    (n, v), (sn, sv) = t.shape, t.stride()
    if n <= 1 or v <= 1:
        return n * v <= 1 or (sv if n <= 1 else sn) > 0
    return (sv > 0 and sn >= v * sv) or (sn > 0 and sv >= n * sn)


_SPENT = (
    "cross_entropy(..., inplace_backward=True) has already overwritten its logits with "
    "their gradient, so its backward can run only once (not again with retain_graph=True); "
    "use inplace_backward=False to backpropagate through it more than once"
)


class _CrossEntropyFunction(torch.autograd.Function):
    """Autograd glue shared by every backend: stats -> loss here, kernels in the backend."""

    @staticmethod
    def forward(ctx, logits, target, class_weight, opts, backend, budget, need_argmax, inplace):
        n, v = logits.shape
        if n == 0:
            empty = logits.new_empty(0, dtype=torch.float32)
            stats = TokenStats(empty, empty, empty, target.new_empty(0, dtype=torch.int64))
        else:
            stats = backend.forward(
                logits, target, class_weight, opts.softcap,
                need_smooth=opts.needs_smooth_sum, need_argmax=need_argmax, budget=budget,
            )
        loss_tok, w_t = token_loss(stats, target, v, class_weight, opts)
        loss = reduce_loss(loss_tok, w_t, opts.reduction)
        ctx.save_for_backward(logits, target, class_weight, stats.lse, w_t)
        ctx.opts, ctx.backend, ctx.budget = opts, backend, budget
        ctx.inplace, ctx.spent = inplace, False
        argmax = stats.argmax if need_argmax else target.new_empty(0, dtype=torch.int64)
        ctx.mark_non_differentiable(stats.lse, argmax)
        return loss, stats.lse, argmax

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss, _grad_lse, _grad_argmax):
        nones = (None,) * 7
        if not ctx.needs_input_grad[0]:
            return (None,) + nones
        if ctx.spent:
            raise RuntimeError(_SPENT)
        logits, target, class_weight, lse, w_t = ctx.saved_tensors
        opts = ctx.opts
        n, v = logits.shape
        out = logits if ctx.inplace else torch.empty_like(logits)
        if n > 0:
            g = upstream_per_token(grad_loss, w_t, opts.reduction)
            coef = grad_coefficients(lse, target, g, v, class_weight, opts)
            ctx.backend.backward(logits, target, class_weight, opts.softcap, lse, coef, out, budget=ctx.budget)
        if ctx.inplace:
            ctx.spent = True
            # Autograd nodes that saved these logits now fail loudly instead of reading
            # the gradient as if it were logits.
            torch.autograd.graph.increment_version(logits)
            out = logits.detach()
        return (out,) + nones


def cross_entropy(
    logits: Tensor,
    target: Tensor,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    class_weight: Optional[Tensor] = None,
    softcap: Optional[float] = None,
    z_loss: float = 0.0,
    return_stats: bool = False,
    inplace_backward: bool = False,
    memory_budget: Optional[int] = None,
    backend: str = "auto",
) -> Union[Tensor, tuple[Tensor, LossStats]]:
    """Cross-entropy of ``logits`` against ``target``, reading the logits once per pass.

    Equals ``F.cross_entropy(logits.flatten(0, -2), target.flatten(), weight=class_weight,
    ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing)``
    (reshaped to ``target``'s shape for "none") with ``logits`` replaced by ``softcap *
    tanh(logits / softcap)`` when ``softcap`` is set, plus ``z_loss * lse**2`` per
    non-ignored token, reduced like the loss ("mean": divided by the same denominator).
    Log-sum-exp and softmax are computed in fp32 (fp64 for fp64 logits); the loss is
    fp32 (fp64 for fp64 logits); the gradient has the logits' dtype.

    Args:
        logits: (..., V) float16/bfloat16/float32 (float64 on backend="torch"); (V,) is
            one token. Read through their strides when the leading dimensions merge into
            one (any (N, V) view, e.g. transposed); otherwise (e.g. ``logits[:, :-1]`` of a
            (B, T, V) tensor) they are first copied by ``reshape``.
        target: (...) int64 or int32 class indices, the leading shape of ``logits``.
        ignore_index: targets equal to it contribute no loss and no gradient.
        reduction: "mean" (over non-ignored tokens, weighted by class_weight as torch),
            "sum" or "none" (per-token loss in the shape of target, 0 at ignored tokens).
        label_smoothing: in [0, 1], as in ``F.cross_entropy``.
        class_weight: optional (V,) per-class weight, as ``weight=`` of ``F.cross_entropy``
            (receives no gradient).
        softcap: optional s > 0: logits become s * tanh(z / s) (Gemma 2).
        z_loss: coefficient of the z-loss term lse**2 (0 disables it).
        return_stats: also return a ``LossStats`` (per-token lse, per-token
            argmax == target, number of non-ignored tokens) computed in the same pass.
        inplace_backward: the backward writes the gradient over the logits' own memory
            and returns that buffer as their gradient, so backward allocates nothing of
            the logits' size. The logits are destroyed by the backward: use it only when
            nothing else needs them afterwards (typically logits = lm_head(hidden), whose
            backward needs hidden and the weight, not the logits). Other autograd nodes
            that saved the logits then raise ("modified by an inplace operation"); a
            second backward through this op (retain_graph=True, or with reduction="none"
            backpropagating parts of the loss one after the other) raises RuntimeError.
            For a leaf, ``logits.grad`` may alias ``logits``. Needs logits whose elements
            do not overlap in memory (not an ``expand``-ed tensor).
        memory_budget: bytes of temporary memory beyond inputs, outputs and gradients
            (default 256 MiB); sizes the row chunks of the torch backend (at least one
            row), which never makes an fp32 copy of all the logits.
        backend: "auto" (Triton on CUDA, PyTorch elsewhere), "triton" or "torch".

    Returns:
        The loss (a scalar, or per-token for "none"), or ``(loss, stats)`` with
        ``return_stats=True``.

    Errors and special values:
        Wrong ranks, shapes, dtypes or devices, an unknown reduction or backend, and
        options out of range raise ``ValueError``/``TypeError``. A target outside
        [0, V) that is not ``ignore_index`` raises ``ValueError`` on the CPU; on a GPU
        (where checking would stall on a host sync) that token's loss is NaN, and so
        is the reduced loss. NaN or inf in the logits give a NaN loss, never a finite
        one. Empty inputs and batches with every token ignored behave as torch:
        "mean" gives NaN with zero gradients, "sum" gives 0.
    """
    opts = _validate.check_options(
        ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing,
        softcap=softcap, z_loss=z_loss,
    )
    _validate.check_float("logits", logits)
    if logits.dim() < 1:
        raise ValueError("logits must have at least one dimension (..., V)")
    num_classes = logits.shape[-1]
    if num_classes == 0:
        raise ValueError("logits have size 0 in the last dimension: the vocabulary is empty")
    _validate.check_target(target, logits.shape[:-1], "the leading dimensions of logits")
    _validate.check_class_vector("class_weight", class_weight, num_classes)
    _validate.check_same_device(logits=logits, target=target, class_weight=class_weight)
    memory_budget = _validate.check_memory_budget(memory_budget)
    _validate.check_targets_in_range(target, num_classes, ignore_index)
    impl = backend_module(__package__, backend, logits.device, logits.dtype)

    logits2d = logits.reshape(-1, num_classes)  # a view unless the leading dims cannot merge
    if inplace_backward and not _disjoint(logits2d):
        raise ValueError(
            f"inplace_backward=True needs logits whose elements do not overlap in memory, got "
            f"strides {tuple(logits.stride())}; pass logits.contiguous() or inplace_backward=False"
        )
    flat_target = target.reshape(-1).long()
    loss, lse, argmax = _CrossEntropyFunction.apply(
        logits2d, flat_target, class_weight, opts, impl, memory_budget, return_stats,
        bool(inplace_backward),
    )
    if opts.reduction == "none":
        loss = loss.reshape(target.shape)
    if not return_stats:
        return loss
    stats = loss_stats(TokenStats(lse, None, None, argmax), flat_target, opts)
    return loss, LossStats(
        stats.lse.reshape(target.shape), stats.correct.reshape(target.shape), stats.num_tokens
    )


class CrossEntropyLoss(nn.Module):
    """Module form of :func:`cross_entropy`: holds the options, takes tensors.

    ``loss_fn = CrossEntropyLoss(ignore_index=-100, z_loss=1e-4)``;
    ``loss = loss_fn(logits, labels)``. See the function for the semantics of every
    argument and for what bad inputs do.
    """

    def __init__(
        self,
        *,
        ignore_index: int = -100,
        reduction: str = "mean",
        label_smoothing: float = 0.0,
        class_weight: Optional[Tensor] = None,
        softcap: Optional[float] = None,
        z_loss: float = 0.0,
        return_stats: bool = False,
        inplace_backward: bool = False,
        memory_budget: Optional[int] = None,
        backend: str = "auto",
    ):
        super().__init__()
        _validate.check_options(
            ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing,
            softcap=softcap, z_loss=z_loss,
        )
        self.register_buffer("class_weight", class_weight)
        self.kwargs = dict(
            ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing,
            softcap=softcap, z_loss=z_loss, return_stats=return_stats,
            inplace_backward=inplace_backward, memory_budget=memory_budget, backend=backend,
        )

    def forward(self, logits: Tensor, target: Tensor):
        return cross_entropy(logits, target, class_weight=self.class_weight, **self.kwargs)

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v!r}" for k, v in self.kwargs.items())
