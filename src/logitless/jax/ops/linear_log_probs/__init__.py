"""Token log-probs and entropy for JAX (``logitless.jax.linear_log_probs``): api
(public), reference (float64, logits materialised), one file per backend.

Backend interface (2-D arrays; everything after ``*`` static):

``forward(x2d, w, bias, tokens, *, opts, budget, weight_layout="vh") -> (lse, target, entropy)``
    x2d (N, H), w (V, H) (or (H, V) with ``weight_layout="hv"``), bias (V,) or None,
    tokens (N,) int32 (ignored or out-of-range tokens may hold anything: the backend
    must not fail on them). Returns (N,) fp32
    lse and a_t of a = softcap(x w^T + b) / T, and H (None without ``opts.entropy``).

``backward(x2d, w, bias, tokens, lse, coef, *, opts, budget, weight_layout="vh") -> (dx, dw, db)``
    coef: (3, N) fp32 rows [A, B, C] of ``logitless.jax.formulas.log_probs``;
    dz = p (A + C log p) - B [c == t] (x cap'), dx = dz w, dw = dz^T x, db = sum dz,
    accumulated in fp32 and cast once to the inputs' dtypes; dw in w's layout.

``NATIVE_HV = True`` (module constant; every backend here has it): the keyword
``weight_layout="hv"`` is accepted and w is the caller's (H, V) kernel, read in place
(the contract of linear_cross_entropy's backends). Without it the api would pass
``weight.T``.

Backends (``backends.BACKENDS``; automatic choice ``backends.choose_backend``, the
policy shared with linear_cross_entropy): "xla" (plain JAX, chunked) and "triton" (the
PyTorch op's Triton kernels through jax-triton; Triton's interpreter without a GPU;
optional ``is_supported`` hook as for linear_cross_entropy) and "mosaic_gpu" (Pallas
Mosaic GPU kernels on SM90, ``logitless.jax.mosaic_lib``; bf16/f16), selected by name
only: not in the automatic choice (``backends.AUTOMATIC``) until it can run per device
under sharding (no ``can_partition`` yet), and "mosaic_tpu" (Pallas TPU kernels,
``logitless.jax.mosaic_tpu_lib``; automatic on a TPU, TPU interpret mode elsewhere).

``can_partition() -> bool`` (optional): whether the backend may run per device on
several devices (``sharded.py``: custom_partitioning / shard_map); without it only
"xla" is partitioned and other backends run the unsharded program. Per device the
backend sees local shapes, tokens as local column ids (-1 off the shard) and
``opts.ignore_index == -1``.
"""
