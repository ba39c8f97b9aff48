"""logitless.jax.linear_topk_kl: KL divergence between a teacher's top-k log-probabilities
and the student's distribution, from the student's hidden states and LM-head weight,
without its logits. Files: ``api`` (the function, checks, the custom_vjp), ``contract``
(what a backend receives and returns), ``backends`` (the table), ``xla_backend`` /
``mosaic_gpu_backend`` (the kinds that run it; "triton" and "mosaic_tpu" refuse it in
``unsupported``), ``sharded`` (per device: vocabulary merges, custom_partitioning),
``reference`` (float64 NumPy). The math: ``logitless/jax/formulas/topk_kl.py``."""
