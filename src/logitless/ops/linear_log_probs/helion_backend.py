"""Helion backend of linear_log_probs (``backend="helion"``; docs/helion.md).

forward:  one Helion kernel (``helion_lib.log_probs_kernels.logp_forward``): per row tile
          the online (m, s, u) over vocabulary tiles of a = softcap(x W^T + b) / T and the
          token's a; log-probs and entropy from them with the formulas
          (``formulas.log_probs.token_outputs``), as the torch backend.
backward: the formulas' (3, N) coefficients, then per vocabulary chunk one kernel
          recomputing the tiles into d(logits) (``helion_lib.grad_kernels.linear_dlogits``)
          and cuBLAS GEMMs for dX, dW, db. Nothing is kept from the forward.

Every option of the op: temperature, entropy, soft-cap, bias, ignore_index, vocabulary
parallelism (``vocab_parallel`` calls this module on a rank's rows; its dx stays the
fp32 accumulator until the all-reduce, ``dx_acc``).
Without a usable Helion the Triton (CUDA) or torch (CPU) backend runs, with one warning
(``ops.common.helion_choice``): decided in ``plan`` (``contract.HelionConfig``), followed by
the backward. Truncated / batch-invariant calls run on that backend (``truncates`` False: ``api``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Optional

from torch import Tensor

from logitless.formulas.log_probs import token_outputs
from logitless.helion_lib import linear_log_probs as kernels
from logitless.ops.common import helion_choice
from logitless.ops.common.contract import HelionKind
from logitless.options import LogProbOptions

from .contract import HelionConfig, LlpBackend
from .torch_backend import TorchBackend


class HelionBackend(HelionKind):
    """backend="helion" (``contract.LlpBackend``). Its Config (``HelionConfig``) says whether
    Helion runs the call or which backend runs in its place (that backend's Config in it,
    planned with nothing kept), and the backward's budget. ``others``: the backends by name
    (``api.BACKENDS``)."""

    grad_coefficients = staticmethod(TorchBackend.grad_coefficients)
    truncates = False  # (no threshold kernels: ``api`` runs such calls on the backend in Helion's place)
    threshold_search = False

    def __init__(self, others: Mapping[str, LlpBackend]):
        self.others = others


    def plan(self, x: Tensor, weight: Tensor, bias: Optional[Tensor], opts: LogProbOptions, *, budget: int,
             need_grad: bool, need_dw: bool = True, truncated: bool = False, k_max: int = -1, block: int = 0,
             parallel: bool = False, plan_rows: Optional[int] = None, cute: bool = True,
             kept_owned: bool = True) -> HelionConfig:
        other = helion_choice.fallback_name_of_call(x.device)
        if other is None:
            return HelionConfig(budget=budget)
        config = self.others[other].plan(x, weight, bias, opts, budget=budget, need_grad=False, need_dw=need_dw,
                                         cute=cute)
        return HelionConfig(torch=config) if other == "torch" else HelionConfig(triton=config)

    def _other(self, config: HelionConfig):
        """(the backend in Helion's place, its Config), or (None, None)."""
        return helion_choice.in_place(self.others, config.torch, config.triton)

    def _failed_over(self, x, weight, bias, opts, config: HelionConfig):
        """After a Helion kernel failed on a GPU (``helion_choice.guarded``): the backend that
        runs this call instead and its Config (later calls choose it in ``plan``)."""
        return self._other(self.plan(x, weight, bias, opts, budget=config.budget, need_grad=False))

    def kept_shapes(self, config: Any, n: int) -> None:
        return None

    def forward(self, x: Tensor, weight: Tensor, bias: Optional[Tensor], tokens: Tensor, opts: LogProbOptions,
                config: HelionConfig, *, outputs: bool = True, tau: Optional[Tensor] = None, keep: bool = True):
        """fp32 statistics, nothing kept; log-probs and entropy from the formulas."""
        other, other_config = self._other(config)
        if other is not None:
            return other.forward(x, weight, bias, tokens, opts, other_config, outputs=outputs)

        def helion_path():
            stats = kernels.logp_forward(x, weight, bias, tokens, opts)
            if outputs:
                logp, ent = token_outputs(stats, tokens, weight.shape[0], opts)
                return (logp, ent, stats.lse), None
            return stats, None

        def failed_over():
            impl, c = self._failed_over(x, weight, bias, opts, config)
            return impl.forward(x, weight, bias, tokens, opts, c, outputs=outputs)

        return helion_choice.guarded(x.device, helion_path, failed_over)

    def backward(self, x: Tensor, weight: Tensor, bias: Optional[Tensor], tokens: Tensor, opts: LogProbOptions,
                 lse: Tensor, coef: Tensor, config: HelionConfig, *, kept=None, need_dx: bool, need_dw: bool,
                 need_db: bool, dx_acc: bool = False, tau: Optional[Tensor] = None):
        """dx, dW, db (None where not needed; db in the bias dtype); ``dx_acc``: dx in fp32,
        not cast to x's dtype (a partial sum the caller reduces first: vocab parallelism)."""
        other, other_config = self._other(config)
        if other is not None:
            return other.backward(x, weight, bias, tokens, opts, lse, coef, other_config, kept=None,
                                  need_dx=need_dx, need_dw=need_dw, need_db=need_db, dx_acc=dx_acc)

        def helion_path():
            if not (need_dx or need_dw or need_db):
                return None, None, None
            dx, dw, db = kernels.logp_backward(x, weight, bias, tokens, lse, coef, opts, need_dx=need_dx,
                                               need_dw=need_dw or need_db, budget=config.budget, dx_acc=dx_acc)
            if not need_db or db is None or bias is None:  # (need_db: a bias, and db came with dW)
                return dx, dw if need_dw else None, None
            return dx, dw if need_dw else None, db.to(bias.dtype)

        def failed_over():
            impl, c = self._failed_over(x, weight, bias, opts, config)
            return impl.backward(x, weight, bias, tokens, opts, lse, coef, c, kept=None, need_dx=need_dx,
                                 need_dw=need_dw, need_db=need_db, dx_acc=dx_acc)

        return helion_choice.guarded(x.device, helion_path, failed_over)
