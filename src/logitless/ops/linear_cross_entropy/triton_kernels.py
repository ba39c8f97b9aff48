"""Triton kernels of linear_cross_entropy: they live in the framework-free
``logitless.triton_lib.lce_kernels`` (shared with the JAX "triton" backend)."""

from logitless.triton_lib.lce_kernels import dlogits_kernel, forward_stats_kernel, kept_dlogits_kernel

__all__ = ["forward_stats_kernel", "dlogits_kernel", "kept_dlogits_kernel"]
