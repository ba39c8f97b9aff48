"""Public API of log_probs: per-token log-probabilities (and entropy) at a temperature
from logits the caller already holds, in one bandwidth-bound pass."""

from __future__ import annotations

from typing import Union

from torch import Tensor

from logitless.formulas import truncation as _truncation
from logitless.ops.common import validate as _validate
from logitless.ops.common.contract import BackendTable, Lazy, TritonKind
from logitless.ops.common.glue import HOST_SYNCS
from logitless.ops.common.module_form import ModuleForm
from logitless.ops.common.validate import resolve_backend
from logitless.options import DEFAULT_MEMORY_BUDGET, LogProbOptions

from . import custom_op
from .contract import LpBackend, LpCall
from .torch_backend import TorchBackend


def _triton() -> LpBackend:
    from .triton_backend import TritonBackend

    return TritonBackend()


#: The implementations of log_probs, by ``backend=`` name (``contract.LpBackend``; "auto"
#: resolves to one of them, ``ops.common.validate.resolve_backend``); each runs the
#: truncated and batch-invariant calls too (a Config of theirs, ``contract.Blocks``).
#: Triton's is made on first use (its module needs the optional package).
BACKENDS: BackendTable[LpBackend] = BackendTable(triton=Lazy(TritonKind, _triton), torch=TorchBackend)
#: The custom-op pair (logitless::lp_forward / lp_backward) over the table; a truncated
#: call's (top-k / top-p / min-p: its host syncs choose its route) is another pair of the
#: same bodies, which CUDA-graph trees run between their graphs (``glue.HOST_SYNCS``).
OPS = custom_op.define(BACKENDS)
TRUNCATED_OPS = custom_op.define(BACKENDS, name="lp_truncated", tags=HOST_SYNCS)


def log_probs(
    logits: Tensor,
    tokens: Tensor,
    *,
    temperature: float = 1.0,
    entropy: bool = False,
    ignore_index: int = -100,
    backend: str = "auto",
    top_k=None,
    top_p=1.0,
    min_p=0.0,
    batch_invariant: bool = False,
) -> Union[Tensor, tuple[Tensor, Tensor]]:
    """log softmax(logits / T)[token] per token, and with ``entropy=True`` the entropy
    of softmax(logits / T): TRL's ``selective_log_softmax`` and ``entropy_from_logits``
    in one pass.

    Statistics in fp32 (fp64 for fp64 logits on backend="torch"); the division by T is
    done in fp32. Memory traffic (Triton, CUDA): the forward reads the logits once and
    writes O(tokens); the backward reads them once and writes d(logits) once (in the
    logits' dtype); extra memory O(tokens) besides that gradient. The torch backend
    upcasts rows in chunks of at most the default memory budget. Gradients from both
    outputs, with any upstream gradient, reach the logits; torch.compile traces the
    custom ops ``logitless::lp_forward``/``lp_backward`` without graph breaks.

    Args:
        logits: (..., V) float16/bfloat16/float32 (float64 on backend="torch"); any strides
            on the Triton backend (read in place).
        tokens: (...) int64 or int32, the leading shape of logits.
        temperature: finite float > 0 (else ValueError).
        entropy: also return the entropy per token.
        ignore_index: tokens equal to it give 0 for both outputs and no gradient.
        backend: "auto" (Triton on CUDA, PyTorch elsewhere), "triton" or "torch".
        top_k, top_p, min_p: the distribution vLLM samples from, as in
            ``linear_log_probs`` (numbers or per-token tensors; off: 0/None, 1, 0).
        batch_invariant: per-token outputs bitwise the same whatever the batch.
            With either, plain torch ops on blocks of 64 rows (``ops.log_probs.truncation``,
            a Config of either backend): a few passes over the logits, nothing of
            their size kept for the backward.

    Returns:
        logp (fp32, tokens' shape), or ``(logp, entropy)`` with ``entropy=True``.

    A token outside [0, V) that is not ``ignore_index`` raises ``ValueError`` on the
    CPU and gives NaN for that token on a GPU (no host sync).
    """
    opts = LogProbOptions.checked(temperature=temperature, entropy=entropy, ignore_index=ignore_index)
    _validate.check_not_dtensor("log_probs", logits=logits)
    _validate.check_float("logits", logits)
    if logits.dim() < 1 or logits.shape[-1] == 0:
        raise ValueError(f"logits must have shape (..., V) with V >= 1, got {tuple(logits.shape)}")
    if not isinstance(tokens, Tensor):
        raise TypeError(f"tokens must be a torch.Tensor, got {type(tokens).__name__}")
    if tokens.dtype not in _validate.TARGET_DTYPES:
        raise TypeError(f"tokens must be int64 or int32, got {tokens.dtype}")
    if tokens.shape != logits.shape[:-1]:
        raise ValueError(f"tokens has shape {tuple(tokens.shape)}, expected {tuple(logits.shape[:-1])} "
                         "(the leading dimensions of logits)")
    _validate.check_same_device(logits=logits, tokens=tokens)
    impl = resolve_backend(backend, logits.device, logits.dtype, BACKENDS)
    trunc = None
    if top_k is not None or isinstance(top_p, Tensor) or isinstance(min_p, Tensor) or top_p != 1.0 \
            or min_p != 0.0:
        trunc = _truncation.check(top_k, top_p, min_p, tokens.shape, tokens.device)
    flat = logits.reshape(-1, logits.shape[-1])
    flat_tokens = tokens.reshape(-1).long()
    k = p = mp = None
    k_max, checked = -1, True
    if trunc is not None or batch_invariant is not False:
        if not isinstance(batch_invariant, bool):
            raise TypeError(f"batch_invariant must be a bool, got {type(batch_invariant).__name__}")
        if trunc is not None:
            k, p, mp, checked = trunc.top_k, trunc.top_p, trunc.min_p, trunc.checked
            k_max = -1 if trunc.k_max is None else trunc.k_max
    elif flat.stride(-1) != 1 and not BACKENDS[impl].strided_logits:
        flat = flat.contiguous()
    call = LpCall(flat, flat_tokens, opts, impl, DEFAULT_MEMORY_BUDGET, k, p, mp, checked, k_max, batch_invariant)
    logp, ent, *_ = (OPS if k is None else TRUNCATED_OPS)(call)
    logp = logp.reshape(tokens.shape)
    if not opts.entropy:
        return logp
    assert ent is not None  # (opts.entropy)
    return logp, ent.reshape(tokens.shape)


class LogProbs(ModuleForm):
    """Module form of :func:`log_probs`: ``LogProbs(temperature=0.7, entropy=True)(logits, tokens)``;
    its keywords are the function's (``ops.common.module_form``)."""

    function = staticmethod(log_probs)

    def check(self, values: dict) -> dict:
        LogProbOptions.checked(temperature=values["temperature"], entropy=values["entropy"],
                               ignore_index=values["ignore_index"])
        return values

    def forward(self, logits: Tensor, tokens: Tensor):
        return log_probs(logits, tokens, **self.kwargs)



