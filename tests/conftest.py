"""Test set-up: without CUDA, Triton kernels run on the CPU interpreter.

TRITON_INTERPRET must be set before triton is first imported, so it is set here,
before any test module imports logitless' Triton backends.
"""

import os

import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

#: Device the tests run on: the GPU when there is one, else the CPU (interpreter).
DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")
