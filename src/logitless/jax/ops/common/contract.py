"""The backend contract every JAX op's backends follow (the PyTorch side's
``logitless/ops/common/contract.py``, in JAX's terms), the base every backend class
starts from, and the table that lists an op's backends.

An op has one class per backend (``jax/ops/<op>/<kind>_backend.py``), listed by name in
one table (``BackendTable``, the op's ``backends.BACKENDS``, re-exported by its ``api``);
the op writes its contract as a ``typing.Protocol`` (``jax/ops/<op>/contract.py``) that
extends ``Backend`` below with its typed ``forward``/``backward``. Every backend answers:

- ``name``: its name in the table (the ``implementation=`` argument);
- ``unsupported(x2d_shape, w_shape, dtype, *, softcap, has_bias, has_class_weight,
  need_argmax)``: None when it runs such a call, else the reason (the text the refusal of
  an explicit ``implementation=`` adds after the case);
- ``can_partition()``: whether it may run per device inside ``custom_partitioning`` (not
  through an interpreter's host callbacks);
- ``plan(x2d_shape, w_shape, dtype, *, budget, weight_layout, has_bias)``: the call's Config, a
  frozen (hashable) dataclass -- the ONLY place where heuristics decide (tiles, chunks).
  The api makes it once per call, before the ``jax.custom_vjp`` (a static argument), and
  the forward and the backward take that object. Per device (sharded jit), where the
  shapes are known only at partitioning time, ``local_backend`` makes it once per
  (backend, per-device shapes, budget, layout, bias) (``local_plan``), shared by the
  forward's and the backward's partitions.

Shapes are 2-D: ``x2d_shape`` (N, H); ``w_shape`` (V, H) whatever the weight's layout.

Backend kinds: those three answers depend on the kind of backend, not on the op, so each
kind has ONE base class in ``jax/ops/common/``, with its Config, its device and dtype
checks, ``can_partition`` and its planning call:

    kind          base (module)                        Config             plans with
    "xla"         ``xla.XlaBase``                     ``XlaConfig``        ``planning.xla_plan``
    "triton"      ``triton.TritonBase``               ``TritonConfig``     ``planning.triton_plan``
    "mosaic_gpu"  ``mosaic_gpu.MosaicGpuBase``        ``MosaicGpuConfig``  ``mosaic_lib`` tiles + chunk
    "mosaic_tpu"  ``mosaic_tpu.MosaicTpuBase``        ``MosaicTpuConfig``  ``mosaic_tpu_lib`` tiles

(the Mosaic modules import Pallas' Mosaic GPU / TPU: only a backend of that kind imports
them). An op's backend class is its base plus what is the op's own: ``forward`` and
``backward`` (its kernels, called with the Config), the capability attributes its
Protocol reads (``class_weights``, ``argmax``: off by default in ``BackendBase``), and,
where its kernels take fewer cases than the kind's, ``why_not``. ``unsupported`` and
``can_partition`` stay the kind's (``tests_jax/test_backend_kinds.py``); an op whose call
is not one (x, W) pair (distillation: a student and a teacher head) may wrap ``plan``, the
kind's ``plan`` still sizing each part. An op without a kernel on a kind lists a backend
that refuses every case (``Refused`` mixed into the kind's base, with the reason).

Adding an op (e.g. ``linear_jsd``), files touched:

1. ``jax/formulas/<op>.py``: the math (statistics, loss, gradient coefficients), once.
2. ``jax/ops/<op>/contract.py``: the op's Protocol (``Backend`` + typed ``forward`` /
   ``backward``) and the NamedTuples they return and receive.
3. ``jax/ops/<op>/<kind>_backend.py``, one per kind it runs on: the kernels (or their
   launches, on ``mosaic_lib`` / ``mosaic_tpu_lib`` / ``triton_lib``) and one small class,
   ``class XlaBackend(XlaBase)`` with ``forward``/``backward`` (+ capabilities).
4. ``jax/ops/<op>/backends.py``: ``BACKENDS = BackendTable(__package__, xla="XlaBackend",
   ...)`` and ``choose_backend = BACKENDS.choose``.
5. ``jax/ops/<op>/api.py``: checks, ``BACKENDS.choose``, ``backend_weight``, the one
   ``plan``, the ``jax.custom_vjp``; ``sharded.py`` (per device: ``local_backend``);
   ``reference.py`` (float64); the export in ``logitless/jax/__init__.py``; tests.

Adding a backend kind (a fifth, e.g. "cute"), files touched: ``jax/ops/common/<kind>.py``
(its Config and ``<Kind>Base``: ``name``, ``why_not``, ``can_partition``, ``plan``), a
``<kind>_backend.py`` per op that runs on it, one entry per op's ``BACKENDS``, and
``choice.PREFERENCE`` if the automatic choice may pick it.
"""

