"""Float64 reference of linear_cross_entropy: the plain definition, logits materialised.

The logits x @ W.T + b, then the cross_entropy reference, which calls torch's own
``F.cross_entropy``: independent of ``formulas.cross_entropy`` on purpose, so that tests compare
every backend against torch's semantics, not against our formulas. With ``dtype`` set
to the inputs' dtype it is "plain torch in the same dtype", the tests' yardstick.
Use only at test sizes (it allocates the full logits).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from logitless.ops.common.reference import cross_entropy_reference


def linear_cross_entropy_reference(x: Tensor, weight: Tensor, target: Tensor, bias: Optional[Tensor] = None, *,
                                   shift: bool = False, dtype: torch.dtype = torch.float64, **kw):
    """Returns (loss, lse, correct) in ``dtype`` (lse, correct per token, shape of the
    loss positions). Differentiable with respect to x, weight and bias. ``kw``: the
    options of ``cross_entropy_reference`` (class_weight and the cross-entropy options)."""
    logits = x.to(dtype) @ weight.to(dtype).T
    if bias is not None:
        logits = logits + bias.to(dtype)
    if shift:
        logits, target = logits[..., :-1, :], target[..., 1:]
    return cross_entropy_reference(logits, target, dtype=dtype, **kw)
