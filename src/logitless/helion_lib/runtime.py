"""Helion's import, its CPU interpreter, and the launch of a kernel with a fixed config.

Helion is optional (the ``helion`` extra): ``available()`` says whether it imports, and
nothing here imports it at module level, so ``logitless.helion_lib`` imports without it.
helion 1.5.1 supports torch 2.9 and later but imports ``IntelGPUError`` from
``torch._inductor.runtime.triton_compat``, which torch 2.9-2.11 lack (added in 2.12): on
those releases only (``SHIM_TORCH``: written against 2.11) ``available()`` defines the
missing names (``TORCH_SHIMS``) before importing helion, with one
``HelionTorchShimWarning``; on any other torch nothing is planted in torch (a helion that
then fails to import counts as absent: the fallback backend and its one warning).

``launch`` binds a kernel to its arguments, sets a config (never autotunes at call time:
the config comes from ``configs.pick``) and runs it. With ``HELION_INTERPRET=1`` Helion
runs the kernel eagerly with torch ops (its "ref mode"); its matmul there calls
``torch.mm(..., out_dtype=...)`` (``aten::mm.dtype``), which torch has no CPU kernel for:
on CPU tensors ``launch`` then raises a ``RuntimeError`` that says so (the tests register
a CPU kernel for it in their own process: tests/conftest.py).
"""

from __future__ import annotations

import functools
import importlib.util
import re

import torch

#: The oldest Helion these kernels are written for.
HELION_MIN = (1, 5)
#: torch releases (major, minor), both ends included, on which ``available()`` defines the
#: names of ``TORCH_SHIMS`` that helion imports: those helion >= 1.5 supports (2.9 on) and
#: that lack them (2.12 added them). Written against torch 2.11.
SHIM_TORCH = ((2, 9), (2, 11))

#: (module, name) that helion imports at import time and that torch releases it supports
#: may lack: torch 2.11's ``triton_compat`` has no ``IntelGPUError`` (helion's autotuner
#: logger imports it to class Intel GPU build errors as expected ones). The stand-in is what
#: torch >= 2.12 itself defines where its triton has no such error: an ``Exception``
#: subclass, never raised on other GPUs.
TORCH_SHIMS = (("torch._inductor.runtime.triton_compat", "IntelGPUError"),)


class HelionTorchShimWarning(UserWarning):
    """This torch lacks a name that helion imports (``TORCH_SHIMS``): logitless defined a
    stand-in so that helion imports. Issued once per process."""


def shim_applies(version: str) -> bool:
    """Whether a torch version string (``torch.__version__``) is in ``SHIM_TORCH``."""
    m = re.match(r"(\d+)\.(\d+)", version)
    return m is not None and SHIM_TORCH[0] <= (int(m.group(1)), int(m.group(2))) <= SHIM_TORCH[1]


def shim_torch() -> list:
    """Defines the names of ``TORCH_SHIMS`` that this torch lacks (its module imports but
    has no such attribute); returns them as "module.name" (empty on torch >= 2.12)."""
    import importlib

    added = []
    for module_name, name in TORCH_SHIMS:
        try:
            module = importlib.import_module(module_name)
        except Exception:  # noqa: BLE001 - then helion's own import error says why
            continue
        if not hasattr(module, name):
            setattr(module, name, type(name, (Exception,), {"__module__": module_name, "logitless_shim": True}))
            added.append(f"{module_name}.{name}")
    return added


@functools.cache
def available() -> bool:
    """True when helion >= 1.5 imports (after ``shim_torch()`` on the torch releases of
    ``SHIM_TORCH``; one ``HelionTorchShimWarning`` when it defined a name)."""
    if importlib.util.find_spec("helion") is None:
        return False
    try:
        from importlib.metadata import version

        found = version("helion")
        parts = tuple(int(p) for p in found.split(".")[:2])
        if parts < HELION_MIN:
            return False
        added = shim_torch() if shim_applies(torch.__version__) else []
        import helion  # noqa: F401
    except Exception:  # noqa: BLE001 - a broken install counts as absent
        return False
    if added:
        import warnings

        warnings.warn(f"logitless: torch {torch.__version__} lacks {', '.join(added)}, which helion {found} "
                      "imports; logitless defined a stand-in (an Exception subclass that nothing raises: the "
                      "error of Intel GPU triton builds) so that helion imports. torch >= 2.12 has it.",
                      HelionTorchShimWarning, stacklevel=2)
    return True


