"""``python -m logitless_bench``: logitless against its peers, in one process and one run.

Where to look:
    cli.py        the command line, the CPU fallback, the final tables (__main__.py calls it)
    timing.py     how time (CUDA events / perf_counter), peak memory and the units are measured
    peers.py      one adapter per method (logitless budgets, torch eager/compile, liger, cce,
                  torch's own F.linear_cross_entropy and logitless behind it via patch_torch)
    lce.py        suite lce: fused linear cross-entropy, per shape and method
    ce.py         suite ce: cross-entropy on materialised logits (bandwidth-bound)
    reference.py  float64 references, chunked over tokens, for the error columns
    report.py     JSON / markdown files and the printed tables; plot.py: the PNG
    jax_suite.py  suite jax: the JAX op vs XLA with logits, tokamax, a GEMM (no torch needed)
    jax_sharded.py  suite jax-sharded: the JAX op under NamedSharding on all local devices
    jax_timing.py the JAX suites' median time and environment
    compare.py    ``compare OLD.json NEW.json``: the regression report between two runs
    shapes.py     every suite's shapes (lce, models, distill, rl, jax) and the --shapes selection
"""



def main(argv=None) -> int:
    """The command line (``cli.main``; without torch, ``jax_suite.main``: only the JAX
    suites run). Imported on call, so that ``import logitless_bench.<module>`` (e.g.
    ``jax_timing`` from a JAX-only script) does not import torch and the torch suites."""
    try:
        from .cli import main as cli_main
    except ImportError as exc:  # no torch: only ``--suite jax`` / ``jax-sharded`` run
        if exc.name != "torch":
            raise
        from .jax_suite import main as cli_main
    return cli_main(argv)


__all__ = ["main"]
