"""Which backend runs an op: Triton on CUDA, PyTorch elsewhere (shared by every op)."""

from __future__ import annotations

import importlib
import os

import torch

BACKENDS = ("auto", "triton", "torch")


def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def backend_module(op_package: str, name: str, device: torch.device, dtype: torch.dtype):
    """The module ``{op_package}.{triton,torch}_backend`` for a backend name and inputs.

    "auto": Triton for CUDA tensors of 16/32-bit floats when triton is installed, else
    PyTorch. "triton" on CPU tensors needs TRITON_INTERPRET=1 (the interpreter).
    """
    if name not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {name!r}")
    if name == "auto":
        cuda_ok = device.type == "cuda" and dtype != torch.float64
        name = "triton" if cuda_ok and _triton_available() else "torch"
    if name == "triton":
        if dtype == torch.float64:
            raise TypeError("backend='triton' supports float16, bfloat16 and float32; "
                            "use backend='torch' for float64")
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(
                f"backend='triton' needs CUDA tensors (got {device}); set "
                "TRITON_INTERPRET=1 to run the kernels on the CPU interpreter"
            )
    return importlib.import_module(f"{op_package}.{name}_backend")
