"""Triton kernels of linear_log_probs: they live in the framework-free
``logitless.triton_lib.log_probs_kernels`` (shared with the JAX "triton" backend)."""

from logitless.triton_lib.log_probs_kernels import (
    logp_dlogits_kernel,
    logp_forward_kernel,
    logp_kept_dlogits_kernel,
)

__all__ = ["logp_forward_kernel", "logp_dlogits_kernel", "logp_kept_dlogits_kernel"]
