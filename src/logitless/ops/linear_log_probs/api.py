"""Public API of linear_log_probs: per-token log-probabilities (and entropy) at a
temperature from the hidden states and the LM-head weight, without the logits; the table
of its backends (``BACKENDS``)."""

from __future__ import annotations

from typing import Optional, Union

import torch
from torch import Tensor

from logitless.distributed import api as _tp
from logitless.formulas import truncation as _truncation
from logitless.ops.common import validate as _validate
from logitless.ops.common.autocast import cast_like_linear
from logitless.ops.common.contract import BackendTable, HelionKind, Lazy, TritonKind
from logitless.ops.common.glue import HOST_SYNCS
from logitless.ops.common.module_form import ModuleForm
from logitless.ops.common.validate import resolve_backend
from logitless.options import LogProbOptions, VocabParallelOptions

from . import custom_op
from .contract import LlpBackend, LlpCall
from .torch_backend import TorchBackend


def _triton() -> LlpBackend:
    from .triton_backend import TritonBackend

    return TritonBackend()


def _helion() -> LlpBackend:
    from .helion_backend import HelionBackend

    return HelionBackend(BACKENDS)


#: The implementations of linear_log_probs, by ``backend=`` name (``contract.LlpBackend``;
#: "auto" resolves to one of them, ``ops.common.validate.resolve_backend``). Triton's and
#: Helion's are made on first use (their modules need the optional packages). Truncated
#: sampling and ``batch_invariant`` are Configs of the same backends (``truncation``).
BACKENDS: BackendTable[LlpBackend] = BackendTable(triton=Lazy(TritonKind, _triton), torch=TorchBackend,
                                                  helion=Lazy(HelionKind, _helion))
#: The custom-op pair (logitless::llp_forward / llp_backward) over the table; a truncated
#: call's (top-k / top-p / min-p: its host syncs choose its route) is another pair of the
#: same bodies, which CUDA-graph trees run between their graphs (``glue.HOST_SYNCS``).
OPS = custom_op.define(BACKENDS)
TRUNCATED_OPS = custom_op.define(BACKENDS, name="llp_truncated", tags=HOST_SYNCS)
#: A call on one device (no process_group, vocab_size or partial_dx; plain tensors).
NO_VOCAB_PARALLEL = VocabParallelOptions()


