"""Float64 reference of linear_jsd: both heads' logits materialised, then jsd's reference.

With ``dtype`` set to the inputs' dtype it is "plain torch in the same dtype" (the
tests' yardstick). Use only at test sizes (it allocates both tokens x vocab logits).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from logitless.ops.common.reference import jsd_reference


def linear_jsd_reference(
    student_x: Tensor,
    student_weight: Tensor,
    teacher_x: Tensor,
    teacher_weight: Tensor,
    target: Optional[Tensor] = None,
    *,
    student_bias: Optional[Tensor] = None,
    teacher_bias: Optional[Tensor] = None,
    shift: bool = False,
    dtype: torch.dtype = torch.float64,
    **kw,
) -> Tensor:
    """The loss in ``dtype``; differentiable with respect to the student's tensors.
    ``kw``: beta, temperature, ignore_index, reduction, softcaps, hard_label_weight."""
    zs = student_x.to(dtype) @ student_weight.to(dtype).T
    zt = teacher_x.to(dtype) @ teacher_weight.to(dtype).T
    if student_bias is not None:
        zs = zs + student_bias.to(dtype)
    if teacher_bias is not None:
        zt = zt + teacher_bias.to(dtype)
    if shift:
        zs, zt = zs[..., :-1, :], zt[..., :-1, :]
        target = target[..., 1:] if target is not None else None
    return jsd_reference(zs, zt, target, dtype=dtype, **kw)
