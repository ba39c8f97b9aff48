"""The module forms of the ops (``LinearCrossEntropyLoss``, ``CrossEntropyLoss``, ...): an
``nn.Module`` that holds a function's keyword options and takes its tensors.

A module form's keywords are the function's keyword-only parameters, read from its
signature (``inspect.signature``) when the class is defined, minus ``inputs`` (tensor
inputs that ``forward`` takes): a keyword added to the function is a keyword of its
module with the same default, so the two cannot drift. Keywords named in ``buffer_keywords``
(tensors such as ``class_weight``) are registered as buffers (they follow ``.to()``);
``forward`` passes the rest as they were given or defaulted.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import ClassVar

from torch import nn


def keyword_options(function: Callable, inputs: tuple = ()) -> dict:
    """{name: default} of ``function``'s keyword-only parameters, minus ``inputs``."""
    return {name: p.default for name, p in inspect.signature(function).parameters.items()
            if p.kind is inspect.Parameter.KEYWORD_ONLY and name not in inputs}


class ModuleForm(nn.Module):
    """Base of the module forms. A subclass names its function (``function``, a
    staticmethod), the function's keyword tensor inputs that ``forward`` takes instead
    (``inputs``), the keywords kept as buffers (``buffer_keywords``; ``buffers`` is
    ``nn.Module.buffers()``), and may check the options at construction (``check``,
    called with every keyword's value)."""

    function: ClassVar[Callable]
    inputs: ClassVar[tuple] = ()
    buffer_keywords: ClassVar[tuple] = ()
    #: {name: default}, from the function's signature (``__init_subclass__``).
    keywords: ClassVar[dict] = {}

    def __init_subclass__(cls, **kw):
        super().__init_subclass__(**kw)
        cls.keywords = keyword_options(cls.function, cls.inputs)
        params = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default)
                  for name, default in cls.keywords.items()]
        cls.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]  # (dynamic) for help()

    def __init__(self, **kwargs):
        super().__init__()
        unknown = [k for k in kwargs if k not in self.keywords]
        if unknown:
            raise TypeError(f"{type(self).__name__}() got an unexpected keyword argument {unknown[0]!r} "
                            f"(its keywords are those of {self.function.__name__}: {', '.join(self.keywords)})")
        values = {**self.keywords, **kwargs}
        values = self.check(values)
        for name in self.buffer_keywords:
            self.register_buffer(name, values.pop(name))
        self.kwargs = values

    def check(self, values: dict) -> dict:
        """Checks the options (raising as the function would) and returns the keyword
        values to keep (a subclass may fold an alias). Default: as given."""
        return values

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v!r}" for k, v in self.kwargs.items())