def linear_log_probs(
    x: Tensor,
    weight: Tensor,
    tokens: Tensor,
    bias: Optional[Tensor] = None,
    *,
    temperature: float = 1.0,
    entropy: bool = False,
    softcap: Optional[float] = None,
    ignore_index: int = -100,
    memory_budget: Optional[int] = None,
    backend: str = "auto",
    process_group=None,
    vocab_size: Optional[int] = None,
    partial_dx: bool = False,
    top_k=None,
    top_p=1.0,
    min_p=0.0,
    batch_invariant: bool = False,
) -> Union[Tensor, tuple[Tensor, Tensor]]:
    """log softmax(a)[token] per token, a = softcap(x @ weight.T + bias) / temperature,
    without the (tokens x vocab) logits; with ``entropy=True`` also the entropy of
    softmax(a). What RL post-training (GRPO, PPO, ...) asks of the LM head for the
    policy, the old policy and the reference model.

    Equals ``F.log_softmax(z / T, -1).gather(-1, tokens[..., None])[..., 0]`` and
    ``-(p * log p).sum(-1)`` with z the logits in fp32 (soft-capped first when
    ``softcap`` is set). The division by T is done on the fp32 logits: x / T is never
    rounded to x's dtype. Statistics are fp32 (fp64 for fp64 inputs on the torch
    backend); gradients accumulate in fp32 and are cast once to the input dtype.
    Math and merge rule of the per-token statistics: ``logitless.formulas.log_probs``.

    Memory traffic (Triton, CUDA): the forward is one GEMM pass that reads x and W and
    writes O(tokens) statistics; with a gradient to come it also stores exp(a - m) for
    the vocabulary columns the budget holds. The backward is 2 GEMMs (dW, dx) plus one
    recomputed GEMM for each column not kept: 3 GEMMs in all when the budget holds the
    logits in the input dtype. ``entropy=False`` computes no entropy term at all.

    Gradients flow from both outputs, with any upstream gradient, to x, weight and bias
    (autocast, torch.compile fullgraph/dynamic, FSDP2 and double backward behave as for
    ``linear_cross_entropy``: custom ops ``logitless::llp_forward``/``llp_backward``).

    Tensor parallelism (a head split over the vocabulary): ``process_group=``, or DTensor
    inputs (a ``Shard(0)`` weight with a ``Replicate()`` or token-sharded x on the same
    1-D mesh), as for ``linear_cross_entropy``; docs/tensor_parallel.md. Each rank
    computes (max, sum, entropy term, token logit) over its own rows; one MAX and one
    packed SUM of O(tokens) floats merge them, so both outputs are those of the full
    vocabulary, bitwise identical on every rank.

    Args:
        x: (..., H) hidden states, float16/bfloat16/float32 (float64 on backend="torch").
        weight: (V, H) LM-head weight; same dtype (autocast aside) and device as x.
        tokens: (...) int64 or int32 token ids, the leading shape of x.
        bias: optional (V,), same dtype as weight.
        temperature: finite float > 0 (else ValueError).
        entropy: also return the entropy of softmax(a) per token.
        softcap: optional s > 0: logits become s * tanh(z / s) before the temperature.
        ignore_index: tokens equal to it give 0 for both outputs and no gradient.
        memory_budget: bytes of temporaries (default 256 MiB), as for
            ``linear_cross_entropy``: with at least tokens x V x itemsize bytes the
            backward needs no recomputed GEMM.
        backend: "auto" (Triton on CUDA, PyTorch elsewhere), "triton", "torch" or
            "helion" (docs/helion.md; never chosen by "auto").
        process_group: a ``torch.distributed.ProcessGroup`` over which the head is split
            by vocabulary: ``weight`` (and ``bias``) are this rank's contiguous block of
            rows of the full (V, H) weight (blocks in the group's rank order; sizes may
            differ, even be 0); ``x`` and ``tokens`` (global ids) are the same on every
            rank. Per call: two collectives of O(tokens) floats in the forward (a MAX,
            a packed SUM) and one all-reduce of x's gradient in fp32 (N x H) in the
            backward; the first call with a group (and local row count) all-gathers
            the ranks' row counts once (a host sync). All ranks call the op together.
        vocab_size: the number of real classes when the weight's rows are padded
            (rows at or beyond it are no class and get zero gradient; tokens must be
            below it). None: every row is a class.
        partial_dx: with a vocab-parallel head, return this rank's partial gradient of
            x (the sum over its columns) instead of the all-reduced one.
        top_k, top_p, min_p: the distribution vLLM samples from (truncated sampling):
            min-p, then top-k, then top-p over a, renormalised
            (``logitless.formulas.truncation``). Each a Python number or a per-token
            tensor (tokens' shape or (N,)); ``top_k`` 0/None, ``top_p`` 1 and
            ``min_p`` 0 are off; out of range: ValueError. log p is -inf for a token
            outside the kept set (no gradient there), ``entropy`` that of the truncated
            distribution, gradients flow through the kept set. Cost: one threshold GEMM
            pass more (``ops.linear_log_probs.truncation``; with a soft-cap nothing is
            kept for the backward); with ``process_group`` the threshold pass
            all-gathers each rank's top-C candidates per token (C >= 64, > top_k).
        batch_invariant: every per-token output bitwise the same whatever the batch
            size, the token's position and its neighbours: the rows go through fixed-size
            blocks (the last padded). Cost: up to one block of padding rows (2048 on
            Triton, 1024/64 on the torch path on CUDA/CPU), one recomputed GEMM in the
            backward (nothing kept) and one dW add per block. With ``process_group`` the
            ranks' statistics are added in rank order after an all-gather.

    Returns:
        logp (fp32, tokens' shape), or ``(logp, entropy)`` with ``entropy=True``.

    Errors and special values: bad shapes, dtypes, devices or options raise
    ``ValueError``/``TypeError`` naming the argument. A token outside [0, V) that is not
    ``ignore_index`` raises ``ValueError`` on the CPU; on a GPU (no host sync) that
    token's outputs are NaN. Empty inputs give empty outputs.
    """
    opts = LogProbOptions.checked(temperature=temperature, entropy=entropy, softcap=softcap,
                                  ignore_index=ignore_index)
    if process_group is None and vocab_size is None and partial_dx is False \
            and _validate.plain(x, weight, bias, tokens):
        tp = NO_VOCAB_PARALLEL  # (the common case: one device, plain tensors)
    else:
        x, weight, bias, tp = _tp.prepare("linear_log_probs", ("x", "weight", "bias"), x, weight, bias,
                                          process_group=process_group, vocab_size=vocab_size, partial_dx=partial_dx)
        tokens = _tp.plain(tokens)
    # (x, weight and bias are plain tensors now: prepare made DTensors local or raised.)
    _validate.check_float("x", x)
    _validate.check_float("weight", weight)
    x, weight, bias = cast_like_linear(x, weight, bias)
    _, hidden = _validate.check_linear_operands("linear_log_probs", x, weight, bias, allow_empty=tp.parallel)
    _check_tokens(tokens, x.shape[:-1])
    _validate.check_same_device(x=x, weight=weight, tokens=tokens, bias=bias)
    memory_budget = _validate.memory_budget(memory_budget, x.device)
    impl = resolve_backend(backend, x.device, x.dtype, BACKENDS)
    trunc = None  # (the default call adds no Python call here: the host-overhead bound)
    if top_k is not None or isinstance(top_p, Tensor) or isinstance(min_p, Tensor) or top_p != 1.0 \
            or min_p != 0.0:
        trunc = _truncation.check(top_k, top_p, min_p, tokens.shape, tokens.device)
    if batch_invariant is not False and batch_invariant is not True:
        raise TypeError(f"batch_invariant must be a bool, got {type(batch_invariant).__name__}")

    out_shape = tokens.shape
    x2d = x.reshape(-1, hidden)
    if x2d.stride(-1) != 1:
        x2d = x2d.contiguous()
    flat = tokens.reshape(-1).long()
    need_grad = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                             or (bias is not None and bias.requires_grad))
    need_dw = need_grad and weight.requires_grad
    k = p = mp = None
    k_max, block, checked = -1, 0, True
    if trunc is not None or batch_invariant:
        if not BACKENDS[impl].truncates:  # (Helion: no threshold kernels; its fallback backend runs the call)
            from logitless.ops.common.helion_choice import fallback_name

            impl = fallback_name(x.device)
        if batch_invariant:
            from logitless.ops.common import invariant

            block = invariant.rows(BACKENDS[impl], x.device)
        k_max = 0
        if trunc is not None:
            k, p, mp, checked = trunc.top_k, trunc.top_p, trunc.min_p, trunc.checked
            k_max = trunc.k_max if trunc.k_max is not None else -1
            # (eager: the host sync here; none under torch.compile or while capturing a CUDA graph)
            if k_max < 0 and x2d.shape[0] and not torch.compiler.is_compiling() \
                    and _truncation.syncs_allowed(x2d.device):
                from .contract import tensor_k_max

                k_max = tensor_k_max(k, block)
    call = LlpCall(x2d, weight, bias, flat, opts, impl, memory_budget, need_grad, need_dw, k, p, mp, checked, k_max,
                   block, tp)
    logp, ent, *_ = (OPS if k is None else TRUNCATED_OPS)(call)
    logp = logp.reshape(out_shape)
    if not opts.entropy:
        return logp
    assert ent is not None  # (opts.entropy)
    return logp, ent.reshape(out_shape)


