"""Public API of cross_entropy on logits the caller holds: function, module, dispatch.

A bandwidth-bound drop-in for ``F.cross_entropy`` / ``nn.CrossEntropyLoss`` on (..., V)
logits: the forward reads the logits once and keeps O(tokens) statistics, the backward
reads them once and writes the gradient once (optionally over the logits themselves).
"""

from __future__ import annotations

from typing import Optional, Union

import torch
from torch import Tensor

from logitless.formulas.cross_entropy import LossStats, TokenStats, loss_stats
from logitless.ops.common import validate as _validate
from logitless.ops.common.contract import BackendTable, Lazy, TritonKind
from logitless.ops.common.docs import shared_doc
from logitless.ops.common.module_form import ModuleForm
from logitless.ops.common.validate import resolve_backend
from logitless.options import CrossEntropyOptions, check_memory_budget

from . import custom_op
from .contract import CeBackend, CeCall
from .custom_op import InplaceCrossEntropy
from .torch_backend import TorchBackend


def _triton() -> CeBackend:
    from .triton_backend import TritonBackend

    return TritonBackend()


#: The implementations of cross_entropy, by ``backend=`` name (``contract.CeBackend``; "auto"
#: resolves to one of them, ``ops.common.validate.resolve_backend``). Triton's is made on
#: first use (its module needs the optional package).
BACKENDS: BackendTable[CeBackend] = BackendTable(triton=Lazy(TritonKind, _triton), torch=TorchBackend)
#: The custom-op pair (logitless::ce_forward / ce_backward) over the table.
OPS = custom_op.define(BACKENDS)


def _classes_last(logits: Tensor, target: Tensor, class_dim: Optional[int]) -> Tensor:
    """``logits`` with the classes in the last dimension.

    class_dim=None infers the layout from the target's shape: (..., V) when the target is
    ``logits.shape[:-1]``, else torch's (N, C, d1, ...) when it is the logits' shape
    without dimension 1 (both readings agree for (N, C)). When both readings fit but
    differ (e.g. logits (N, C, d) with C == d), it raises: pass class_dim=1 or -1.
    """
    if class_dim is not None:
        if class_dim not in (1, -1) or (class_dim == 1 and logits.dim() < 2):
            raise ValueError(f"class_dim must be -1, or 1 for logits of 2+ dims, got {class_dim}")
        return logits.movedim(1, -1) if class_dim == 1 else logits
    if logits.dim() < 3 or not isinstance(target, Tensor):
        return logits
    last = target.shape == logits.shape[:-1]
    torch_layout = target.shape == logits.shape[:1] + logits.shape[2:]
    if last and torch_layout:
        raise ValueError(
            f"logits of shape {tuple(logits.shape)} with target {tuple(target.shape)} fit both "
            "the (..., V) layout and torch's (N, C, d1, ...) layout; pass class_dim=-1 or "
            "class_dim=1 to say which"
        )
    return logits.movedim(1, -1) if torch_layout else logits


INPLACE_UNDER_COMPILE = (
    "cross_entropy(..., inplace_backward=True) is not supported under torch.compile (a compiled "
    "graph cannot hand the logits' own buffer back as their gradient); use inplace_backward=False there")


@torch.compiler.assume_constant_result
def _refuse_inplace_if_fullgraph() -> bool:
    """Under ``torch.compile(fullgraph=True)`` raises the refusal as Dynamo's user-facing
    error type (a RuntimeError too). Run at trace time (``assume_constant_result``), it is
    the error's first line, where a ``raise`` in traced code became Dynamo's "Observed
    exception" with this message under its "Developer debug context". Reads Dynamo's
    tracer (private; where that fails, the caller's graph break says it instead)."""
    try:
        from torch._dynamo.exc import UserError, UserErrorType
        from torch._dynamo.symbolic_convert import InstructionTranslator

        tx = InstructionTranslator.current_tx()
        fullgraph = bool(getattr(tx, "one_graph", False) or getattr(tx, "error_on_graph_break", False))
    except Exception:  # noqa: BLE001 - another torch: leave it to the graph break
        return False
    if fullgraph:
        class CompileRefusal(UserError, RuntimeError):
            pass

        raise CompileRefusal(UserErrorType.INVALID_INPUT, INPLACE_UNDER_COMPILE)
    return False


def _disjoint(t: Tensor) -> bool:
    """No two elements of the 2-D ``t`` share memory (a sufficient test: row-major-like
    or column-major-like strides), so writing a gradient over ``t`` has no races."""
    (n, v), (sn, sv) = t.shape, t.stride()
    if n <= 1 or v <= 1:
        return n * v <= 1 or (sv if n <= 1 else sn) > 0
    return (sv > 0 and sn >= v * sv) or (sn > 0 and sv >= n * sn)


