"""Test set-up of the JAX tests (no torch anywhere in tests_jax/).

Runs on jax's default backend: the CPU in CI, the GPU on the GPU machine. JAX would
preallocate 75% of GPU memory at first use, which starves the PyTorch tests when both
sets run in one process: allocate on demand instead (set before jax is imported).
"""

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
