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
(``ops.common.helion_choice``).
"""

from __future__ import annotations

from typing import Optional

from torch import Tensor

from logitless.formulas.log_probs import token_outputs
from logitless.helion_lib import linear_log_probs as kernels
from logitless.ops.common.helion_choice import run_or_fallback
from logitless.options import LogProbOptions

# The formulas, and no plan or kept buffers crossing to the backward: as the torch backend (the
# kernels take their configs per launch, ``helion_lib.configs``; a fallback backend plans for itself).
from .torch_backend import grad_coefficients, kept_shapes, plan  # noqa: F401


def _other_plan(impl, x, weight, bias, opts, budget):
    """The fallback backend's plan of this call (nothing kept)."""
    return impl.plan(x, weight, bias, opts, budget=budget, need_grad=False)


def forward(x: Tensor, weight: Tensor, bias: Optional[Tensor], tokens: Tensor, opts: LogProbOptions, *,
            budget: int, plan=None, outputs: bool = False):  # noqa: F811  (the contract's keyword)
    """(LogProbStats, None) (fp32, nothing kept). ``outputs``: ((logp, entropy or None,
    lse), None) instead. ``budget`` only reaches a fallback backend."""
    def helion_path():
        stats = kernels.logp_forward(x, weight, bias, tokens, opts)
        if outputs:
            logp, ent = token_outputs(stats, tokens, weight.shape[0], opts)
            return (logp, ent, stats.lse), None
        return stats, None

    def other_path(impl):
        return impl.forward(x, weight, bias, tokens, opts, budget=budget, outputs=outputs,
                            plan=_other_plan(impl, x, weight, bias, opts, budget))

    return run_or_fallback(__package__, x.device, helion_path, other_path)


def backward(x: Tensor, weight: Tensor, bias: Optional[Tensor], tokens: Tensor, opts: LogProbOptions,
             lse: Tensor, coef: Tensor, *, need_dx: bool, need_dw: bool, need_db: bool, budget: int,
             kept=None, plan=None, dx_acc: bool = False):  # noqa: F811  (the contract's keyword)
    """dx, dW, db (None where not needed; db in the bias dtype); ``dx_acc``: dx in fp32,
    not cast to x's dtype (a partial sum the caller reduces first: vocab parallelism)."""
    def helion_path():
        if not (need_dx or need_dw or need_db):
            return None, None, None
        dx, dw, db = kernels.logp_backward(x, weight, bias, tokens, lse, coef, opts, need_dx=need_dx,
                                           need_dw=need_dw or need_db, budget=budget, dx_acc=dx_acc)
        return dx, dw if need_dw else None, db.to(bias.dtype) if need_db else None

    def other_path(impl):
        return impl.backward(x, weight, bias, tokens, opts, lse, coef, need_dx=need_dx, need_dw=need_dw,
                             need_db=need_db, budget=budget, dx_acc=dx_acc,
                             plan=_other_plan(impl, x, weight, bias, opts, budget))

    return run_or_fallback(__package__, x.device, helion_path, other_path)
