"""Launch functions of the Helion linear_log_probs kernels (``log_probs_kernels``).

2-D x (N, H), weight (V, H), optional bias (V,), int64 tokens (N,). The forward returns
``formulas.log_probs.LogProbStats`` (fp32); the backward takes the (3, N) coefficients of
``formulas.log_probs.grad_coefficients`` (0 at ignored tokens) and returns dx, dW, db.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from logitless.formulas.log_probs import LogProbStats
from logitless.helion_lib import configs
from logitless.helion_lib.runtime import launch, require
from logitless.options import LogProbOptions


def _sizes(x: Tensor, weight: Tensor) -> dict:
    return {"n": x.shape[0], "v": weight.shape[0], "h": x.shape[1]}


def _scalars(opts: LogProbOptions) -> tuple:
    cap = float(opts.softcap) if opts.softcap is not None else 1.0
    return cap, 1.0 / opts.temperature


def forward_args(x, weight, bias, tokens, opts) -> tuple:
    cap, inv_t = _scalars(opts)
    return (x, weight, bias, tokens, cap, inv_t, opts.softcap is not None, bool(opts.entropy))


def backward_args(x, weight, bias, tokens, lse, coef, opts) -> tuple:
    cap, inv_t = _scalars(opts)
    return (x, weight, bias, tokens, lse.float().contiguous(), coef.float().contiguous(), cap, inv_t,
            opts.softcap is not None, bool(opts.entropy))


def logp_forward(x: Tensor, weight: Tensor, bias: Optional[Tensor], tokens: Tensor, opts: LogProbOptions,
                 config: Optional[dict] = None) -> LogProbStats:
    """(lse, a at the token, H or None) per token, fp32, of a = softcap(x W^T + b) / T."""
    require()
    from logitless.helion_lib import log_probs_kernels as K

    if x.shape[0] == 0:
        e = x.new_empty((0,), dtype=torch.float32)
        return LogProbStats(e, e, e if opts.entropy else None)
    cfg = config or configs.pick("logp_forward", _sizes(x, weight), x.device)
    lse, at, ent = launch(K.logp_forward, forward_args(x, weight, bias, tokens, opts), cfg)
    return LogProbStats(lse, at, ent if opts.entropy else None)


def logp_backward(x: Tensor, weight: Tensor, bias: Optional[Tensor], tokens: Tensor, lse: Tensor, coef: Tensor,
                  opts: LogProbOptions, configs_: Optional[tuple[dict, dict]] = None,
                  need_dx: bool = True, need_dw: bool = True
                  ) -> tuple[Optional[Tensor], Optional[Tensor], Optional[Tensor]]:
    """(dx, dW, db or None); db in fp32.
    ``need_dx`` / ``need_dw`` False skip that kernel (None in its place; db comes with dW).
    """
    require()
    from logitless.helion_lib import log_probs_kernels as K

    if x.shape[0] == 0:
        db = torch.zeros(weight.shape[0], dtype=torch.float32, device=x.device) if bias is not None else None
        return torch.zeros_like(x), torch.zeros_like(weight), db
    sizes = _sizes(x, weight)
    cfg_dx, cfg_dw = configs_ or (configs.pick("logp_dx", sizes, x.device), configs.pick("logp_dw", sizes, x.device))
    args = backward_args(x, weight, bias, tokens, lse, coef, opts)
    dx = launch(K.logp_dx, args, cfg_dx) if need_dx else None
    dw, db = launch(K.logp_dw, args, cfg_dw) if need_dw else (None, None)
    return dx, dw, (db if bias is not None else None)
