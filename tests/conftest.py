"""Test set-up: without CUDA, Triton kernels run on the CPU interpreter.

TRITON_INTERPRET must be set before triton is first imported, so it is set here,
before any test module imports logitless' Triton backends.
"""

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

#: Device the tests run on: the GPU when there is one, else the CPU (interpreter).
DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")


@pytest.fixture(autouse=True)
def _seeded_global_rng():
    """Tests draw their data from seeded generators; what still comes from torch's global
    RNG (shapes of bad inputs, a few helpers) is the same in every run and every order."""
    torch.manual_seed(0)
