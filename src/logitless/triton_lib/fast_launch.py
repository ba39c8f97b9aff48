"""Launches of the Triton kernels, and the one place that relies on Triton's internals.

    run_kernel   ``kernel[grid](*args, **kwargs)``; repeated launches of one launch key
                 call the cached compiled kernel directly; a first launch whose tiles'
                 pipeline does not fit the shared memory retries with fewer stages
    public_launch  ``kernel[grid](*args, **kwargs)`` (numpy's warnings off on the interpreter)
    descriptor   ``TensorDescriptor(base, shape, strides, block_shape)``, validated once
                 per layout

Why: at 512-2048 tokens an eager call is bound by the host, and ``JITFunction.run`` binds
every argument and builds a cache-key string at each launch (its binder costs ~65 us for
a 40-argument kernel on the host of an H100 machine; 4-10 launches per forward and
backward). ``run_kernel`` does that once per ``launch_key`` and then calls the compiled
kernel's launcher as ``JITFunction.run`` does (``compiled.run(grid, stream, function,
packed_metadata, launch_metadata, enter hook, exit hook, *every parameter)``);
``descriptor`` builds TMA descriptors of an already checked layout without Triton's
per-object checks. Both rest on Triton internals (the launcher's calling convention, the
specialisation ``launch_key`` mirrors, ``TensorDescriptor``'s fields), so both are used
only with a Triton release in ``SUPPORTED`` (checked once, at import): with another
release, or ``LOGITLESS_FAST_LAUNCH=0``, every launch goes through ``kernel[grid]`` and
every descriptor through Triton's constructor (the same kernels and results bitwise,
more host time), with one ``FastLaunchWarning`` for an unsupported release. CI runs the
fast path's tests (``tests/test_fast_launch.py``: the gate, the fallback and the key
against Triton's own binder) on the oldest and newest supported releases. The
interpreter (TRITON_INTERPRET=1), autotuned or other kernel objects and callable grids
always take ``kernel[grid]``.
"""

from __future__ import annotations

import collections
import dataclasses
import inspect
import os
import re
import warnings

import numpy as np
import torch
import triton
from triton import knobs
from triton.runtime.errors import OutOfResources
from triton.runtime.jit import JITFunction
from triton.tools.tensor_descriptor import TensorDescriptor

#: Triton releases (major, minor), both ends included, whose launcher, specialisation and
#: ``TensorDescriptor`` the fast path was checked against (pyproject's triton pins).
SUPPORTED = ((3, 6), (3, 9))


class FastLaunchWarning(UserWarning):
    """The installed Triton is outside ``SUPPORTED``: launches take ``kernel[grid]``."""


def supported(version: str) -> bool:
    """Whether a Triton version string (``triton.__version__``) is in ``SUPPORTED``."""
    m = re.match(r"(\d+)\.(\d+)", version)
    return m is not None and SUPPORTED[0] <= (int(m.group(1)), int(m.group(2))) <= SUPPORTED[1]


def gate(version: str, env: str = "1") -> bool:
    """The fast path's switch for a Triton ``version`` and ``LOGITLESS_FAST_LAUNCH``'s
    value: off with a ``FastLaunchWarning`` for an unsupported release, off silently for
    "0"."""
    if env == "0":
        return False
    if not supported(version):
        lo, hi = (".".join(map(str, v)) for v in SUPPORTED)
        warnings.warn(f"logitless: Triton {version} is outside the releases its fast kernel launch was checked "
                      f"against ({lo} to {hi}); every launch goes through kernel[grid] (more host time per call, "
                      f"the same results)", FastLaunchWarning, stacklevel=2)
        return False
    return True


#: Whether the fast path is in use (decided once, at import).
ENABLED = gate(triton.__version__, os.environ.get("LOGITLESS_FAST_LAUNCH", "1"))

#: Launches by path ("fast": a cached compiled kernel, "triton": ``kernel[grid]``), for
#: tests and probes; no other use.
LAUNCHES: collections.Counter = collections.Counter()
#: launch_key(...) -> (compiled kernel, (name, default) of the parameters after the
#: positional arguments). Bounded: cleared past ``MAX_FAST_ENTRIES``.
_FAST: dict = {}
MAX_FAST_ENTRIES = 4096
_NO_DEFAULT = inspect.Parameter.empty