from __future__ import annotations

import functools
import importlib
import warnings
from typing import Any, Optional, Protocol

import jax.numpy as jnp

from logitless.jax.ops.common import choice


class Backend(Protocol):
    """What every backend of every JAX op has (module docstring); an op's own Protocol
    adds its typed ``forward`` and ``backward``."""

    name: str
    native_hv: bool

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


class BackendBase:
    """What the backend kinds share (each kind's base, ``XlaBase`` ..., derives from it):
    ``unsupported`` is the kind's (or the op's) ``why_not`` of the case, then the
    capabilities the call needs.

    ``native_hv``: the backend reads an (H, V) weight in place (``weight_layout="hv"`` in
    its Config); every backend here does. ``class_weights`` / ``argmax``: the op's
    backend takes ``class_weight=`` / computes the argmax (``need_argmax=``); an op whose
    Protocol has them sets them on its class."""

    name: str = ""
    native_hv: bool = True
    class_weights: bool = False
    argmax: bool = False

    def why_not(self, x2d_shape: tuple, w_shape: tuple, dtype: Any, *, softcap: Optional[float],
                has_bias: bool) -> Optional[str]:
        """None when the kernels run the case (device, dtype, shapes), else the reason."""
        return None

    def unsupported(self, x2d_shape, w_shape, dtype, *, softcap, has_bias, has_class_weight=False,
                    need_argmax=False) -> Optional[str]:
        why = self.why_not(tuple(x2d_shape), tuple(w_shape), dtype, softcap=softcap, has_bias=has_bias)
        if why is None and has_class_weight and not self.class_weights:
            why = f"{self.name} takes no class weights; use implementation=None or 'xla'"
        if why is None and need_argmax and not self.argmax:
            why = f"{self.name} computes no argmax (return_stats); use implementation=None or 'xla'"
        return why


class Refused:
    """A backend that refuses every case of its op (it has no kernel for it): mixed in
    before the kind's base, ``class TritonBackend(Refused, TritonBase)`` with ``why`` the
    reason and what to use instead. The automatic choice passes over it (``unsupported``
    is ``why``); naming it raises ValueError with ``why``; ``forward``/``backward`` raise
    it too (never reached through the api)."""

    why: str = ""

    def why_not(self, x2d_shape: tuple, w_shape: tuple, dtype: Any, *, softcap: Optional[float],
                has_bias: bool) -> Optional[str]:
        return self.why

    def forward(self, *args, **kwargs):
        raise ValueError(self.why)

    def backward(self, *args, **kwargs):
        raise ValueError(self.why)


