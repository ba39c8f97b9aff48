"""``python -m logitless_bench`` and the ``logitless-bench`` console script (see cli.py)."""

import sys


def main(argv=None) -> int:
    """The JAX suites without importing torch; every other command through cli.py."""
    argv = list(sys.argv[1:] if argv is None else argv)
    from logitless_bench.jax_suite import wants_jax

    if wants_jax(argv):  # the JAX suites need no torch
        from logitless_bench.jax_suite import main as run
    else:
        from logitless_bench.cli import main as run
    return run(argv)


if __name__ == "__main__":
    sys.exit(main())