def _arg_key(a):
    """What Triton's specialisation of one kernel argument can depend on, or more: an
    int's value (Triton: 1, multiple of 16, 32/64-bit), a tensor's dtype and 16-byte
    alignment, a TMA descriptor's dtype, block shape, padding (and TF32 rounding where
    the release has it); floats are never specialised (their type only); bools, strings
    and None as themselves (bools tagged: True == 1 in a dict key). Anything else raises
    TypeError (then no fast path). (``launch_key`` inlines the common cases.)"""
    t = type(a)
    if t is int or t is str or a is None:
        return a
    if t is float:
        return float
    if t is bool:
        return (bool, a)
    if t is TensorDescriptor:
        return (TensorDescriptor, a.base.dtype, tuple(a.block_shape), a.padding,
                getattr(a, "round_f32_to_tf32", False))
    if isinstance(a, torch.Tensor):
        return (a.dtype, a.data_ptr() % 16 == 0)
    raise TypeError(f"no launch key for {t.__name__}")


def launch_key(kernel, device: int, args: tuple, kwargs: dict) -> tuple:
    """The key under which ``run_kernel`` reuses a compiled kernel: equal keys imply the
    same Triton specialisation and options (``tests/test_fast_launch.py`` checks this
    against Triton's own binder), so the cached kernel is the one ``kernel[grid]`` would
    pick. Keyword values (constexprs, num_warps, ...) are keyed as arguments, after
    their names. One loop with the common types inline (~40 arguments per launch)."""
    key = [id(kernel), device]
    add = key.append
    for a in args:
        t = type(a)
        if t is int:
            add(a)
        elif t is float:
            add(float)
        elif t is torch.Tensor or t is torch.nn.Parameter:
            add((a.dtype, a.data_ptr() % 16 == 0))
        else:
            add(_arg_key(a))
    positions = _constexpr_positions(kernel)
    if positions and positions[0] < len(args):  # constexprs passed by position: by value and type
        for i in positions:
            if i < len(args):
                add((i, type(args[i]), args[i]))
    types = tuple(map(type, kwargs.values()))
    if _PLAIN_KWARGS.issuperset(types):  # constexprs and options: keyed by value and type
        return (*key, tuple(kwargs.items()), types)
    for k, a in kwargs.items():
        add(k)
        add((float, a) if type(a) is float else _arg_key(a))  # (a float constexpr: its value)
    return tuple(key)


#: Keyword value types keyed as (value, type): (True, bool) and (1, int) differ.
_PLAIN_KWARGS = frozenset((int, bool, str, type(None)))
#: id(kernel) -> (kernel, positions of its constexpr parameters).
_CONSTEXPR_POSITIONS: dict = {}


def _constexpr_positions(kernel) -> tuple:
    entry = _CONSTEXPR_POSITIONS.get(id(kernel))
    if entry is None or entry[0] is not kernel:
        entry = _CONSTEXPR_POSITIONS[id(kernel)] = (
            kernel, tuple(i for i, p in enumerate(kernel.params) if p.is_constexpr))
    return entry[1]


def bound_values(args: tuple, kwargs: dict, tail: tuple) -> tuple:
    """Every parameter's value in signature order, as ``JITFunction.run`` passes its bound
    arguments to the launcher (constexprs included: the launcher skips them): ``args``,
    then for each (name, default) of ``tail`` (the later parameters) its keyword value
    or default."""
    return (*args, *[kwargs[name] if name in kwargs else default for name, default in tail])


def public_launch(kernel, grid, *args, **kwargs):
    """``kernel[grid](*args, **kwargs)``, Triton's public launch (the launches that are not
    repeated per step call it directly). On Triton's interpreter (numpy blocks) numpy's
    floating-point warnings are off for the launch, in this thread: the kernels compute
    exp(-inf), log(0), inf * 0 in masked lanes and padding on purpose (a GPU says nothing),
    and the RuntimeWarnings reached the user as if something were wrong."""
    if type(kernel).__name__ == "InterpretedFunction":
        with np.errstate(all="ignore"):
            return kernel[grid](*args, **kwargs)
    return kernel[grid](*args, **kwargs)


#: (id of the kernel (a module-level object), requested num_stages, constexpr flags) ->
#: the num_stages that fit this GPU's shared memory.
_STAGES_THAT_FIT: dict = {}


