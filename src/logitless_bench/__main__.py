"""``python -m logitless_bench`` and the ``logitless`` console script (see cli.py)."""

import sys

if __name__ == "__main__":
    from logitless_bench.jax_suite import wants_jax

    if wants_jax(sys.argv[1:]):  # the JAX suite needs no torch
        from logitless_bench.jax_suite import main
    else:
        from logitless_bench.cli import main
    sys.exit(main())
