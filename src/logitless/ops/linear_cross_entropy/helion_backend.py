"""Helion backend of linear_cross_entropy (``backend="helion"``; docs/helion.md).

forward:  one Helion kernel (``helion_lib.ce_kernels.ce_forward``): per row tile an online
          log-sum-exp over vocabulary tiles with the target logit, sum_c w_c z_c (label
          smoothing) and the first argmax; the loss from those statistics with the formulas
          (``formulas.cross_entropy.token_loss``), as the torch backend.
backward: the formulas' (3, N) coefficients, then per vocabulary chunk (sized by the memory
          budget) one kernel that recomputes the logits tiles into d(logits)
          (``helion_lib.grad_kernels.linear_dlogits``) and cuBLAS GEMMs for dX (fp32
          accumulator over chunks), dW and db. Nothing is kept from the forward.

Every option of the op: bias, soft-cap, class weights, label smoothing, z-loss (through
the coefficients), ignore_index, reductions, return_stats' argmax, vocabulary parallelism
(``vocab_parallel`` calls this module's forward/backward on a rank's rows; its dx stays
the fp32 accumulator until the all-reduce, ``dx_acc``). Kernels compute in fp32; fp64
inputs are refused (``resolve_backend``).
Without a usable Helion the Triton (CUDA) or torch (CPU) backend runs, with one warning
(``ops.common.helion_choice``).
"""

from __future__ import annotations

from typing import Optional

from torch import Tensor

from logitless.formulas.common import reduce
from logitless.formulas.cross_entropy import token_loss
from logitless.helion_lib import linear_cross_entropy as kernels
from logitless.ops.common.helion_choice import run_or_fallback
from logitless.options import CrossEntropyOptions

# The formulas, and no plan or kept buffers crossing to the backward: as the torch backend (the
# kernels take their configs per launch, ``helion_lib.configs``; a fallback backend plans for itself).
from .torch_backend import grad_coefficients, kept_shapes, plan  # noqa: F401


def _other_plan(impl, x, weight, bias, class_weight, softcap, budget, need_argmax=False, smooth=False):
    """The fallback backend's plan of this call (nothing kept)."""
    return impl.plan(x, weight, bias, class_weight, _launch_opts(softcap, smooth), budget=budget, need_grad=False,
                     need_argmax=need_argmax)


def _launch_opts(softcap: Optional[float], smooth: bool) -> CrossEntropyOptions:
    """Options carrying what the kernels read: the soft-cap, and whether the smoothing sum
    (forward) or the class weights in dz's C term (backward) are wanted."""
    return CrossEntropyOptions(label_smoothing=0.5 if smooth else 0.0, softcap=softcap)


def forward(
    x: Tensor,
    weight: Tensor,
    bias: Optional[Tensor],
    target: Tensor,
    class_weight: Optional[Tensor],
    softcap: Optional[float],
    *,
    need_smooth: bool,
    need_argmax: bool,
    budget: int,
    plan=None,  # noqa: F811  (the contract's keyword; the module's ``plan`` is the torch backend's)
    loss_opts: Optional[CrossEntropyOptions] = None,
):
    """(TokenStats, None): fp32 statistics, nothing kept. With ``loss_opts``: (TokenStats,
    None, loss, w_t), the loss from the formulas. ``budget`` only reaches a fallback
    backend (which then keeps nothing either)."""
    def helion_path():
        stats = kernels.lce_forward(x, weight, bias, target, class_weight, _launch_opts(softcap, need_smooth),
                                    need_argmax=need_argmax)
        if loss_opts is None:
            return stats, None
        loss_tok, w_t = token_loss(stats, target, weight.shape[0], class_weight, loss_opts)
        return stats, None, reduce(loss_tok, w_t, loss_opts.reduction), w_t

    def other_path(impl):
        return impl.forward(x, weight, bias, target, class_weight, softcap, need_smooth=need_smooth,
                            need_argmax=need_argmax, budget=budget, loss_opts=loss_opts,
                            plan=_other_plan(impl, x, weight, bias, class_weight, softcap, budget, need_argmax,
                                             need_smooth))

    return run_or_fallback(__package__, x.device, helion_path, other_path)


def backward(
    x: Tensor,
    weight: Tensor,
    bias: Optional[Tensor],
    target: Tensor,
    class_weight: Optional[Tensor],
    softcap: Optional[float],
    lse: Tensor,
    coef: Tensor,
    *,
    need_dx: bool,
    need_dw: bool,
    need_db: bool,
    budget: int,
    plan=None,  # noqa: F811  (the contract's keyword; the module's ``plan`` is the torch backend's)
    kept=None,
    dx_acc: bool = False,
):
    """dx, dW, db (None where not needed; db in the bias dtype); ``dx_acc``: dx in fp32,
    not cast to x's dtype (a partial sum that the caller reduces first)."""
    def helion_path():
        if not (need_dx or need_dw or need_db):
            return None, None, None
        # C (the class-weighted smoothing term) is 0 without label smoothing: with class
        # weights the kernel reads them, and C w_c adds nothing then.
        opts = _launch_opts(softcap, class_weight is not None)
        dx, dw, db = kernels.lce_backward(x, weight, bias, target, class_weight, lse, coef, opts,
                                          need_dx=need_dx, need_dw=need_dw or need_db, budget=budget,
                                          dx_acc=dx_acc)
        return dx, dw if need_dw else None, db.to(bias.dtype) if need_db else None

    def other_path(impl):
        return impl.backward(x, weight, bias, target, class_weight, softcap, lse, coef, need_dx=need_dx,
                             need_dw=need_dw, need_db=need_db, budget=budget, dx_acc=dx_acc,
                             plan=_other_plan(impl, x, weight, bias, class_weight, softcap, budget))

    return run_or_fallback(__package__, x.device, helion_path, other_path)
