"""``python -m logitless_bench``: logitless against its peers, in one process and one run.

Where to look:
    cli.py        the command line, the CPU fallback, the final tables (__main__.py calls it)
    timing.py     how time (CUDA events / perf_counter), peak memory and the units are measured
    peers.py      one adapter per method (logitless budgets, torch eager/compile, liger, cce)
    lce.py        suite lce: fused linear cross-entropy, per shape and method
    ce.py         suite ce: cross-entropy on materialised logits (bandwidth-bound)
    reference.py  float64 references, chunked over tokens, for the error columns
    report.py     JSON / markdown files and the printed tables; plot.py: the PNG
    jax_suite.py  suite jax: the JAX op vs XLA with logits, tokamax, a GEMM (no torch needed)
The lce shapes are in ``logitless/linear_cross_entropy/bench_shapes.py``.
"""

try:
    from .cli import main
except ImportError as _exc:  # no torch: only ``--suite jax`` runs (see __main__.py)
    if _exc.name != "torch":
        raise
    from .jax_suite import main
    del _exc

__all__ = ["main"]
