"""The autograd glue of the torch.library custom ops, shared by every op.

Each op is a forward and a backward custom op whose arguments are tensors, then the
fields of its options dataclass (``logitless.options``, under their own names), then
execution arguments (backend, budget, flags). ``named`` reads a custom op's inputs by
argument name in ``setup_context``; ``guard_double_backward`` makes a second-order
gradient raise one clear error; ``under_forward_overrides`` runs a backward under the
planner overrides of its forward; ``EAGER`` maps each custom op to its Python
implementation (tests run them under dispatch modes, which otherwise see a custom op
as one opaque call).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Optional

import torch
from torch import Tensor

from logitless.planning import overrides as _overrides

#: "logitless::<name>" -> the Python implementation behind the custom op.
EAGER: dict[str, Callable] = {}


def custom_op(name: str, fn: Callable, *, mutates_args=()):
    """``torch.library.custom_op("logitless::<name>", fn)``, registered in ``EAGER``."""
    EAGER[f"logitless::{name}"] = fn
    return torch.library.custom_op(f"logitless::{name}", fn, mutates_args=mutates_args)


@functools.cache
def _parameters(fn: Callable) -> tuple:
    return tuple(inspect.signature(fn).parameters.values())


def named(fn: Callable, inputs: tuple) -> dict:
    """A custom op's inputs by the argument names of its implementation ``fn``; trailing
    arguments left out of ``inputs`` (a compiled graph drops defaulted ones) get ``fn``'s
    defaults."""
    params = _parameters(fn)
    out = dict(zip((p.name for p in params), inputs))
    for p in params[len(inputs):]:
        if p.default is inspect.Parameter.empty:
            raise TypeError(f"{fn.__name__}: argument {p.name!r} missing")
        out[p.name] = p.default
    return out


def under_forward_overrides(setup_context: Callable, backward: Callable) -> tuple[Callable, Callable]:
    """(setup_context, backward) of ``register_autograd`` such that the backward runs under
    the planner overrides (``logitless.planning.overrides``) in effect at the forward.
    Autograd runs the backward of CUDA tensors on a device thread of its own, where the
    caller's ``override(...)`` context is not in effect (it is on CPU, in the caller's
    thread): without this a backward that re-plans (no kept columns) or reads an
    override (``tf32_preround``, tiles, ``plan``) would follow the defaults on GPUs only."""

    @functools.wraps(setup_context)
    def setup(ctx, inputs, output):
        ctx.overrides = _overrides.current()
        return setup_context(ctx, inputs, output)

    @functools.wraps(backward)
    def run(ctx, *grads):
        with _overrides.restored(ctx.overrides):
            return backward(ctx, *grads)

    return setup, run


class NoDoubleBackward(torch.autograd.Function):
    """Identity on first-order gradients computed with create_graph=True; differentiating
    them again raises one clear error."""

    @staticmethod
    def forward(ctx, op: str, *tensors):
        ctx.op = op
        return tensors

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError(
            f"logitless.{ctx.op}: double backward (differentiating its gradients, e.g. after "
            "torch.autograd.grad(..., create_graph=True)) is not supported"
        )


def guard_double_backward(op: str, grads: tuple, *inputs: Optional[Tensor]) -> tuple:
    """``grads`` unchanged, unless the backward runs with create_graph=True: then wrapped
    so that their own backward raises (``inputs`` make the wrapper part of the graph)."""
    if not torch.is_grad_enabled():
        return grads
    present = [i for i, g in enumerate(grads) if g is not None]
    extra = [t for t in inputs if t is not None and t.requires_grad]
    wrapped = NoDoubleBackward.apply(op, *[grads[i] for i in present], *extra)
    out = list(grads)
    for k, i in enumerate(present):
        out[i] = wrapped[k]
    return tuple(out)


def grad_outputs(x: Tensor, dx: Optional[Tensor], dw: Optional[Tensor], db: Optional[Tensor],
                 need_dx: bool, need_dw: bool, need_db: bool) -> tuple[Tensor, Tensor, Tensor]:
    """The (dx, dw, db) outputs of a backward custom op: each gradient where needed, else
    a size-0 tensor of x's dtype and device (distinct ones: a custom op's outputs may
    not alias each other)."""
    nothing = x.new_empty(0)
    return (dx if need_dx else nothing, dw if need_dw else nothing.clone(), db if need_db else nothing.clone())


def fake_grad_outputs(x: Tensor, weight: Tensor, bias: Optional[Tensor], need_dx: bool, need_dw: bool,
                      need_db: bool) -> tuple[Tensor, Tensor, Tensor]:
    """``grad_outputs`` of a backward custom op's fake: gradients shaped like x, weight
    and bias where needed."""
    return grad_outputs(x, torch.empty_like(x) if need_dx else None, torch.empty_like(weight) if need_dw else None,
                        torch.empty_like(bias) if need_db else None, need_dx, need_dw, need_db)


def zero_grads(x: Tensor, weight: Tensor, bias: Optional[Tensor]):
    """(dx, dw, db) of an op on no tokens: zeros (db None without a bias)."""
    return torch.zeros_like(x), torch.zeros_like(weight), torch.zeros_like(bias) if bias is not None else None
