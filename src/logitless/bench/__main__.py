"""``python -m logitless.bench`` and the ``logitless`` console script (see cli.py)."""

import sys

if __name__ == "__main__":
    from logitless.bench.jax_suite import wants_jax

    if wants_jax(sys.argv[1:]):  # the JAX suite needs no torch
        from logitless.bench.jax_suite import main
    else:
        from logitless.bench.cli import main
    sys.exit(main())
