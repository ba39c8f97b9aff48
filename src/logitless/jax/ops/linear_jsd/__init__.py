"""logitless.jax.linear_jsd: distillation (generalized JSD) between a student and a teacher
LM head, from their hidden states and weights, without their logits. Files: ``api``
(the function, checks, the custom_vjp), ``contract`` (what a backend receives and
returns), ``backends`` (the table), ``xla_backend`` / ``triton_backend`` (the kinds that
run it; "mosaic_gpu" and "mosaic_tpu" refuse it in ``unsupported``), ``sharded`` (per
device: vocabulary merges, custom_partitioning), ``reference`` (float64 NumPy). The math:
``logitless/jax/formulas/jsd.py``."""
