"""The backend contract every op's backends follow, and the custom-op glue written once against it.

An op has one class per backend (``ops/<op>/<backend>_backend.py``), listed by name in one
table in the op's ``api.py``; the op writes its contract as a ``typing.Protocol`` (e.g.
``ops.linear_cross_entropy.contract.LceBackend``) that extends ``Backend`` below with its
typed ``forward``/``backward``. Every backend answers:

- ``name``: its name in the table (the ``backend=`` argument, the custom ops' ``backend``);
- ``unsupported(device, dtype)``: None when it runs such a call, else the reason;
- ``plan(...)``: the call's Config, a frozen dataclass (its class: ``plan``'s return
  annotation) -- the ONLY place where heuristics decide (tiles, chunks, kept columns,
  strategies, fallbacks). Called once per call, by the forward; the forward, the backward
  and the gradient-in-forward strategy take that object (through the custom ops the
  backward op plans it again from the same arguments: a pure, memoised function of them);

The glue (``glue.CustomOp``): an op declares its call, outputs and backward call as typed
classes and writes its bodies (``forward``/``fake``/``save``/``backward``); the glue derives
the torch.library custom ops, their schemas, the eager fast path and the backward under the
forward's planner overrides from those declarations.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, Optional, Protocol, TypeVar, Union

import torch

from logitless.ops.common import invariant, validate


@dataclass(frozen=True)
class Needs:
    """Which gradients of a fused linear op's student/model head a call computes: of x,
    of the weight, of the bias (a field of the ops' declared calls, ``glue.Call``)."""

    need_dx: bool = False
    need_dw: bool = False
    need_db: bool = False


class Backend(Protocol):
    """What every backend of every op has (module docstring); an op's own Protocol adds
    its typed ``plan``, ``forward`` and ``backward``."""

    name: str

    def unsupported(self, device: torch.device, dtype: torch.dtype) -> Optional[Exception]:
        """None when this backend runs calls on such tensors, else the error saying why not."""
        ...


#: An op's backend Protocol (``LceBackend``...): what its table's entries make.
B = TypeVar("B")


class Lazy(Generic[B]):
    """A table entry whose backend is made on first use by ``factory`` (its module needs an
    optional package: triton, helion), with ``kind``, the backend's kind class (its
    capabilities: ``automatic_on``, ``unsupported``), known without importing it."""

    __slots__ = ("kind", "factory")

    def __init__(self, kind: type, factory: Callable[[], B]):
        self.kind, self.factory = kind, factory


class BackendTable(dict[str, B], Generic[B]):
    """An op's backends by name (``api.BACKENDS``), in the order the automatic choice tries
    them (``validate.resolve_backend``). Each entry is a backend class (made on first use)
    or a ``Lazy`` one; then a plain dict lookup. ``BackendTable[LceBackend]``: the type
    checker checks every entry's backend against the op's Protocol."""

    def __init__(self, **entries: Union[type[B], Lazy[B]]):
        super().__init__()
        self.entries = entries

    def names(self) -> tuple:
        """The backends' names, in the table's order."""
        return tuple(self.entries)

    def kind(self, name: str) -> type:
        """The class whose attributes describe backend ``name`` (without making it)."""
        entry = self.entries[name]
        return entry.kind if isinstance(entry, Lazy) else entry

    def __missing__(self, name: str) -> B:
        entry = self.entries[name]
        backend = self[name] = entry.factory() if isinstance(entry, Lazy) else entry()
        return backend


# --------------------------------------------------------------------------- backend kinds
# What every op's backend of one kind shares; an op's backend class derives from its kind.
# ``automatic_on``: the device types on which ``backend="auto"`` may pick it (None: any);
# ``unsupported(device, dtype)``: None when it runs such a call, else the error to raise
# for an explicit ``backend=`` (the automatic choice passes over it);
# ``invariant_rows``: rows per block under ``batch_invariant`` (device type -> rows).


class TorchKind:
    """backend="torch": the PyTorch path; every device and dtype."""

    name = "torch"
    automatic_on: Optional[tuple] = None
    invariant_rows = invariant.TORCH_ROWS

    @staticmethod
    def unsupported(device: torch.device, dtype: torch.dtype) -> Optional[Exception]:
        return None


class TritonKind:
    """backend="triton": the Triton kernels (CUDA; on a CPU under TRITON_INTERPRET=1)."""

    name = "triton"
    automatic_on: Optional[tuple] = ("cuda",)
    invariant_rows = invariant.TRITON_ROWS

    unsupported = staticmethod(validate.triton_unsupported)


class HelionKind:
    """backend="helion": never chosen automatically; where Helion cannot run, the backend
    runs another in its place (``helion_choice``)."""

    name = "helion"
    automatic_on: Optional[tuple] = ()
    invariant_rows: dict = {}

    @staticmethod
    def unsupported(device: torch.device, dtype: torch.dtype) -> Optional[Exception]:
        if dtype == torch.float64:
            return TypeError("backend='helion' supports float16, bfloat16 and float32; "
                             "use backend='torch' for float64")
        return None
