"""Token log-probs and entropy for JAX (``logitless.jax.linear_log_probs``): api
(public), reference (float64, logits materialised), one file per backend.

Backend contract (``contract.LlpBackend``, ``logitless/jax/ops/common/contract.py``): one
class per backend in its ``<name>_backend.py``, listed in one table (``backends.BACKENDS``,
made on first use), each its kind's base (``logitless/jax/ops/common/<kind>.py``:
``unsupported``, ``can_partition``, ``plan``, the Config) plus this op's ``forward`` and
``backward``; 2-D arrays, everything after ``*`` static:

``unsupported(x2d_shape, w_shape (V, H), dtype, *, softcap, has_bias, ...) -> None | str``
    None when the backend runs the case; else the reason an explicit
    ``implementation=`` is refused with (the automatic choice skips it).

``plan(x2d_shape, w_shape (V, H), dtype, *, budget, weight_layout, has_bias) -> Config``
    the call's frozen Config (tiles, chunks, the weight's layout): the only place where
    heuristics decide. Made once per call (the api; per device ``contract.local_plan``)
    and given to the forward and the backward.

``forward(x2d, w, bias, tokens, config, *, opts) -> LlpStats(lse, token_logit, entropy)``
    x2d (N, H), w (V, H) (or the caller's (H, V) kernel, read in place, when the
    Config's ``weight_layout`` is "hv"; every backend here has ``native_hv``), bias
    (V,) or None, tokens (N,) int32 (ignored or out-of-range tokens may hold anything:
    the backend must not fail on them). Returns (N,) fp32 lse and a_t of
    a = softcap(x w^T + b) / T, and H (None without ``opts.entropy``).

``backward(LlpResiduals(x2d, w, bias, tokens, lse), coef, config, *, opts) -> LlpGrads(dx, dw, db)``
    coef: (3, N) fp32 rows [A, B, C] of ``logitless.jax.formulas.log_probs``;
    dz = p (A + C log p) - B [c == t] (x cap'), dx = dz w, dw = dz^T x, db = sum dz,
    accumulated in fp32 and cast once to the inputs' dtypes; dw in w's layout.

Backends (automatic choice ``backends.choose_backend``, the policy shared with
linear_cross_entropy): "xla" (plain JAX, chunked; its forward and backward also take
``tau``, truncated sampling) and "triton" (the PyTorch op's Triton kernels through
jax-triton; Triton's interpreter without a GPU) and "mosaic_gpu" (Pallas Mosaic GPU
kernels on SM90, ``logitless.jax.mosaic_lib``; bf16/f16), selected by name only (not in
``BACKENDS.automatic``), and "mosaic_tpu" (Pallas TPU kernels,
``logitless.jax.mosaic_tpu_lib``; automatic on a TPU, TPU interpret mode elsewhere).

``can_partition() -> bool``: whether the backend may run per device on several devices
(``sharded.py``: custom_partitioning / shard_map); a backend that cannot (an interpreter's
host callbacks) runs the unsharded program. Per device the backend sees local shapes,
tokens as local column ids (-1 off the shard) and ``opts.ignore_index == -1``.
"""
