"""Fused linear cross-entropy for JAX: api (public), reference (float64), one file per backend.

Backend contract
================
Every backend is one class (``contract.LceBackend``, after the JAX ops' ``Backend``
Protocol in ``logitless/jax/ops/common/contract.py``) in its module
``logitless/jax/ops/linear_cross_entropy/<name>_backend.py`` (``XlaBackend``,
``TritonBackend``, ``MosaicGpuBackend``, ``MosaicTpuBackend``: the torch side's naming),
listed by name in one table, ``backends.BACKENDS`` (a ``BackendTable``: each made on
first use, so an optional dependency is imported only when asked for). Each class is
its kind's base (``XlaBase``, ``TritonBase``, ``MosaicGpuBase``, ``MosaicTpuBase`` in
``logitless/jax/ops/common/<kind>.py``: ``unsupported``, ``can_partition``, ``plan`` and the
Config) plus this op's ``forward``/``backward`` and capabilities. The public
function validates, flattens to 2-D, computes the loss from the statistics
(``logitless/jax/formulas/cross_entropy.py``) and wraps everything in one
``jax.custom_vjp``; a backend only computes statistics and gradients of 2-D arrays. All
arguments after ``*`` and the Config are static Python values (hashable; the methods
are traced under ``jax.jit`` and must not call ``jax.device_get`` or branch on array
values).

``unsupported(x2d_shape, w_shape, dtype, *, softcap, has_bias, has_class_weight, need_argmax)``
``-> None | str``
    None when the backend runs the case (``w_shape`` is (V, H) whatever the layout);
    else the reason: ``implementation=None`` skips the backend, an explicit
    ``implementation="<name>"`` raises ValueError with the reason appended.

``plan(x2d_shape, w_shape, dtype, *, budget, weight_layout, has_bias) -> Config``
    the call's frozen Config (the kind's, ``common/<kind>.py``: ``XlaConfig``: the logits
    tile; ``TritonConfig``: the launch plan; ``MosaicGpuConfig``: tiles and the backward's
    chunk; ``MosaicTpuConfig``: tiles; each with the weight's layout): the only place where
    heuristics decide. The api makes it once per call, a static argument of the
    custom_vjp, and the forward and the backward take it; per device (sharded jit)
    ``common.contract.local_plan`` makes it once per shapes.

``forward(x2d, w, bias, target, config, *, softcap, need_smooth, class_weight=None,``
``need_argmax=False) -> LceStats(lse, target_logit, smooth_sum, best, argmax)``
    x2d:     (N, H) bf16/f16/f32, N >= 1
    w:       (V, H), same dtype as x2d; (H, V) when the Config's weight_layout is "hv"
             (``native_hv``, below)
    bias:    (V,) same dtype as w, or None
    target:  (N,) int32; ignored or out-of-range targets may hold any value: the
             backend must not fail on them (target_logit there may be anything finite
             or not; the api masks it)
    softcap: float or None; z = s * tanh(logit / s) when set, logit = x @ w.T + bias
    need_smooth: bool; whether smooth_sum is wanted (label smoothing)
    returns, each (N,) float32:
        lse          = log sum_c exp(z_c)              (over exactly V columns)
        target_logit = z_t                              (z at the target column)
        smooth_sum   = sum_c z_c, or None when not need_smooth

``backward(LceResiduals(x2d, w, bias, target, class_weight, lse), coef, config, *, softcap)``
``-> LceGrads(dx, dw, db)``
    lse:  (N,) f32 from forward; coef: (3, N) f32 rows [A, B, C] from
    ``formulas.cross_entropy.grad_coefficients`` (zero rows at ignored tokens, NaN rows at
    out-of-range targets). With p_c = exp(z_c - lse):
        dz_c = p_c * A - B * [c == t] - C,   times (1 - (z_c / s)**2) with a softcap
        dx = dz @ w (N, H) in x2d.dtype;  dw = dz.T @ x2d (V, H) in w.dtype
        ((H, V) = x2d.T @ dz for weight_layout "hv": dw always has w's layout);
        db = sum_n dz (V,) in bias.dtype, or None when bias is None.
    Accumulate in fp32 and cast once.

``class_weights`` (class attribute): forward and backward also take ``class_weight`` (a
(V,) fp32 array w_c; None without class weights). Then smooth_sum = sum_c w_c z_c, and
the backward's line is dz_c = p_c * A - B * [c == t] - C * w_c (``formulas/cross_entropy.py``:
A and B carry w_t). Without it ``unsupported`` refuses class weights: the automatic
choice skips the backend and an explicit choice raises ValueError. (xla, triton and
mosaic_tpu have it; mosaic_gpu not.)

``argmax`` (class attribute): forward takes ``need_argmax=True`` (the api passes it only
for ``return_stats``) and then also fills best = max_c z_c (float32) and argmax = the
first c where z_c is that maximum (int32, local column ids; ties: the lowest id, as
``jnp.argmax``), from the same pass over the columns. Without it the automatic choice
skips the backend when ``return_stats=True``; an explicit choice runs it and
``LossStats.argmax`` is None. (xla and triton have it; mosaic_gpu and mosaic_tpu not: their
kernels keep no running argmax.) Under vocabulary sharding the api merges the
devices' (best, argmax) pairs: the first device holding the largest maximum.

``native_hv`` (class attribute): the backend reads an (H, V) weight, the caller's
flax-style kernel, in place when its Config's weight_layout is "hv" (no transposed copy
in the backend either: XLA dot_general dimensions, Triton strides, Mosaic TMA/WGMMA
tiles, Mosaic TPU blocks), and returns dw (H, V). Every backend here has it (the same
contract for linear_log_probs' backends), so no call transposes the weight under jit,
grad, vmap or sharding (``tests_jax/test_weight_layout.py``). A backend without it would
get ``weight.T`` from the api (a copy) with its gradient flowing back through the transpose.

``can_partition() -> bool``: False keeps the backend out of the sharded jit path
(``custom_partitioning``); the program then runs unpartitioned (XLA gathers). Only for
test modes such as Mosaic GPU's interpreter.

The modules keep their kernel-level functions (``forward``/``backward`` with explicit
tiles; mosaic_gpu's ``why_unsupported``, its ``why_not``): the classes call them with their Config.

Sharding (``sharded.py``): a backend is called per device on its shard, with the
per-device shapes, and must not know about meshes: the api shifts the targets by the
shard's first class (targets outside the local [0, V) match no column: a backend's
target_logit there is masked to 0 by the caller, and its backward must treat them as
"no target column", which the dz formula does) and merges the statistics and
gradients with collectives. Loop carries that start as constants must be typed like
the inputs inside ``jax.shard_map`` (``sharded.to_varying(c, axes)``, see xla_backend.py).

Automatic choice (``implementation=None``), on an NVIDIA GPU: "mosaic_gpu" when its
compute capability is 9.x, the module imports and ``unsupported`` says None; else
"triton" when it imports and ``unsupported`` says None (which needs the optional
``jax-triton`` package); on a TPU, "mosaic_tpu" (Pallas TPU kernels; selectable by
name elsewhere, where they run in Pallas' TPU interpret mode); otherwise "xla".
"""
