"""Launch functions of the Helion linear_log_probs kernels (``log_probs_kernels``, ``grad_kernels``).

2-D x (N, H), weight (V, H), optional bias (V,), int64 tokens (N,). The forward returns
``formulas.log_probs.LogProbStats`` (fp32); the backward takes the (3, N) coefficients of
``formulas.log_probs.grad_coefficients`` (0 at ignored tokens) and returns dx, dW, db.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from logitless.formulas.log_probs import LogProbStats, merge_splits
from logitless.helion_lib import configs
from logitless.helion_lib.runtime import launch, require
from logitless.options import LogProbOptions


def _scalars(opts: LogProbOptions) -> tuple:
    cap = float(opts.softcap) if opts.softcap is not None else 1.0
    return cap, 1.0 / opts.temperature


def forward_args(x, weight, bias, tokens, opts, span=None) -> tuple:
    """The arguments of ``log_probs_kernels.logp_forward``; ``span``: columns per vocabulary
    split (None: all V, one split)."""
    cap, inv_t = _scalars(opts)
    span = max(1, weight.shape[0]) if span is None else span
    return (x, weight, bias, tokens, cap, inv_t, span, opts.softcap is not None, bool(opts.entropy))


def backward_args(x, weight, bias, tokens, lse, coef, opts) -> tuple:
    """The arguments of ``grad_kernels.linear_dlogits`` (LOG_PROBS True), for all of V."""
    cap, inv_t = _scalars(opts)
    return (x, weight, bias, tokens, None, lse.float().contiguous(), coef.float().contiguous(), cap, inv_t,
            opts.softcap is not None, True, bool(opts.entropy))


def logp_forward(x: Tensor, weight: Tensor, bias: Optional[Tensor], tokens: Tensor, opts: LogProbOptions,
                 config: Optional[dict] = None) -> LogProbStats:
    """(lse, a at the token, H or None) per token, fp32, of a = softcap(x W^T + b) / T."""
    require()
    from logitless.helion_lib import log_probs_kernels as K

    if x.shape[0] == 0:
        e = x.new_empty((0,), dtype=torch.float32)
        return LogProbStats(e, e, e if opts.entropy else None)
    sizes = configs.sizes(x, weight)
    cfg = config or configs.pick("logp_forward", sizes, x.device)
    pm, ps, pu, at = launch(K.logp_forward, forward_args(x, weight, bias, tokens, opts,
                                                         configs.forward_span(cfg, sizes, x.device)), cfg)
    lse, ent = merge_splits(pm, ps, pu if opts.entropy else None)
    return LogProbStats(lse, at.sum(0), ent)


def logp_backward(x: Tensor, weight: Tensor, bias: Optional[Tensor], tokens: Tensor, lse: Tensor, coef: Tensor,
                  opts: LogProbOptions, config: Optional[dict] = None,
                  need_dx: bool = True, need_dw: bool = True, budget: Optional[int] = None,
                  chunk: Optional[int] = None, dx_acc: bool = False,
                  ) -> tuple[Optional[Tensor], Optional[Tensor], Optional[Tensor]]:
    """(dx, dW, db or None); db in fp32. As ``linear_cross_entropy.lce_backward``
    (``grad_kernels.backward``: dz per vocabulary chunk, cuBLAS for the gradients).
    """
    require()
    from logitless.helion_lib.grad_kernels import backward

    return backward(backward_args(x, weight, bias, tokens, lse, coef, opts), "logp", config, need_dx, need_dw,
                    budget=budget, chunk=chunk, dx_acc=dx_acc)
