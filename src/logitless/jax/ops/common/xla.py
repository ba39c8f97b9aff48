"""The "xla" backend kind: plain JAX, every platform, every case. Its Config and the base
of every op's ``XlaBackend`` (``contract`` says what an op's class adds)."""

from __future__ import annotations

from dataclasses import dataclass

import jax.numpy as jnp

from logitless.jax.ops.common.contract import BackendBase
from logitless.jax.planning import XlaPlan, xla_plan


@dataclass(frozen=True)
class XlaConfig:
    """The "xla" backends' Config: the logits tile (``planning.xla_plan``) and the weight's layout."""

    plan: XlaPlan
    weight_layout: str = "vh"


class XlaBase(BackendBase):
    """The "xla" kind: takes every case (``why_not`` None), may be partitioned, plans the
    logits tile from the budget."""

    name = "xla"

    def can_partition(self) -> bool:
        return True

    def plan(self, x2d_shape, w_shape, dtype, *, budget: int, weight_layout: str = "vh",
             has_bias: bool = False) -> XlaConfig:
        n, h = x2d_shape
        return XlaConfig(xla_plan(n, w_shape[0], h, jnp.dtype(dtype).itemsize, budget), weight_layout)