@shared_doc
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
    weight: Optional[Tensor] = None,
    class_dim: Optional[int] = None,
) -> Union[Tensor, tuple[Tensor, LossStats]]:
    """Cross-entropy of ``logits`` against ``target``, reading the logits once per pass.

    Equals ``F.cross_entropy(logits.flatten(0, -2), target.flatten(), weight=class_weight,
    ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing)``
    (reshaped to ``target``'s shape for "none") with ``logits`` replaced by ``softcap *
    tanh(logits / softcap)`` when ``softcap`` is set, plus ``z_loss * lse**2`` per
    non-ignored token, reduced like the loss ("mean": divided by the same denominator).
    Log-sum-exp and softmax are computed in fp32 (fp64 for fp64 logits); the loss is
    fp32 (fp64 for fp64 logits); the gradient has the logits' dtype. Under
    ``torch.autocast`` nothing is cast: bf16 logits of an autocast matmul are read as
    they are and the statistics computed in fp32, as ``F.cross_entropy`` does under
    autocast. Works under ``torch.compile`` (custom ops ``logitless::ce_forward`` and
    ``ce_backward``; ``inplace_backward=True`` excepted). Double backward is not
    supported (differentiating the gradient raises ``RuntimeError``).

    Args:
        logits: (..., V) float16/bfloat16/float32 (float64 on backend="torch"); (V,) is
            one token. Read through their strides when the leading dimensions merge into
            one (any (N, V) view, e.g. transposed); otherwise (e.g. ``logits[:, :-1]`` of a
            (B, T, V) tensor) they are first copied by ``reshape``. torch's layout
            (N, C, d1, ...) with target (N, d1, ...) is accepted too (see ``class_dim``;
            the logits are then copied once, as classes-last).
        target: (...) int64 or int32 class indices, the leading shape of ``logits``; or
            class probabilities, a float tensor of the logits' shape (torch's soft
            targets: loss = -sum_c w_c y'_c log_softmax(z)_c with y' = (1 - eps) y + eps / C
            for label_smoothing eps and class_weight w; "mean" divides by the number of
            tokens, not by the weights; ignore_index plays no part; (V,) logits and (N, V)
            need no class_dim, 3+ dims need class_dim=-1 or 1). Soft targets run in plain
            torch whatever ``backend`` (an fp32 copy of the logits; no memory_budget
            chunking), receive a gradient as in torch, and support neither return_stats
            nor inplace_backward.
        {ce_options}
        {return_stats}
        inplace_backward: (eager mode only: under torch.compile it raises RuntimeError)
            the backward writes the gradient over the logits' own memory
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
        {backend}
        weight: alias of ``class_weight`` (the name ``F.cross_entropy`` uses).
        class_dim: where the classes are: -1 (the (..., V) layout), 1 (torch's
            (N, C, d1, ...) layout), or None: inferred from target's shape, (..., V) when
            it is ``logits.shape[:-1]``, torch's layout when it is the logits' shape
            without dimension 1; a ``ValueError`` when both fit and differ (e.g. (N, C, d)
            logits with C == d).

    {ce_returns}
    """
    if inplace_backward is True and torch.compiler.is_compiling():
        # Eager only: fullgraph=True gets our refusal as its error; otherwise the call is a
        # graph break (a disabled function, never traced: no warning from the checks in it).
        _refuse_inplace_if_fullgraph()
        return _eager_cross_entropy(
            logits, target, ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing,
            class_weight=class_weight, softcap=softcap, z_loss=z_loss, return_stats=return_stats,
            inplace_backward=True, memory_budget=memory_budget, backend=backend, weight=weight,
            class_dim=class_dim)
    opts = CrossEntropyOptions.checked(
        ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing,
        softcap=softcap, z_loss=z_loss,
    )
    if weight is not None:
        if class_weight is not None:
            raise ValueError("pass the class weights as weight= or class_weight=, not both")
        class_weight = weight
    _validate.check_not_dtensor("cross_entropy", logits=logits)
    _validate.check_float("logits", logits)
    if logits.dim() < 1:
        raise ValueError("logits must have at least one dimension (..., V)")
    if isinstance(target, Tensor) and target.is_floating_point():
        check_memory_budget(memory_budget)
        if backend != "auto" and backend not in BACKENDS.entries:
            raise ValueError(f"backend must be one of {('auto', *BACKENDS.names())}, got {backend!r}")
        return _soft_target_cross_entropy(logits, target, class_weight, opts, class_dim, return_stats,
                                          inplace_backward)
    logits = _classes_last(logits, target, class_dim)
    num_classes = logits.shape[-1]
    if num_classes == 0:
        raise ValueError("logits have size 0 in the last dimension: the vocabulary is empty")
    _validate.check_target(target, logits.shape[:-1], "the leading dimensions of logits")
    _validate.check_class_vector("class_weight", class_weight, num_classes)
    _validate.check_same_device(logits=logits, target=target, class_weight=class_weight)
    memory_budget = check_memory_budget(memory_budget)
    impl = resolve_backend(backend, logits.device, logits.dtype, BACKENDS)

    logits2d = logits.reshape(-1, num_classes)  # a view unless the leading dims cannot merge
    flat_target = target.reshape(-1).long()
    call = CeCall(logits2d, flat_target, class_weight, opts, impl, memory_budget, return_stats)
    if inplace_backward:
        if not _disjoint(logits2d):
            raise ValueError(
                f"inplace_backward=True needs logits whose elements do not overlap in memory, got "
                f"strides {tuple(logits.stride())}; pass logits.contiguous() or inplace_backward=False"
            )
        loss, lse, argmax = InplaceCrossEntropy.apply(call, BACKENDS[impl], logits2d)
    else:
        out = OPS(call)
        loss, lse, argmax = out.loss, out.lse, out.argmax
    if opts.reduction == "none":
        loss = loss.reshape(target.shape)
    if not return_stats:
        return loss
    stats = loss_stats(TokenStats(lse, None, None, argmax), flat_target, opts)
    return loss, LossStats(
        stats.lse.reshape(target.shape), stats.correct.reshape(target.shape), stats.num_tokens,
        stats.argmax.reshape(target.shape),
    )


