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

from collections.abc import Mapping
from typing import Optional

from torch import Tensor

from logitless.formulas.common import reduce
from logitless.formulas.cross_entropy import token_loss
from logitless.helion_lib import linear_cross_entropy as kernels
from logitless.ops.common import helion_choice
from logitless.ops.common.contract import HelionKind
from logitless.options import CrossEntropyOptions

from .contract import HelionConfig, LceBackend, LceForward
from .torch_backend import grad_coefficients


class HelionBackend(HelionKind):
    """backend="helion" (``contract.LceBackend``). Its Config (``HelionConfig``) says whether
    Helion runs the call or which backend runs in its place (that backend's Config in it,
    planned with nothing kept), and the backward's budget (the kernels size their
    vocabulary chunks from it). ``others``: the backends by name (``api.BACKENDS``)."""


    def __init__(self, others: Mapping[str, LceBackend]):
        self.others = others


    def plan(self, x: Tensor, weight: Tensor, bias: Optional[Tensor], class_weight: Optional[Tensor],
             opts: CrossEntropyOptions, *, budget: int, need_grad: bool, need_argmax: bool,
             grad_in_forward: bool = False, need_dw: bool = True, cute: bool = True,
             kept_owned: bool = True) -> HelionConfig:
        other = helion_choice.fallback_name_of_call(x.device)
        if other is None:
            return HelionConfig(budget=budget)
        config = self.others[other].plan(x, weight, bias, class_weight, opts, budget=budget, need_grad=False,
                                         need_argmax=need_argmax, need_dw=need_dw, cute=cute)
        return HelionConfig(torch=config) if other == "torch" else HelionConfig(triton=config)

    def _other(self, config: HelionConfig):
        """(the backend in Helion's place, its Config), or (None, None)."""
        return helion_choice.in_place(self.others, config.torch, config.triton)

    def _failed_over(self, x, weight, bias, class_weight, opts, config: HelionConfig):
        """After a Helion kernel failed on a GPU (``helion_choice.guarded``): the backend that
        runs this call instead and its Config (later calls choose it in ``plan``)."""
        return self._other(self.plan(x, weight, bias, class_weight, opts, budget=config.budget, need_grad=False,
                                     need_argmax=False))

    def kept_shapes(self, config: HelionConfig, n: int) -> None:
        return None

    def forward(self, x: Tensor, weight: Tensor, bias: Optional[Tensor], target: Tensor,
                class_weight: Optional[Tensor], opts: CrossEntropyOptions, config: HelionConfig, *,
                need_argmax: bool, loss: bool = True, need_dx: bool = False, need_dw: bool = False,
                need_db: bool = False) -> LceForward:
        """fp32 statistics, nothing kept; the loss from the formulas."""
        other, other_config = self._other(config)
        if other is not None:
            return other.forward(x, weight, bias, target, class_weight, opts, other_config, need_argmax=need_argmax,
                                 loss=loss)

        def helion_path():
            stats = kernels.lce_forward(x, weight, bias, target, class_weight, opts, need_argmax=need_argmax)
            if not loss:
                return LceForward(stats)
            loss_tok, w_t = token_loss(stats, target, weight.shape[0], class_weight, opts)
            return LceForward(stats, reduce(loss_tok, w_t, opts.reduction), w_t)

        def failed_over():
            impl, c = self._failed_over(x, weight, bias, class_weight, opts, config)
            return impl.forward(x, weight, bias, target, class_weight, opts, c, need_argmax=need_argmax, loss=loss)

        return helion_choice.guarded(x.device, helion_path, failed_over)

    grad_coefficients = staticmethod(grad_coefficients)

    def backward(self, x: Tensor, weight: Tensor, bias: Optional[Tensor], target: Tensor,
                 class_weight: Optional[Tensor], softcap: Optional[float], lse: Tensor, coef: Tensor,
                 config: HelionConfig, *, kept=None, need_dx: bool, need_dw: bool, need_db: bool,
                 dx_acc: bool = False):
        """dx, dW, db (None where not needed; db in the bias dtype); ``dx_acc``: dx in fp32,
        not cast to x's dtype (a partial sum that the caller reduces first)."""
        other, other_config = self._other(config)
        if other is not None:
            return other.backward(x, weight, bias, target, class_weight, softcap, lse, coef, other_config, kept=None,
                                  need_dx=need_dx, need_dw=need_dw, need_db=need_db, dx_acc=dx_acc)

        def helion_path():
            if not (need_dx or need_dw or need_db):
                return None, None, None
            # (the class weights in dz whenever given: its C term is 0 without label smoothing)
            dx, dw, db = kernels.lce_backward(x, weight, bias, target, class_weight, lse, coef, softcap,
                                              need_dx=need_dx,
                                              need_dw=need_dw or need_db, budget=config.budget, dx_acc=dx_acc)
            if not need_db or db is None or bias is None:  # (need_db: a bias, and db came with dW)
                return dx, dw if need_dw else None, None
            return dx, dw if need_dw else None, db.to(bias.dtype)

        def failed_over():
            opts = CrossEntropyOptions(softcap=softcap)
            impl, c = self._failed_over(x, weight, bias, class_weight, opts, config)
            return impl.backward(x, weight, bias, target, class_weight, softcap, lse, coef, c, kept=None,
                                 need_dx=need_dx, need_dw=need_dw, need_db=need_db, dx_acc=dx_acc)

        return helion_choice.guarded(x.device, helion_path, failed_over)
