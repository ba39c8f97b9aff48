"""Test set-up of the JAX tests (no torch anywhere in tests_jax/).

Runs on jax's default backend: the CPU in CI, the GPU on the GPU machine. JAX would
preallocate 75% of GPU memory at first use, which starves the PyTorch tests when both
sets run in one process: allocate on demand instead (set before jax is imported).
fp32 matmuls run at "highest" precision: on GPUs JAX's default may use TF32, whose
rounding would dominate the comparisons against float64 (the op follows
``jax_default_matmul_precision``, like any jnp.dot; bf16/f16 inputs are unaffected).
The CPU gets 8 host devices (``--xla_force_host_platform_device_count=8``, before jax
is imported) for the sharded tests (test_jax_sharded.py); every other test then also
runs with several devices present, i.e. through the op's multi-device jit path with
unsharded inputs. The flag only affects the CPU platform.
"""

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