class BackendTable(dict):
    """An op's backends by name: ``BackendTable(__package__, xla="XlaBackend", ...)`` lists
    backend ``name`` as class ``XlaBackend`` of module ``<package>.<name>_backend``, made on
    first use (a backend whose module needs an optional package, jax-triton or Mosaic
    GPU, is imported only when a call asks for it); then a plain dict lookup.
    ``table[name]`` for a name that is not in the table raises the api's ValueError naming
    the choices. ``automatic``: the names the automatic choice may pick (default: all)."""

    def __init__(self, package: str, *, automatic: Optional[tuple] = None, **classes: str):
        super().__init__()
        self.package = package
        self.classes = classes
        self.automatic = tuple(classes) if automatic is None else tuple(automatic)

    def names(self) -> tuple:
        """The backends' names, in the table's order."""
        return tuple(self.classes)

    def __contains__(self, name) -> bool:
        return name in self.classes

    def __iter__(self):
        return iter(self.classes)

    def __len__(self) -> int:
        return len(self.classes)

    def __missing__(self, name: str):
        if name not in self.classes:
            raise ValueError(f"implementation must be None or one of {self.names()}, got {name!r}")
        module = importlib.import_module(f"{self.package}.{name}_backend")
        backend = self[name] = getattr(module, self.classes[name])()
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

    def choose(self, implementation, x2d_shape, w_shape, dtype, softcap, has_bias, has_class_weight=None,
               need_argmax=False) -> str:
        """The backend name (``choice.choose``: the explicit one, checked, or the automatic
        one). ``has_class_weight``: None for ops without class weights (then not in the
        refusal); ``need_argmax``: the automatic choice takes only backends with ``argmax``."""
        return choice.choose(implementation, self, x2d_shape, w_shape, dtype, softcap, has_bias, has_class_weight,
                             need_argmax=need_argmax)


def vh_shape(w_shape, weight_layout: str) -> tuple:
    """(V, H) of a weight of shape ``w_shape`` in ``weight_layout`` ("vh" or "hv")."""
    return tuple(w_shape) if weight_layout == "vh" else tuple(w_shape)[::-1]


def w_axis(weight_layout: str) -> int:
    """The vocabulary axis of a weight in ``weight_layout``: 1 for an (H, V) weight."""
    return 1 if weight_layout == "hv" else 0


def backend_weight(backend, weight, weight_layout: str):
    """(weight, layout) as ``backend`` gets them: an (H, V) weight as it is ("hv") where
    the backend is ``native_hv``, else ``weight.T`` ("vh"; a copy, whose gradient flows
    back through the transpose)."""
    if weight_layout == "hv" and not backend.native_hv:
        return weight.T, "vh"
    return weight, weight_layout


@functools.lru_cache(maxsize=1024)
def local_plan(backend, x2d_shape: tuple, w_shape: tuple, dtype, budget: int, weight_layout: str,
               has_bias: bool = False):
    """``backend.plan`` for per-device shapes (``w_shape`` (V, H)), made once per
    (backend, shapes, dtype, budget, layout, bias): the sharded paths' forward and backward
    partitions, traced separately, share one Config (and a later call of the same shapes
    takes it again: a Config is a function of these arguments only)."""
    return backend.plan(tuple(x2d_shape), tuple(w_shape), dtype, budget=budget, weight_layout=weight_layout,
                        has_bias=has_bias)


def local_backend(table: BackendTable, name: str, x_shape, w_shape, dtype, *, softcap, has_bias: bool, budget: int,
                  weight_layout: str = "vh", need_argmax: bool = False):
    """(backend, Config) for per-device shapes (``w_shape`` in ``weight_layout``): backend
    ``name`` of ``table``, or "xla" where its ``unsupported`` refuses them; the Config made
    once per shapes (``local_plan``), so the forward's and the backward's partitions share it."""
    vh = vh_shape(w_shape, weight_layout)
    backend = table[name]
    if backend.unsupported(tuple(x_shape), vh, dtype, softcap=softcap, has_bias=has_bias,
                           need_argmax=need_argmax) is not None:
        backend = table["xla"]
    return backend, local_plan(backend, tuple(x_shape), vh, jnp.dtype(dtype), budget, weight_layout, has_bias)
