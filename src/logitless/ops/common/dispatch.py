"""Which backend runs an op: Triton on CUDA, PyTorch elsewhere (shared by every op).

``resolve_backend`` runs in the public functions (plain Python that torch.compile
traces: no imports, no host syncs); ``load_backend`` runs inside the custom ops'
implementations, which torch.compile never traces.
"""

from __future__ import annotations

import importlib
import importlib.util
import os

import torch

BACKENDS = ("auto", "triton", "torch")
#: The fused linear ops' backends: BACKENDS and "helion" (``ops/<op>/helion_backend.py``,
#: chosen only by name; without a usable Helion it runs another backend: ``helion_choice``).
LINEAR_BACKENDS = (*BACKENDS, "helion")

#: Whether triton is installed (decided once, at import).
HAS_TRITON = importlib.util.find_spec("triton") is not None


def resolve_backend(name: str, device: torch.device, dtype: torch.dtype, backends: tuple = BACKENDS) -> str:
    """The backend ("triton", "torch", or "helion" where ``backends`` has it) for a backend
    name and the inputs, or a clear error.

    "auto": Triton for CUDA tensors of 16/32-bit floats when triton is installed, else
    PyTorch. "triton" needs the triton package (else ModuleNotFoundError naming
    ``pip install triton``) and, on CPU tensors, TRITON_INTERPRET=1 (the interpreter).
    "helion" takes 16/32-bit floats; whether Helion can run is decided in the op.
    """
    if name not in backends:
        raise ValueError(f"backend must be one of {backends}, got {name!r}")
    if name == "helion" and dtype == torch.float64:
        raise TypeError("backend='helion' supports float16, bfloat16 and float32; use backend='torch' for float64")
    if name == "auto":
        cuda_ok = device.type == "cuda" and dtype != torch.float64
        name = "triton" if cuda_ok and HAS_TRITON else "torch"
    if name == "triton":
        if not HAS_TRITON:
            raise ModuleNotFoundError(
                "backend='triton' needs the triton package: pip install triton (on a CPU, then set "
                "TRITON_INTERPRET=1 for its interpreter); or use backend='torch' (or 'auto')", name="triton")
        if dtype == torch.float64:
            raise TypeError("backend='triton' supports float16, bfloat16 and float32; "
                            "use backend='torch' for float64")
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(
                f"backend='triton' needs CUDA tensors (got {device}); set "
                "TRITON_INTERPRET=1 to run the kernels on the CPU interpreter (slow: tests only), "
                "or use backend='torch'"
            )
    return name


def load_backend(op_package: str, name: str):
    """The module ``{op_package}.{name}_backend`` of a resolved backend name.

    Runs in every forward and backward: after the first import the module comes from a dict
    (without ``importlib.import_module``'s ~5 Python calls of import machinery). Not from
    ``sys.modules``: a module another thread is still importing is there half-initialised
    (nn.DataParallel runs the first steps of its copies at once, in threads); the import
    machinery waits for it, and only complete modules enter the dict."""
    key = f"{op_package}.{name}_backend"
    module = _LOADED.get(key)
    if module is None:
        module = _LOADED[key] = importlib.import_module(key)
    return module


#: ``load_backend``'s modules, each entered after its import completed.
_LOADED: dict = {}


def load_strategy(op_package: str, backend: str, strategy: str):
    """The module ``{op_package}.{backend}_{strategy}`` (a strategy of a resolved backend,
    e.g. ``triton_grad_in_forward``), or None when that backend has none. Looked up once
    per name, then from a dict (as ``load_backend``)."""
    key = f"{op_package}.{backend}_{strategy}"
    try:
        return _STRATEGIES[key]
    except KeyError:
        pass
    module = importlib.import_module(key) if importlib.util.find_spec(key) is not None else None
    _STRATEGIES[key] = module
    return module


#: ``load_strategy``'s answers, each entered after its import completed.
_STRATEGIES: dict = {}


def backend_module(op_package: str, name: str, device: torch.device, dtype: torch.dtype):
    """``resolve_backend`` then ``load_backend`` (eager callers, benchmarks). Takes
    LINEAR_BACKENDS: a public function that has no "helion" refuses it before."""
    return load_backend(op_package, resolve_backend(name, device, dtype, LINEAR_BACKENDS))
