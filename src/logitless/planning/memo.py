"""Memoised planning: the planners are pure functions of their arguments and a little
state, so each call after the first with the same key is a dictionary lookup.

At 512-2048 tokens an eager call is host-bound; planning cost ~0.6 ms per training
step on the H100 (``tuned.cache_path`` resolves ``Path.home()`` twice per step, the
cost model ran for each plan: benchmarks/results/probe-hopper-diag-H100-2026-11-23.log).

The key of a call is everything its result depends on:

- its arguments (shapes, itemsize, budget, flags) and the device, with a CUDA
  device's index made explicit (``cuda`` alone means the current device);
- the active ``overrides.current()`` (a frozen dataclass). When one of its fields is
  unhashable (a ``kernel_options`` dict) the call is not cached at all. A ``plan``
  callable hashes by identity; the key holds a reference to it, so the identity
  cannot be reused by another object while the entry lives;
- the environment the tuned-config lookup reads (``LOGITLESS_TUNED``,
  ``LOGITLESS_CACHE_DIR``, ``HOME``) and fp32 matmul precision (read by fp32 plans);
- the generation of the tuned-config tables: ``tuned.clear()`` (which the tuner
  calls after writing its cache) clears every memo too.

The memo holds at most ``MAX_ENTRIES`` plans per planner (then starts afresh): plans
are small frozen dataclasses. Nothing here touches a device or synchronises.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable

from logitless.planning.overrides import current as _overrides

MAX_ENTRIES = 4096
_MEMOS: list[dict] = []


def _device_key(device):
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


def _state_key():
    import torch

    env = os.environ
    return (env.get("LOGITLESS_TUNED"), env.get("LOGITLESS_CACHE_DIR"), env.get("HOME"),
            torch.get_float32_matmul_precision())


def memoised(fn: Callable) -> Callable:
    """``fn`` with its results kept by (arguments, device, overrides, state) as above.
    Arguments that are torch devices are keyed by ``(type, index)``."""
    memo: dict = {}
    _MEMOS.append(memo)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            key = (tuple(_device_key(a) if type(a).__name__ == "device" else a for a in args),
                   tuple(sorted((k, _device_key(v) if type(v).__name__ == "device" else v)
                                for k, v in kwargs.items())),
                   _overrides(), _state_key())
            hash(key)
        except TypeError:  # an unhashable override or argument: plan afresh
            return fn(*args, **kwargs)
        found = memo.get(key)
        if found is None:
            if len(memo) >= MAX_ENTRIES:
                memo.clear()
            found = memo[key] = fn(*args, **kwargs)
        return found

    wrapper.uncached = fn
    return wrapper


def clear() -> None:
    """Forget every memoised plan (``tuned.clear`` calls this)."""
    for memo in _MEMOS:
        memo.clear()
