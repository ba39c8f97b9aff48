"""Memoised planning: the planners are pure functions of their arguments and a little
state, so each call after the first with the same key is a dictionary lookup.

At 512-2048 tokens an eager call is host-bound; planning cost ~0.6 ms per training
step on the H100 (``tuned.cache_path`` resolves ``Path.home()`` twice per step, the
cost model ran for each plan).

The key of a call is everything its result depends on:

- its arguments (shapes, itemsize, budget, flags) and the device, with a CUDA
  device's index made explicit (``cuda`` alone means the current device);
- the active ``overrides.current()`` (a frozen dataclass). When something in the key
  is unhashable the call is not cached at all;
- the environment the planners read (``LOGITLESS_TUNED``,
  ``LOGITLESS_CACHE_DIR``, ``HOME``, ``LOGITLESS_CUTE``) and fp32 matmul precision (read by fp32 plans);
- the generation of the tuned-config tables: ``tuned.clear()`` (which the tuner
  calls after writing its cache) clears every memo too.

``device.facts`` keeps each device's facts in a ``cache()``: ``clear()`` forgets them too.

The memo holds at most ``MAX_ENTRIES`` plans per planner (then starts afresh): plans
are small frozen dataclasses. Nothing here touches a device or synchronises.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable

from logitless.planning.overrides import _CURRENT as _OVERRIDES
from logitless.planning.overrides import DEFAULT as _DEFAULT_OVERRIDES

MAX_ENTRIES = 4096
_MEMOS: list[dict] = []

#: The environment variables the planners read: the tuned-config lookup's (``tuned.tiles_for``,
#: ``tuned.cache_path``: ``Path.home()`` reads ``HOME``) and the CuTe switch (``cute.ENV``).
ENV_NAMES = ("LOGITLESS_TUNED", "LOGITLESS_CACHE_DIR", "HOME", "LOGITLESS_CUTE")
#: torch's fp32 matmul precision getter, bound at the first plan (torch is not imported here).
_precision = None


def device_key(device):
    """(type, index) of a torch device, a CUDA device's index made explicit."""
    kind = getattr(device, "type", None)
    if kind is None:
        return device
    index = device.index
    if kind == "cuda" and index is None:
        import torch

        # A machine without CUDA plans for a described GPU (tests, a CPU-side planner):
        # there "cuda" is device 0.
        index = torch.cuda.current_device() if torch.cuda.is_available() else 0
    return (kind, index)


def _bind_precision():
    global _precision
    import torch

    # ``torch.get_float32_matmul_precision`` is a Python wrapper of this C function.
    _precision = getattr(torch._C, "_get_float32_matmul_precision", None) or torch.get_float32_matmul_precision
    return _precision


def _state_key() -> tuple:
    """The environment (``ENV_NAMES``, values as ``os.environ`` holds them) and fp32 matmul
    precision: read at every planner call, so a change between calls (a test's
    ``monkeypatch.setenv``) gives a new key. ``os.environ.get`` per variable (public API;
    ``os.environ`` replaced by another mapping is read the same way)."""
    return (*map(os.environ.get, ENV_NAMES), (_precision or _bind_precision())())


def memoised(fn: Callable) -> Callable:
    """``fn`` with its results kept by (arguments, device, overrides, state) as above.
    Arguments that are torch devices are keyed by ``(type, index)``.

    A hit costs the wrapper, ``_state_key``'s reads inline (``os.environ.get``: three or
    four Python calls per variable) and a dictionary lookup: the key is built inline (no
    generator, no call per argument), and the overrides outside any ``override(...)``
    (``overrides.DEFAULT``, by identity) are keyed as None, so that the frozen
    dataclass' Python ``__hash__`` runs only under one."""
    memo: dict = {}
    _MEMOS.append(memo)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        # Devices as device_key has them, inline: one with an index (or not CUDA) needs no call.
        key_args = tuple([
            a if type(a).__name__ != "device" else
            (a.type, a.index) if a.index is not None or a.type != "cuda" else device_key(a)
            for a in args])
        if kwargs:
            key_kwargs = tuple([(k, v if type(v).__name__ != "device" else device_key(v))
                                for k, v in sorted(kwargs.items())])
        else:
            key_kwargs = ()
        overrides = _OVERRIDES.get()
        # _state_key() inline (one Python call fewer per plan)
        key = (key_args, key_kwargs,
               None if overrides is _DEFAULT_OVERRIDES else overrides,
               (*map(os.environ.get, ENV_NAMES), (_precision or _bind_precision())()))
        try:
            found = memo.get(key)
        except TypeError:  # an unhashable override or argument: plan afresh
            return fn(*args, **kwargs)
        if found is None:
            if len(memo) >= MAX_ENTRIES:
                memo.clear()
            found = memo[key] = fn(*args, **kwargs)
        return found

    wrapper.uncached = fn
    return wrapper


def cache() -> dict:
    """A dictionary that ``clear()`` empties with the memos (``device.facts``' cache)."""
    found: dict = {}
    _MEMOS.append(found)
    return found


def clear() -> None:
    """Forget every memoised plan and the devices' facts (``tuned.clear`` calls this)."""
    for memo in _MEMOS:
        memo.clear()
