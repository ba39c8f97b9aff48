"""logitless: cross-entropy and distillation losses of language models without materialising the logits.

The PyTorch ops are loaded on first use (PEP 562 ``__getattr__``), so ``import logitless``
imports neither torch nor jax, and ``import logitless.jax`` works in a torch-free
environment and never imports torch where both are installed.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

#: Public name -> the submodule that defines it (PyTorch side).
_EXPORTS = {
    "linear_cross_entropy": ".linear_cross_entropy",
    "LinearCrossEntropyLoss": ".linear_cross_entropy",
    "cross_entropy": ".cross_entropy",
    "CrossEntropyLoss": ".cross_entropy",
    "linear_jsd": ".linear_jsd",
    "LinearJSDLoss": ".linear_jsd",
    "jsd": ".jsd",
    "JSDLoss": ".jsd",
    "LossStats": "._loss_math",
    "DEFAULT_MEMORY_BUDGET": "._plans",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'logitless' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
