"""Shared CuTe DSL (nvidia-cutlass-dsl, optional) kernels for Hopper (sm_90a).

``forward_stats``: the fused linear forward statistics kernel (framework-free: it imports
cutlass only, never torch, because the DSL's preprocessor re-executes a kernel module's
imports); ``launch``: the torch-side launcher. Neither is imported by ``import logitless``:
the planner (``planning.cute``) decides, and the backends import ``launch`` lazily.
"""
