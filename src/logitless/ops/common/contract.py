"""The backend contract every op's backends follow, and the custom-op glue written once against it.

An op has one class per backend (``ops/<op>/<backend>_backend.py``), listed by name in one
table in the op's ``api.py``; the op writes its contract as a ``typing.Protocol`` (e.g.
``ops.linear_cross_entropy.contract.LceBackend``) that extends ``Backend`` below with its
typed ``forward``/``backward``. Every backend answers:

- ``name``: its name in the table (the ``backend=`` argument, the custom ops' ``backend``);
- ``unsupported(device, dtype)``: None when it runs such a call, else the reason;
- ``plan(...)``: the call's Config, a frozen dataclass -- the ONLY place where heuristics
  decide (tiles, chunks, kept columns, strategies, fallbacks). Called once per call, by the
  forward; the forward, the backward and the gradient-in-forward strategy take that object;
- ``codec``: how its Config crosses a custom op (a ``ConfigCodec``: a CPU int64 tensor of a
  fixed length per Config class, ``plan_codec``): the backend owns the encoding.

The glue (``register_autograd``): an op writes its forward and backward custom ops
explicitly (schemas in their signatures, ``autograd.custom_op``), its ``setup_context`` and
autograd backward explicitly (what is saved, what the backward receives), and this module
wires them: the planner overrides of the forward in effect in the backward, and the eager
fast path (``autograd.EagerOp``: the same Python implementation without the dispatcher).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional, Protocol

import torch
from torch import Tensor

from logitless.ops.common import plan_codec
from logitless.ops.common.autograd import EagerOp, under_forward_overrides


class ConfigCodec:
    """A backend's Config class across the custom-op boundary: ``encode(config)`` (a
    Config of ``cls`` or None -> CPU int64 tensor), ``decode(tensor)`` (-> the Config;
    an object passes through: the eager fast path hands the backward the object itself),
    ``fake()`` (the fake implementation's output: the encoding's shape, no planning)."""

    __slots__ = ("cls",)

    def __init__(self, cls: type):
        self.cls = cls

    def encode(self, config: Any) -> Tensor:
        return plan_codec.encode(config, self.cls)

    def decode(self, value: Any) -> Any:
        return plan_codec.decode(value, self.cls) if isinstance(value, Tensor) else value

    def fake(self) -> Tensor:
        return plan_codec.fake(self.cls)


class Backend(Protocol):
    """What every backend of every op has (module docstring); an op's own Protocol adds
    its typed ``plan``, ``forward`` and ``backward``."""

    name: str
    codec: ConfigCodec

    def unsupported(self, device: torch.device, dtype: torch.dtype) -> Optional[str]:
        """None when this backend runs calls on such tensors, else why not."""
        ...


class BackendTable(dict):
    """An op's backends by name (``api.BACKENDS``), each made by its factory on first use
    (a backend whose module needs an optional package, triton or helion, is imported only
    when a call asks for it); then a plain dict lookup."""

    def __init__(self, **factories: Callable[[], Any]):
        super().__init__()
        self.factories = factories

    def __missing__(self, name: str):
        backend = self[name] = self.factories[name]()
        return backend


def register_autograd(forward_op, forward_impl: Callable, setup_context: Callable,
                      backward: Callable) -> EagerOp:
    """Register ``setup_context``/``backward`` as the autograd of ``forward_op`` (a
    ``torch.library`` custom op whose Python implementation is ``forward_impl``), the
    backward running under the planner overrides of its forward, and return the op with
    the eager fast path (the public function runs ``op.runner(inputs)(*inputs)``)."""
    setup, run = under_forward_overrides(setup_context, backward)
    forward_op.register_autograd(run, setup_context=setup)
    return EagerOp(forward_op, forward_impl, setup, run)
