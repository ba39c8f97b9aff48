"""Helion kernels of the fused LM-head ops (linear_cross_entropy, linear_log_probs,
linear_jsd): one module of kernels per op (``*_kernels``) and one of launch functions per
op, mirroring ``triton_lib``. Helion is optional (the ``helion`` extra): this package
imports without it; the kernel modules import helion, the launch functions import them
lazily and raise a clear error without it (``runtime.available()`` says whether it is
there). See docs/helion.md.
"""

from logitless.helion_lib.runtime import available

__all__ = ["available"]