try:  # (torch < 2.7 has no reason=)
    _eager_cross_entropy = torch.compiler.disable(cross_entropy, reason=INPLACE_UNDER_COMPILE)
except TypeError:
    _eager_cross_entropy = torch.compiler.disable(cross_entropy)


def _soft_target_cross_entropy(logits: Tensor, target: Tensor, class_weight: Optional[Tensor],
                               opts: CrossEntropyOptions, class_dim: Optional[int], return_stats: bool,
                               inplace_backward: bool) -> Tensor:
    """Class-probability targets, torch's formula, in plain torch (fp32, fp64 for fp64):
    y' = (1 - eps) y + eps / C, loss = -sum_c w_c y'_c log_softmax(z)_c per token, plus
    z_loss * lse**2; "mean" divides the sum by the number of tokens (not by the weights)."""
    if return_stats or inplace_backward:
        raise ValueError("cross_entropy with class-probability (float) targets supports neither "
                         "return_stats nor inplace_backward; pass int64 class indices for those")
    if target.shape != logits.shape:
        raise ValueError(f"float target (class probabilities) must have the logits' shape "
                         f"{tuple(logits.shape)}, got {tuple(target.shape)}; class indices must be int64 or int32")
    if logits.dim() >= 3 and class_dim is None:
        raise ValueError(f"class-probability targets of shape {tuple(target.shape)}: pass class_dim=-1 "
                         "(classes last, (..., V)) or class_dim=1 (torch's (N, C, d1, ...))")
    if class_dim is not None:
        if class_dim not in (1, -1) or (class_dim == 1 and logits.dim() < 2):
            raise ValueError(f"class_dim must be -1, or 1 for logits of 2+ dims, got {class_dim}")
        if class_dim == 1:
            logits, target = logits.movedim(1, -1), target.movedim(1, -1)
    num_classes = logits.shape[-1]
    if num_classes == 0:
        raise ValueError("logits have size 0 in the last dimension: the vocabulary is empty")
    _validate.check_class_vector("class_weight", class_weight, num_classes)
    _validate.check_same_device(logits=logits, target=target, class_weight=class_weight)
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    z = logits.to(dtype)
    if opts.softcap is not None:
        z = opts.softcap * torch.tanh(z / opts.softcap)
    lse = torch.logsumexp(z, dim=-1, keepdim=True)
    y = target.to(dtype)
    if opts.label_smoothing > 0:
        y = y * (1.0 - opts.label_smoothing) + opts.label_smoothing / num_classes
    if class_weight is not None:
        y = y * class_weight.detach().to(dtype)  # no gradient, as the class indices' path
    loss = -(y * (z - lse)).sum(-1)
    if opts.z_loss != 0.0:
        loss = loss + opts.z_loss * lse[..., 0] ** 2
    if opts.reduction == "none":
        return loss  # the token shape: (...) classes-last, (N, d1, ...) for class_dim=1
    if opts.reduction == "sum":
        return loss.sum()
    return loss.sum() / loss.numel() if loss.numel() else loss.sum() * float("nan")


class CrossEntropyLoss(ModuleForm):
    """Module form of :func:`cross_entropy`: holds the options, takes tensors.

    ``loss_fn = CrossEntropyLoss(ignore_index=-100, z_loss=1e-4)``;
    ``loss = loss_fn(logits, labels)``. Its keywords are the function's
    (``ops.common.module_form``); see the function for the semantics of every argument
    and for what bad inputs do.
    """

    function = staticmethod(cross_entropy)
    buffer_keywords = ("class_weight",)

    def check(self, values: dict) -> dict:
        weight = values.pop("weight")
        if weight is not None:
            if values["class_weight"] is not None:
                raise ValueError("pass the class weights as weight= or class_weight=, not both")
            values["class_weight"] = weight
        CrossEntropyOptions.checked(
            ignore_index=values["ignore_index"], reduction=values["reduction"],
            label_smoothing=values["label_smoothing"], softcap=values["softcap"], z_loss=values["z_loss"],
        )
        return values

    def forward(self, logits: Tensor, target: Tensor):
        return cross_entropy(logits, target, class_weight=self.class_weight, **self.kwargs)
