"""What every fused op's gradient-in-forward strategy shares (linear_cross_entropy,
linear_jsd): the forward computes the gradients for a unit upstream gradient, the
backward only scales them (``scale_grads``)."""

from __future__ import annotations

from torch import Tensor


def scale_grads(grads, grad_output: Tensor, x_dtype, w_dtype):
    """The backward of the strategy: multiply the forward's gradients (dx, dW, db; fp32
    or None) by grad_output (a scalar).

    In place (no fp32 copy of a 16-bit gradient: the product is computed in fp32 per
    element and rounded once); the buffers must not be used again."""
    dx, dw, db = grads
    g = grad_output.float()
    out_dx = dx.mul_(g).to(x_dtype) if dx is not None else None
    out_dw = dw.mul_(g).to(w_dtype) if dw is not None else None
    out_db = db.mul_(g).to(w_dtype) if db is not None else None
    return out_dx, out_dw, out_db
