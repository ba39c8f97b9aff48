"""What the JAX benchmarks share (``jax_suite``, ``jax_sharded``): the median wall time of a jitted call and
the environment fields every JAX result file records. Needs only jax; importing it
imports neither torch nor the torch suites (``logitless_bench/__init__`` is lazy)."""

from __future__ import annotations

import datetime
import platform
import statistics
import time


def median_ms(fn, args, warmup, reps) -> float:
    """Median ms of ``jax.block_until_ready(fn(*args))`` over ``reps`` calls after
    ``warmup`` calls (the first compiles unless fn is already compiled); host wall time,
    calls back to back, so a call's dispatch is in its time."""
    import jax

    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def environment(argv) -> dict:
    """device (its kind, or "cpu (<processor>)"), platform, jax, jaxlib, python, date
    (UTC, to the minute) and the command line of a JAX benchmark run."""
    import jax
    import jaxlib

    dev = jax.devices()[0]
    return {
        "device": dev.device_kind if dev.platform != "cpu" else f"cpu ({platform.processor() or platform.machine()})",
        "platform": dev.platform,
        "jax": jax.__version__, "jaxlib": jaxlib.__version__,
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": "python -m logitless_bench " + " ".join(argv),
    }