def _fitting_launch(kernel, grid, args: tuple, kwargs: dict):
    """``public_launch``; if the tiles' pipeline does not fit the GPU's shared memory
    (Triton's OutOfResources, raised on the host before the launch), again with fewer
    ``num_stages``, remembering what fit. No device sync."""
    num_stages = kwargs.get("num_stages")
    if num_stages is None:
        return public_launch(kernel, grid, *args, **kwargs)
    # The constexprs (upper-case keywords) in call order: a call site passes them in one
    # order, so no sort is needed (another order only makes another entry).
    key = (id(kernel), num_stages, *[(k, v) for k, v in kwargs.items() if k.isupper()])
    stages = _STAGES_THAT_FIT.get(key, num_stages)
    while True:
        try:
            out = public_launch(kernel, grid, *args, **(kwargs if stages == num_stages
                                                          else {**kwargs, "num_stages": stages}))
            if stages != num_stages:
                _STAGES_THAT_FIT[key] = stages
            return out
        except OutOfResources:
            if stages <= 1:
                raise
            stages -= 1


def run_kernel(kernel, grid, *args, **kwargs):
    """``kernel[grid](*args, **kwargs)``: the same compiled kernel, launched the same way
    (Triton's launcher: tensor-map descriptors filled, launch hooks called, on the
    current stream, so CUDA-graph capture works as before), without the per-launch
    argument binding and cache-key string of ``JITFunction.run``. The first launch of
    each ``launch_key`` goes through ``kernel[grid]`` (compiling if needed) and keeps
    the compiled kernel; later ones call it directly. Triton settings that
    ``JITFunction.run`` reads per launch (TRITON_DEBUG, the instrumentation mode) count
    as of a key's first launch. Without ``ENABLED`` (module docstring), for the
    interpreter, other kernel objects and callable grids: ``kernel[grid]``. A launch
    through ``kernel[grid]`` retries with fewer ``num_stages`` where the requested ones
    do not fit (``_fitting_launch``); the key's compiled kernel is then the one that fit."""
    if not (ENABLED and type(kernel) is JITFunction and type(grid) is tuple):
        LAUNCHES["triton"] += 1
        if "num_stages" in kwargs:
            return _fitting_launch(kernel, grid, args, kwargs)
        return public_launch(kernel, grid, *args, **kwargs)
    device = torch.cuda.current_device()
    try:
        key = launch_key(kernel, device, args, kwargs)
        entry = _FAST.get(key)
    except TypeError:  # an argument without a key, or an unhashable constexpr
        key = entry = None
    if entry is None:
        LAUNCHES["triton"] += 1
        compiled = _fitting_launch(kernel, grid, args, kwargs)
        tail = tuple((p.name, p.default) for p in list(kernel.signature.parameters.values())[len(args):])
        if (key is not None and hasattr(compiled, "packed_metadata")
                and all(name in kwargs or default is not _NO_DEFAULT for name, default in tail)):
            if len(_FAST) >= MAX_FAST_ENTRIES:
                _FAST.clear()
            _FAST[key] = (compiled, tail)
        return compiled
    compiled, tail = entry
    LAUNCHES["fast"] += 1
    full = bound_values(args, kwargs, tail)
    stream = torch._C._cuda_getCurrentRawStream(device)  # (what Triton's CUDA driver reads)
    size = len(grid)
    meta = compiled.launch_metadata(grid, stream, *full)
    compiled.run(grid[0], grid[1] if size > 1 else 1, grid[2] if size > 2 else 1, stream, compiled.function,
                 compiled.packed_metadata, meta, knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook,
                 *full)
    return compiled


#: Layouts (dtype, shape, strides, block shape, base alignment) whose descriptors passed
#: Triton's checks.
_CHECKED_LAYOUTS: set = set()
#: ``TensorDescriptor``'s fields with a default (padding, and the release's later ones).
_DESCRIPTOR_DEFAULTS = {f.name: f.default for f in dataclasses.fields(TensorDescriptor)
                        if f.default is not dataclasses.MISSING}


def descriptor(base: torch.Tensor, shape: tuple, strides: tuple, block_shape: tuple) -> TensorDescriptor:
    """``TensorDescriptor(base, shape, strides, block_shape)``. Triton's constructor
    checks the layout (rank, block shape, 16-byte strides, positive sizes, base
    alignment) in Python for every object; with ``ENABLED`` that runs once per layout
    and base alignment class, later descriptors of the layout are filled in directly
    (the same object, every field of the dataclass set: the CUDA tensor map is built at
    launch from its fields, as always)."""
    key = (base.dtype, shape, strides, block_shape, base.data_ptr() % 16 == 0)
    if not ENABLED or key not in _CHECKED_LAYOUTS:
        desc = TensorDescriptor(base, list(shape), list(strides), list(block_shape))
        _CHECKED_LAYOUTS.add(key)
        return desc
    desc = object.__new__(TensorDescriptor)
    desc.__dict__.update(_DESCRIPTOR_DEFAULTS, base=base, shape=list(shape), strides=list(strides),
                         block_shape=list(block_shape))
    return desc
