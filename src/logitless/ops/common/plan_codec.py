"""A call's plan across the custom-op boundary: one frozen dataclass <-> a CPU int64 tensor.

An op's forward decides its plan once (a frozen dataclass of the planner,
``planning.plans.LinearPlan``) and hands it to its backward. On the eager fast path
(``glue.CustomOp``'s eager path) the object itself travels on the autograd context; where the
custom ops run (torch.compile, dispatch modes) a custom op's output can only be a
tensor, so the backend's ``contract.ConfigCodec`` encodes it here and decodes it before
the backward implementation sees it. Only the ops without a ``replan`` (``glue.CustomOp``:
log_probs, linear_log_probs) still do; the others' backward op plans the Config again.

Fields may be ints, bools, or (optional) nested frozen dataclasses of such; the whole
plan may be None. The encoding has a fixed length per class (``size``): a presence flag,
then the fields in order, an absent nested plan as its flag 0 and zeros. So the fake
implementations know its shape without planning. Encoding and decoding are memoised
(plans repeat from call to call); decoding reads a CPU tensor: no device sync.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from typing import Any, Optional

import torch
from torch import Tensor


@functools.cache
def _layout(cls: type) -> tuple:
    """((field name, kind, nested class or None), ...): kind "int", "bool" or "plan"."""
    hints = typing.get_type_hints(cls)
    out: list[tuple[str, str, Optional[type]]] = []
    for f in dataclasses.fields(cls):
        t = hints[f.name]
        args = [a for a in typing.get_args(t) if a is not type(None)]
        if typing.get_origin(t) in (typing.Union, types.UnionType) and len(args) == 1:
            t = args[0]  # Optional[X]
        if t is bool:
            out.append((f.name, "bool", None))
        elif t is int:
            out.append((f.name, "int", None))
        elif isinstance(t, type) and dataclasses.is_dataclass(t):
            out.append((f.name, "plan", t))
        else:
            raise TypeError(f"{cls.__name__}.{f.name}: a plan field must be int, bool or a dataclass, got {t}")
    return tuple(out)


@functools.cache
def size(cls: type) -> int:
    """Length of ``encode``'s tensor for plans of ``cls`` (or None)."""
    return 1 + sum(size(sub) if kind == "plan" else 1 for _, kind, sub in _layout(cls))


def _values(plan: Any, cls: type) -> list:
    if plan is None:
        return [0] * size(cls)
    out = [1]
    for name, kind, sub in _layout(cls):
        value = getattr(plan, name)
        out.extend(_values(value, sub) if kind == "plan" else (int(value),))
    return out


@functools.lru_cache(maxsize=4096)
def _encoded(plan: Any, cls: type) -> tuple:
    return tuple(_values(plan, cls))


def encode(plan: Any, cls: type) -> Tensor:
    """``plan`` (an instance of ``cls`` or None) as a CPU int64 tensor of ``size(cls)``."""
    return torch.tensor(_encoded(plan, cls), dtype=torch.int64)


def _build(values: tuple, start: int, cls: type) -> tuple[Optional[Any], int]:
    """(the plan at ``values[start:]`` or None, the position after it)."""
    present = values[start]
    i = start + 1
    kwargs = {}
    for name, kind, sub in _layout(cls):
        if kind == "plan":
            kwargs[name], i = _build(values, i, sub)
        else:
            kwargs[name] = bool(values[i]) if kind == "bool" else values[i]
            i += 1
    return (cls(**kwargs) if present else None), i


@functools.lru_cache(maxsize=4096)
def _decoded(values: tuple, cls: type):
    if len(values) != size(cls):
        raise ValueError(f"a {cls.__name__} plan has {size(cls)} fields, got {len(values)}")
    return _build(values, 0, cls)[0]


def decode(t: Tensor, cls: type):
    """The plan ``encode`` wrote (None for an absent one)."""
    return _decoded(tuple(t.tolist()), cls)


def fake(cls: type) -> Tensor:
    """What a fake implementation returns for the plan output: its shape and dtype."""
    return torch.empty(size(cls), dtype=torch.int64, device="cpu")
