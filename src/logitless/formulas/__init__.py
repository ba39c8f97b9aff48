"""The math of every op, written once for PyTorch (the JAX twin: ``logitless.jax.formulas``,
under the same module names).

The docstrings are the specification: every backend (PyTorch tiles, Triton kernels)
reduces each token's row of logits to a few fp32 statistics, and these modules turn
the statistics into losses, reductions and the per-token coefficients of the one
gradient line the kernels evaluate.

    common         compute dtype, soft-cap, reductions, merge of split statistics
    cross_entropy  cross-entropy with label smoothing, class weights and z-loss
    jsd            generalized Jensen-Shannon distillation
    topk_kl        top-k distillation: KL over a teacher's top-k ids, their tail
"""
