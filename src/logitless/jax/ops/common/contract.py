"""The backend contract every JAX op's backends follow (the PyTorch side's
``logitless/ops/common/contract.py``, in JAX's terms).

An op has one class per backend (``jax/ops/<op>/<backend>_backend.py``), listed by name in
one table (``BackendTable``, the op's ``backends.BACKENDS``, re-exported by its ``api``);
the op writes its contract as a ``typing.Protocol`` (``jax/ops/<op>/contract.py``) that
extends ``Backend`` below with its typed ``forward``/``backward``. Every backend answers:

- ``name``: its name in the table (the ``implementation=`` argument);
- ``unsupported(x2d_shape, w_shape, dtype, *, softcap, has_bias, has_class_weight,
  need_argmax)``: None when it runs such a call, else the reason (the text the refusal of
  an explicit ``implementation=`` adds after the case; empty when the case says it all);
- ``can_partition()``: whether it may run per device inside ``custom_partitioning`` (not
  through an interpreter's host callbacks);
- ``plan(x2d_shape, w_shape, dtype, *, budget, weight_layout, has_bias)``: the call's Config, a
  frozen (hashable) dataclass -- the ONLY place where heuristics decide (tiles, chunks).
  The api makes it once per call, before the ``jax.custom_vjp`` (a static argument), and
  the forward and the backward take that object. Per device (sharded jit), where the
  shapes are known only at partitioning time, ``local_plan`` makes it once per
  (backend, per-device shapes, budget, layout, bias), shared by the forward's and the
  backward's partitions.

Shapes are 2-D: ``x2d_shape`` (N, H); ``w_shape`` (V, H) whatever the weight's layout.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any, Optional, Protocol


class Backend(Protocol):
    """What every backend of every JAX op has (module docstring); an op's own Protocol
    adds its typed ``forward`` and ``backward``."""

    name: str

    def unsupported(self, x2d_shape: tuple, w_shape: tuple, dtype: Any, *, softcap: Optional[float],
                    has_bias: bool, has_class_weight: bool = False, need_argmax: bool = False) -> Optional[str]:
        """None when this backend runs the case, else why not."""
        ...

    def can_partition(self) -> bool:
        """Whether the sharded jit path (``custom_partitioning``) may call it."""
        ...

    def plan(self, x2d_shape: tuple, w_shape: tuple, dtype: Any, *, budget: int, weight_layout: str = "vh",
             has_bias: bool = False) -> Any:
        """The call's Config (a frozen dataclass)."""
        ...


class BackendTable(dict):
    """An op's backends by name, each made by its factory on first use (a backend whose
    module needs an optional package, jax-triton or Mosaic GPU, is imported only when a
    call asks for it); then a plain dict lookup. ``table[name]`` for a name that is not
    in the table raises the api's ValueError naming the choices."""

    def __init__(self, **factories: Callable[[], Any]):
        super().__init__()
        self.factories = factories

    def names(self) -> tuple:
        """The backends' names, in the table's order."""
        return tuple(self.factories)

    def __contains__(self, name) -> bool:
        return name in self.factories

    def __iter__(self):
        return iter(self.factories)

    def __len__(self) -> int:
        return len(self.factories)

    def __missing__(self, name: str):
        if name not in self.factories:
            raise ValueError(f"implementation must be None or one of {self.names()}, got {name!r}")
        backend = self[name] = self.factories[name]()
        return backend

    def usable(self, name: str, stacklevel: int = 3) -> Optional[Any]:
        """Backend ``name`` for the automatic choice: None when its module does not import
        (an ImportError silently; any other failure, e.g. a jax without Mosaic GPU, with a
        RuntimeWarning saying so)."""
        try:
            return self[name]
        except ImportError:
            return None
        except Exception as exc:  # e.g. a jax without Mosaic GPU: say so, keep working
            warnings.warn(f"logitless.jax: the {name} backend failed to import ({exc!r}); trying the next",
                          RuntimeWarning, stacklevel=stacklevel)
            return None


def vh_shape(w_shape, weight_layout: str) -> tuple:
    """(V, H) of a weight of shape ``w_shape`` in ``weight_layout`` ("vh" or "hv")."""
    return tuple(w_shape) if weight_layout == "vh" else tuple(w_shape)[::-1]


@functools.lru_cache(maxsize=1024)
def local_plan(backend, x2d_shape: tuple, w_shape: tuple, dtype, budget: int, weight_layout: str,
               has_bias: bool = False):
    """``backend.plan`` for per-device shapes (``w_shape`` (V, H)), made once per
    (backend, shapes, dtype, budget, layout, bias): the sharded paths' forward and backward
    partitions, traced separately, share one Config (and a later call of the same shapes
    takes it again: a Config is a function of these arguments only)."""
    return backend.plan(tuple(x2d_shape), tuple(w_shape), dtype, budget=budget, weight_layout=weight_layout,
                        has_bias=has_bias)
