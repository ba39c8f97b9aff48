"""Triton kernels of jsd on logits the caller holds (in ``triton_lib.jsd_rows``, shared with
linear_jsd's fp32 logit chunks). One kernel per idea; the math is in
``logitless.formulas.jsd`` (Triton twin: ``triton_lib.jsd_math``), launch sizes in ``planning.plans``.

Shapes: student logits zs and teacher logits zt (N, V), each addressed through its own
(row stride, column stride) and dtype. Offsets are 64-bit. Both kernels are
bandwidth-bound: the forward reads both rows once (beta 0 or 1) or twice (the mixture),
the backward reads both once and writes dz once; the rest is O(N).
"""

from logitless.triton_lib.jsd_rows import jsd_backward_kernel  # noqa: F401  (shared with linear_jsd)