def require() -> None:
    if not available():
        raise RuntimeError("logitless.helion_lib needs helion >= 1.5: pip install 'logitless[helion]'")


def cpu_mm_dtype() -> bool:
    """Whether this process has CPU kernels for ``torch.mm`` / ``torch.bmm`` with
    ``out_dtype=`` (``aten::mm.dtype``, ``aten::bmm.dtype``), which Helion's ref mode calls
    (asked at each launch on CPU tensors: the tests register them)."""
    try:
        torch.mm(torch.ones(1, 1), torch.ones(1, 1), out_dtype=torch.float32)
        torch.bmm(torch.ones(1, 1, 1), torch.ones(1, 1, 1), out_dtype=torch.float32)
    except (NotImplementedError, RuntimeError):
        return False
    return True


def launch(kernel, args: tuple, config: dict):
    """Run ``kernel`` on ``args`` with the block sizes etc. of ``config`` (a dict of
    ``helion.Config`` fields)."""
    import helion

    if any(isinstance(a, torch.Tensor) and a.device.type == "cpu" for a in args) and not cpu_mm_dtype():
        raise RuntimeError(f"logitless: Helion's ref mode (HELION_INTERPRET=1) on CPU tensors calls torch.mm with "
                           f"out_dtype= (aten::mm.dtype), which torch {torch.__version__} has no CPU kernel for; "
                           "run backend='helion' on CUDA tensors, or backend='torch' on the CPU")
    bound = kernel.bind(args)
    if interpreting(bound):
        return bound(*args)  # ref mode: eager torch, no config
    bound.set_config(helion.Config(**config))
    return bound(*args)


def shimmed() -> bool:
    """Whether ``shim_torch`` defined a name in this process (a process Helion spawns
    would import helion without it: its autotuner must then benchmark in-process)."""
    import sys

    return any(getattr(getattr(sys.modules.get(m), n, None), "logitless_shim", False) for m, n in TORCH_SHIMS)


def kernel_settings() -> dict:
    """The settings every kernel of helion_lib is decorated with: shapes not specialised,
    fp32 dots in tf32x3, no autotuning (``launch`` sets the config), and Helion's ref mode when HELION_INTERPRET
    is set, given explicitly so that a TRITON_INTERPRET=1 of the same process (the Triton
    kernels' CPU interpreter in the tests) does not make Helion refuse to decorate them."""
    import os

    from helion.runtime.settings import RefMode

    interpret = os.environ.get("HELION_INTERPRET", "0").lower() in ("1", "true", "yes", "on")
    # fp32 inputs: three TF32 products per dot (about fp32 accuracy on tensor cores), what the
    # Triton kernels do at torch's default fp32 matmul precision ("highest"); 16-bit inputs
    # ignore it. (Following torch's "high" (one TF32 product) would take a second set of kernels.)
    settings = dict(static_shapes=False, autotune_effort="none", dot_precision="tf32x3",
                    ref_mode=RefMode.EAGER if interpret else RefMode.OFF)
    if shimmed():  # (spawned benchmark workers would fail to import helion: measured on torch 2.11)
        settings["autotune_benchmark_subprocess"] = False
    return settings


def interpreting(bound) -> bool:
    """Whether Helion runs this bound kernel in its eager ref mode (HELION_INTERPRET=1)."""
    from helion.runtime.settings import RefMode

    return bound.kernel.settings.ref_mode != RefMode.OFF


def triton_code(kernel, args: tuple, config: dict) -> str:
    """The Triton source Helion generates for ``args`` and ``config`` (works without a GPU:
    the tests use it to check that every kernel lowers)."""
    import helion

    return kernel.bind(args).to_triton_code(helion.Config(**config))
