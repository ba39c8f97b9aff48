"""backend="helion" of the fused linear ops: whether Helion runs a call, and what runs when not.

An explicit ``backend="helion"`` runs ``ops/<op>/helion_backend.py`` on the kernels of
``logitless.helion_lib`` ("auto" never picks it). When Helion cannot run -- not installed,
older than 1.5, failing to import (after ``helion_lib.runtime``'s torch shims), or, on a
GPU, a kernel failing to compile or launch -- the op's Triton backend runs on CUDA tensors
(its torch backend where triton is absent) and its torch backend on CPU tensors, with one
``HelionFallbackWarning`` per process and cause naming the cause and the install command.
The choice is made inside the custom ops (eager code that torch.compile never traces).
"""

from __future__ import annotations

import importlib.util
import os
import warnings
from collections.abc import Callable, Mapping
from typing import Any, Optional, TypeVar

import torch

from logitless.helion_lib import runtime
from logitless.ops.common.validate import HAS_TRITON

B = TypeVar("B")

#: What to install for the Helion backend (the ``helion`` extra of pyproject.toml).
INSTALL = "pip install 'logitless[helion]'"


class HelionFallbackWarning(UserWarning):
    """backend="helion" was asked for but Helion cannot run: the Triton (CUDA) or torch
    (CPU) backend runs instead. Issued once per process and cause."""


_WARNED: set = set()
#: The cause of a Helion kernel that failed on a GPU: later calls fall back at once.
_FAILED: list = []
#: ``unavailable_reason()``'s answer once asked (a failing import is not retried per call).
_REASON: list = []


def unavailable_reason() -> Optional[str]:
    """None when helion >= 1.5 imports (``runtime.available()``), else why not, with the
    import error's text (asked afresh: ``cause()`` keeps the first answer)."""
    if runtime.available():
        return None
    if importlib.util.find_spec("helion") is None:
        return "helion is not installed"
    try:
        from importlib.metadata import version

        import helion  # noqa: F401

        found = version("helion")
    except Exception as e:  # noqa: BLE001 - the text is the point
        text = str(e).strip().splitlines()[0][:300] if str(e).strip() else ""
        return f"helion failed to import ({type(e).__name__}: {text})"
    return f"helion {found} is older than {'.'.join(map(str, runtime.HELION_MIN))}"


def cause() -> Optional[str]:
    """Why Helion cannot run calls of this process, or None when it can."""
    if _FAILED:
        return _FAILED[0]
    if runtime.available():  # (cached)
        return None
    if not _REASON:
        _REASON.append(unavailable_reason())
    return _REASON[0]


def fallback_name(device: torch.device) -> str:
    """The backend that runs in Helion's place: "triton" on CUDA tensors when triton is
    installed, else "torch"."""
    return "triton" if device.type == "cuda" and HAS_TRITON else "torch"


def warn_fallback(why: str, name: str) -> None:
    """Warn once per process per cause that backend ``name`` runs instead of Helion."""
    if why in _WARNED:
        return
    _WARNED.add(why)
    warnings.warn(f"logitless: backend='helion' cannot run ({why}); the {name} backend runs instead. "
                  f"For the Helion kernels: {INSTALL} (helion >= 1.5 with a torch it supports).",
                  HelionFallbackWarning, stacklevel=4)


def _interpret() -> bool:
    return os.environ.get("HELION_INTERPRET", "0").lower() in ("1", "true", "yes", "on")


def fallback_name_of_call(device: torch.device) -> Optional[str]:
    """None when Helion runs this call, else the name of the backend that runs it instead
    (warning once per cause). CPU tensors need HELION_INTERPRET=1 (Helion's eager ref
    mode, read when the kernels are decorated): ValueError without it."""
    why = cause()
    if why is None:
        if device.type != "cuda" and not _interpret():
            raise ValueError(f"backend='helion' needs CUDA tensors (got {device}); set HELION_INTERPRET=1 "
                             "before logitless imports its Helion kernels to run them eagerly on the CPU "
                             "(slow: tests only), or use backend='torch'")
        return None
    name = fallback_name(device)
    warn_fallback(why, name)
    return name


def guarded(device: torch.device, helion_path: Callable, other_path: Callable):
    """``helion_path()``; on a GPU, a Helion kernel that fails to compile or launch (any
    error but running out of memory) is recorded as the cause (later calls fall back at
    once), warned about when the other backend runs, and ``other_path()`` runs this call;
    under HELION_INTERPRET=1 (the CPU tests) errors propagate."""
    if device.type != "cuda" or _interpret():
        return helion_path()
    try:
        return helion_path()
    except torch.OutOfMemoryError:
        raise
    except Exception as e:  # noqa: BLE001 - an optional dependency never breaks a call
        text = str(e).strip().splitlines()[0][:300] if str(e).strip() else ""
        _FAILED.append(f"a Helion kernel failed on {device}: {type(e).__name__}: {text}")
    return other_path()


def in_place(others: Mapping[str, B], torch_config: Optional[Any],
             triton_config: Optional[Any]) -> tuple[Optional[B], Optional[Any]]:
    """(the backend that runs in Helion's place, its Config) from the two fields of an op's
    ``HelionConfig`` (``torch`` set: the torch backend of ``others``, the op's backends by
    name; ``triton`` set: the Triton one), or (None, None) where neither is: Helion runs."""
    if torch_config is not None:
        return others["torch"], torch_config
    if triton_config is not None:
        return others["triton"], triton_config
    return None, None
