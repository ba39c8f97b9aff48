"""What the JAX bench scripts of benchmarks/gpu share: the median wall time of a jitted
call (``logitless_bench.jax_timing``'s, with src/ on PYTHONPATH as gpu_env puts it), and
running one case so that a failure is reported and the run goes on. Imported as
``_jax_bench_common`` by a script run as ``python benchmarks/gpu/X.py`` (its folder is
then on sys.path)."""

from __future__ import annotations

import sys
import time
import traceback

from logitless_bench.jax_timing import median_ms as _median_ms

_after_case = None


def median_ms(fn, *args, iters=5, warmup=1):
    """Median ms of ``jax.block_until_ready(fn(*args))`` over ``iters`` calls after
    ``warmup`` calls (the first compiles); host wall time, calls back to back
    (``logitless_bench.jax_timing.median_ms``, the JAX suites' own)."""
    return _median_ms(fn, args, warmup, iters)


def after_each_case(save) -> None:
    """``save()`` runs after every case (e.g. writes the JSON and the table so far): if a
    kernel hangs and the script's timeout kills the run, what was measured is kept."""
    global _after_case
    _after_case = save


def run_case(name, fn, results, key):
    """results[key] = fn(), or {"error": ...} with the traceback printed if it raises
    (diagnostics of one-shot GPU runs); then the after_each_case hook."""
    print(f"  [{name}] starting", flush=True)
    t0 = time.perf_counter()
    try:
        results[key] = fn()
        print(f"  [{name}] ok ({time.perf_counter() - t0:.1f}s): {results[key]}", flush=True)
    except Exception as e:  # noqa: BLE001 - diagnostics of one-shot GPU runs
        results[key] = {"error": f"{type(e).__name__}: {str(e)[:2000]}"}
        print(f"  [{name}] FAILED ({time.perf_counter() - t0:.1f}s): {type(e).__name__}: {e}", flush=True)
        traceback.print_exc()
        sys.stdout.flush()
    if _after_case is not None:
        _after_case()