def _check_tokens(tokens: Tensor, expected_shape: torch.Size) -> None:
    if not isinstance(tokens, Tensor):
        raise TypeError(f"tokens must be a torch.Tensor, got {type(tokens).__name__}")
    if tokens.dtype not in _validate.TARGET_DTYPES:
        raise TypeError(f"tokens must be int64 or int32, got {tokens.dtype}")
    if tokens.shape != expected_shape:
        raise ValueError(f"tokens has shape {tuple(tokens.shape)}, expected {tuple(expected_shape)} "
                         "(the leading dimensions of x)")


class LinearLogProbs(ModuleForm):
    """Module form of :func:`linear_log_probs`: holds the options, takes tensors.

    ``head = LinearLogProbs(temperature=0.7, entropy=True)``;
    ``logp, ent = head(hidden, lm_head.weight, tokens)``. Its keywords are the function's
    (``ops.common.module_form``).
    """

    function = staticmethod(linear_log_probs)

    def check(self, values: dict) -> dict:
        LogProbOptions.checked(temperature=values["temperature"], entropy=values["entropy"],
                               softcap=values["softcap"], ignore_index=values["ignore_index"])
        return values

    def forward(self, x: Tensor, weight: Tensor, tokens: Tensor, bias: Optional[Tensor] = None):
        return linear_log_probs(x, weight, tokens, bias, **self.kwargs)
