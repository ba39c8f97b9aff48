"""``python -m logitless_bench --suite jax``: the JAX linear cross-entropy against XLA with
the logits, tokamax and a GEMM, in one process and one run. Needs only jax (no torch).

Methods (each skipped with a note when unavailable):
    gemm              jnp.dot(x, w.T) of the same shape, jitted: the unit (1 GEMM)
    gemm-hv           jnp.dot(x, kernel) with the (H, V) kernel: the unit of the rows that
                      take the weight that way (-hv, tokamax), added when one of them runs
    logitless-xla     logitless.jax.linear_cross_entropy(implementation="xla"), default budget
    logitless-mosaic  the same with implementation="mosaic_gpu" (SM90 GPUs, when present)
    logitless-triton  the same with implementation="triton" (NVIDIA GPUs with jax-triton;
                      skipped on CPUs, where the kernels would run on Triton's interpreter)
    logitless         the default call: implementation=None, memory_budget=None (the
                      automatic backend, 3% of JAX's allocator limit)
    logitless-*-hv    each of the four with the weight as a flax (H, V) kernel
                      (``weight_layout="hv"``, tokamax's layout): the same kernels reading
                      (H, V) in place; its temp MiB columns against the (V, H) row show
                      that no transposed copy of the weight is made
    xla-logits        optax-style: fp32 logits x @ w.T materialised, log_softmax, mean
    xla-logits-bf16   what MaxText and most JAX code do: bf16 logits ``(x @ w.T)``, cast to
                      f32, log-sum-exp minus the label's logit (``jax_timing.bf16_logits_loss``,
                      its code in the result files); -hv: ``x @ kernel`` with the (H, V) kernel
    tokamax-xla       tokamax.linear_softmax_cross_entropy_loss(implementation="xla")
    tokamax-chunked   the same with implementation="chunked_xla"
Metrics per shape and method: fwd and fwd+bwd medians (jit, block_until_ready, warm-ups),
fwd / 1 GEMM and fwd+bwd / 3 GEMMs, XLA's compiled temporary bytes of the fwd and of
the fwd+bwd (``memory_analysis().temp_size_in_bytes``), |mean loss - ref| and the largest per-token
|loss - ref| against a float64 reference (jax with x64, chunks of tokens). ``--profile``: per
row also the fwd+bwd's kernels from a device profile (``jax_timing.device_profile``: GPU ms
per step by kernel name, in the JSON's "kernels"; the largest printed).
Files: benchmarks/results/jax-<tag>-<date>.json/.md (+ latest-jax-<tag>.*, + .png), where
<tag> is the GPU's short name (H100), or "cpu" for a ``--cpu`` run or a machine without GPU.

Time: ``--max-minutes M`` bounds the whole run: no new shape or method starts once less
than a reserve (for writing the files) is left, a method is skipped where its time on
an earlier shape would not fit in what is left, a method that took longer than
``--method-seconds`` on one shape is skipped on the next ones, and at M minutes a timer
interrupts whatever runs (when Python regains control) and the partial results are
written. Compile times are printed per method (column "compile s": fwd + fwd+bwd).
"""

from __future__ import annotations

import argparse
import fnmatch
import os
import sys
import time
from pathlib import Path

from .common import line_buffered_stdout, table_report, write_results
from .jax_timing import environment as jax_environment
from .jax_timing import median_ms as _median_ms

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

METHODS = ("gemm", "gemm-hv", "logitless", "logitless-hv", "logitless-xla", "logitless-mosaic", "logitless-triton",
           "logitless-xla-hv", "logitless-mosaic-hv", "logitless-triton-hv", "xla-logits", "xla-logits-bf16",
           "xla-logits-bf16-hv", "tokamax-xla", "tokamax-chunked")
#: Run when --methods is not given: tokamax's "xla" backend materialises the logits as
#: xla-logits does (same cost); ask for it with --methods all or by name.
#: logitless-mosaic last: should a kernel hang on a new GPU, the shape's other rows are
#: already written (the files are saved after every row).
DEFAULT_METHODS = ("gemm", "gemm-hv", "logitless-xla", "logitless-xla-hv", "xla-logits", "xla-logits-bf16",
                   "xla-logits-bf16-hv", "tokamax-chunked", "logitless-triton", "logitless-triton-hv",
                   "logitless-mosaic", "logitless-mosaic-hv", "logitless", "logitless-hv")
#: Seconds kept for writing the files when --max-minutes is given.
_RESERVE_S = 15.0


class Skip(Exception):
    pass


JAX_SUITES = ("jax", "jax-sharded", "jax-distill")


def _suite(argv):
    argv = list(argv)
    for i, a in enumerate(argv):
        if a == "--suite" and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith("--suite="):
            return a.split("=", 1)[1]
    return None


def wants_jax(argv) -> bool:
    """Whether a command line asks for a JAX suite (``--suite jax`` or ``jax-sharded``,
    also as ``--suite=...``): those run without torch."""
    return _suite(argv) in JAX_SUITES


def build_parser():
    p = argparse.ArgumentParser(
        prog="python -m logitless_bench --suite jax",
        description="JAX linear cross-entropy: logitless vs XLA with the logits, tokamax, a GEMM.")
    p.add_argument("--suite", choices=("jax",), default="jax")
    p.add_argument("--shapes", help="names or shell patterns, comma-separated (default: all six; CPU: the small ones)")
    p.add_argument("--methods", help=f"comma-separated subset of {','.join(METHODS)}, or 'all' "
                   f"(default: {','.join(DEFAULT_METHODS)})")
    p.add_argument("--quick", action="store_true", help="first shape, 1 warm-up, 3 reps")
    p.add_argument("--warmup", type=int)
    p.add_argument("--reps", type=int)
    p.add_argument("--rounds", type=int, default=1,
                   help="R > 1: per shape, after every method is measured, R - 1 more rounds that time each "
                        "method's compiled fwd and fwd+bwd in turn (interleaved: a clock or thermal drift "
                        "falls on every method alike); the medians over the R rounds are reported")
    p.add_argument("--no-errors", action="store_true", help="skip the float64 reference")
    p.add_argument("--memory-budget", type=int,
                   help="memory_budget= of the logitless methods in bytes (default: None, the device's default)")
    p.add_argument("--profile", action="store_true",
                   help="per row also the fwd+bwd's kernels from a device profile (GPU ms per step by name)")
    p.add_argument("--max-minutes", type=float,
                   help="bound the run to M minutes (files are written within them; see the module doc)")
    p.add_argument("--method-seconds", type=float, default=60.0,
                   help="skip a method on the remaining shapes after it took longer than this on one (default 60)")
    p.add_argument("--cpu", action="store_true", help="the small CPU shapes even on a GPU")
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--list", action="store_true")
    return p


def _tokamax():
    try:
        from tokamax._src.ops.linear_softmax_cross_entropy_loss import api as tk
    except Exception as exc:
        raise Skip(f"tokamax not importable ({type(exc).__name__}: {exc})") from exc
    return tk


def layout(method: str) -> str:
    """The weight layout a method reads: "hv" (the (H, V) kernel) or "vh"."""
    return "hv" if method.endswith("-hv") or method.startswith("tokamax") else "vh"


def _unit(units: dict, method: str):
    """The GEMM ms a method's ratios are against: its layout's, else the "vh" one (or None)."""
    return units.get(layout(method)) or units.get("vh")


def _loss_fns(method, budget=None):
    """(mean loss fn(x, w_vh, w_hv, t), per-token loss fn) of a method, or Skip;
    ``budget``: the logitless methods' memory_budget."""
    import jax
    import jax.numpy as jnp

    hv = method.endswith("-hv")
    base = method[:-3] if hv else method
    if base in ("logitless", "logitless-xla", "logitless-mosaic", "logitless-triton"):
        from logitless.jax import linear_cross_entropy
        impl = {"logitless": None, "logitless-xla": "xla", "logitless-mosaic": "mosaic_gpu",
                "logitless-triton": "triton"}[base]
        if impl == "triton":
            if jax.devices()[0].platform != "gpu":
                raise Skip("triton on a CPU runs on Triton's interpreter: tests only")
            from logitless.jax.ops.common import triton as rt
            if rt.jax_triton() is None:
                raise Skip("jax-triton not importable (pip install jax-triton)")
        if impl == "mosaic_gpu":
            try:
                from logitless.jax.ops.linear_cross_entropy import mosaic_gpu_backend  # noqa: F401
            except ImportError as exc:
                raise Skip(f"mosaic_gpu backend not importable ({type(exc).__name__})") from exc
            from logitless.jax.ops.common.choice import is_sm90
            if not is_sm90():
                raise Skip("mosaic_gpu needs an SM90 GPU")
        kw = dict(implementation=impl, memory_budget=budget)
        if hv:  # the flax (H, V) kernel, read in place
            return (lambda x, w, wt, t: linear_cross_entropy(x, wt, t, weight_layout="hv", **kw),
                    lambda x, w, wt, t: linear_cross_entropy(x, wt, t, reduction="none", weight_layout="hv", **kw))
        return (lambda x, w, wt, t: linear_cross_entropy(x, w, t, **kw),
                lambda x, w, wt, t: linear_cross_entropy(x, w, t, reduction="none", **kw))
    if method == "xla-logits":
        def per_tok(x, w, wt, t):
            logits = jnp.dot(x, w.T, preferred_element_type=jnp.float32)
            logp = jax.nn.log_softmax(logits, axis=-1)
            return -jnp.take_along_axis(logp, t[:, None], axis=-1)[:, 0]
        return (lambda *a: per_tok(*a).mean()), per_tok
    if base == "xla-logits-bf16":
        from .jax_timing import bf16_logits_loss, bf16_logits_loss_hv

        def per_tok_bf16(x, w, wt, t):
            logits = (x @ (wt if hv else w.T)).astype(jnp.float32)
            lse = jax.nn.logsumexp(logits, axis=-1)
            return lse - jnp.take_along_axis(logits, t[:, None], axis=-1)[:, 0]
        if hv:
            return (lambda x, w, wt, t: bf16_logits_loss_hv(x, wt, t)), per_tok_bf16
        return (lambda x, w, wt, t: bf16_logits_loss(x, w, t)), per_tok_bf16
    if method.startswith("tokamax-"):
        tk = _tokamax()
        impl = {"tokamax-xla": "xla", "tokamax-chunked": "chunked_xla"}[method]
        loss = tk.linear_softmax_cross_entropy_loss
        return (lambda x, w, wt, t: loss(x, t, wt, reduction="mean", implementation=impl),
                lambda x, w, wt, t: loss(x, t, wt, reduction="none", implementation=impl))
    raise ValueError(method)


def _ref_rows(xc, w64, tc):
    """float64 per-token losses of one chunk of tokens (w64 an argument: a jitted
    function closing over it would embed it as a constant, gigabytes at real shapes)."""
    import jax
    import jax.numpy as jnp

    z = jnp.asarray(xc, jnp.float64) @ w64.T
    lse = jax.nn.logsumexp(z, axis=-1)
    return lse - jnp.take_along_axis(z, tc[:, None], axis=-1)[:, 0]


def _reference(x, w, t, chunk=1024):
    """float64 per-token losses (jax with x64, chunks of tokens)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    out = []
    with jax.enable_x64(True):
        w64 = jnp.asarray(w, jnp.float64)
        rows = jax.jit(_ref_rows)
        for i in range(0, x.shape[0], chunk):
            out.append(np.asarray(rows(x[i:i + chunk], w64, t[i:i + chunk])))
        del w64
    return np.concatenate(out)


def _shapes(cpu, names, quick):
    from .shapes import CPU_JAX_SHAPES as CPU_SHAPES
    from .shapes import JAX_SHAPES as SHAPES

    pool = CPU_SHAPES if cpu else tuple(sorted(SHAPES, key=lambda s: s.tokens * s.hidden * s.vocab))
    if names:
        pool = SHAPES + CPU_SHAPES
        chosen = [s for s in pool if any(fnmatch.fnmatch(s.name, n) for n in names)]
        if not chosen:
            raise SystemExit(f"unknown shape(s) {names}; known: {', '.join(s.name for s in pool)}")
        pool = tuple(chosen)
    return pool[:1] if quick else pool


def environment(argv):
    import jax

    dev = jax.devices()[0]
    peers = {}
    for mod in ("tokamax", "optax", "triton", "jax_triton"):
        try:
            peers[mod] = __import__(mod).__version__
        except Exception:
            pass
    from .jax_timing import baseline_source

    return {**jax_environment(argv), "compute_capability": str(getattr(dev, "compute_capability", "")),
            "peers": peers, "baseline_code": baseline_source()}


COLUMNS = ("shape", "method", "fwd ms", "fwd+bwd ms", "fwd/1 GEMM", "f+b/3 GEMMs", "fwd temp MiB", "temp MiB",
           "|loss-ref|", "max tok err", "bitwise", "compile s", "note")


def _fmt(v, nd=3):
    if v is None:
        return "-"
    if isinstance(v, float):
        if v != v:
            return "nan"
        return f"{v:.2e}" if (abs(v) < 1e-2 and v != 0) else f"{v:.{nd}g}" if abs(v) < 1e4 else f"{v:.0f}"
    return str(v)


def markdown(data) -> str:
    lines = [f"# JAX linear cross-entropy: {data['meta']['device']}, {data['meta']['date']}", "",
             f"jax {data['meta']['jax']}, python {data['meta']['python']}, peers {data['meta']['peers']}; "
             f"`{data['meta']['command']}`; warmup {data['settings']['warmup']}, reps {data['settings']['reps']}"
             + (f", medians of {r} interleaved rounds (`--rounds`)" if (r := data['settings'].get('rounds', 1)) > 1
                else "")
             + f"{'' if data.get('complete') else ' — **partial**'}", "",
             "Ratios are against `jnp.dot(x, w.T)` of the same shape, measured in the same run "
             "(fwd/1 GEMM; fwd+bwd over 3 GEMMs); rows that take an (H, V) kernel (-hv, tokamax) against "
             "`jnp.dot(x, kernel)` (gemm-hv) where that row was run. temp MiB: XLA's compiled temporary "
             "bytes of the jitted fwd+bwd (`memory_analysis().temp_size_in_bytes`; fwd temp MiB: of the fwd). "
             "Methods ending in -hv take the weight as a flax (H, V) kernel (`weight_layout=\"hv\"`). "
             "|loss-ref|: mean loss vs float64; max tok err: largest per-token loss error vs float64.", ""]
    if data["settings"].get("memory_budget"):
        lines += [f"logitless rows: memory_budget={data['settings']['memory_budget']} bytes (not the device's "
                  "default).", ""]
    if data["meta"].get("baseline_code"):
        lines += ["xla-logits-bf16 (-hv), under `jax.jit(jax.value_and_grad(...))`:", "", "```python",
                  data["meta"]["baseline_code"].rstrip(), "```", ""]
    report = table_report(lines, COLUMNS, data["rows"], _fmt, data.get("notes", []))
    profiled = [r for r in data["rows"] if r.get("kernels")]
    if profiled:
        report += "\n## Kernels per fwd+bwd (device profile, GPU ms per step)\n"
        for r in profiled:
            top = "; ".join(f"{k['name'][:60]} {k['ms']:.3g} ({k['calls']:g}x)" for k in r["kernels"][:8])
            tl = r.get("timeline") or {}
            span = f" (one call: span {tl['span ms']:.4g} ms, kernels {tl['busy ms']:.4g} ms)" if tl else ""
            report += f"\n- {r['shape']} {r['method']}: {r.get('kernel ms', 0):.4g} ms in all{span}: {top}"
        report += "\n"
    return report


def _plot(data, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:
        return None
    rows = [r for r in data["rows"] if r.get("f+b/3 GEMMs") and not r["method"].startswith("gemm")]
    if not rows:
        return None
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(shapes)), 4))
    width = 0.8 / len(methods)
    for k, m in enumerate(methods):
        vals = [next((r["f+b/3 GEMMs"] for r in rows if r["shape"] == s and r["method"] == m), 0) for s in shapes]
        ax.bar([i + k * width for i in range(len(shapes))], vals, width, label=m)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(shapes))], shapes, rotation=20, fontsize=8)
    ax.set_ylabel("fwd+bwd / 3 GEMMs (lower is better)")
    ax.set_title(f"JAX linear cross-entropy, {data['meta']['device']}")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def save(data, out_dir, plot=True):
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tag = data["meta"].get("tag") or ("cpu" if data["meta"]["platform"] == "cpu" else
                                       (data["meta"]["device"].replace("NVIDIA ", "").split() or ["gpu"])[0])
    day = data["meta"]["date"][:10]
    stems = (f"jax-{tag}-{day}", f"latest-jax-{tag}")
    written = write_results(out, stems, data, markdown(data))
    for stem in stems:
        png = _plot(data, out / f"{stem}.png") if plot else None
        if png:
            written.append(png)
    return written


def _device_tag(cpu: bool, meta) -> str:
    """Name of the result files: "cpu" for a --cpu run (small shapes, whatever the
    device) or a CPU machine, else the GPU's short name ("H100")."""
    if cpu or meta["platform"] == "cpu":
        return "cpu"
    return (meta["device"].replace("NVIDIA ", "").split() or ["gpu"])[0]


def _run_method(m, s, x, w, t, wt, ref, units, warmup, reps, row, profile=False, budget=None, timers=None):
    """Measures one method on one shape into ``row``; returns wt (the (H, V) kernel, made
    once per shape). ``units``: layout -> the GEMM's ms, filled by the gemm rows; a row's
    ratios are against its layout's GEMM (the "vh" one where that was not run). ``timers``
    (a list): gets ``row``'s entry (row, fwd, fwd+bwd or None, args) for ``interleaved_rounds``,
    once the method has passed its checks (a row that fails after its timings is not timed again)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    hv = layout(m) == "hv"
    gemm = m.startswith("gemm")
    fns = None if gemm else _loss_fns(m, budget)  # Skip (before the (H, V) copy is made)
    if hv and wt is None:
        wt = jnp.asarray(w.T)  # (H, V), as a flax kernel / tokamax's weights: made once per shape
    if gemm:
        t0 = time.perf_counter()
        gargs = (x, wt) if hv else (x, w)
        f = jax.jit(lambda x, k: jnp.dot(x, k) if hv else jnp.dot(x, k.T)).lower(*gargs).compile()
        row["compile s"] = time.perf_counter() - t0
        row["fwd ms"] = units[layout(m)] = _median_ms(f, gargs, warmup, reps)
        if timers is not None:
            timers.append((row, f, None, gargs))
        row["fwd/1 GEMM"] = 1.0
        row["note"] = f"{2 * s.tokens * s.hidden * s.vocab / row['fwd ms'] / 1e9:.3g} TFLOP/s"
        return wt
    mean_fn, tok_fn = fns
    args_ = (x, w, wt, t)
    grad_of = (0, 2) if hv else (0, 1)
    # Compiled once each; the memory analysis comes from the same executable.
    t0 = time.perf_counter()
    fwd = jax.jit(mean_fn).lower(*args_).compile()
    fb = jax.jit(jax.value_and_grad(mean_fn, argnums=grad_of)).lower(*args_).compile()
    row["compile s"] = time.perf_counter() - t0
    fmem = fwd.memory_analysis()
    if fmem is not None:
        row["fwd temp MiB"] = fmem.temp_size_in_bytes / 2**20
    loss = float(fwd(*args_))
    row["fwd ms"] = _median_ms(fwd, args_, warmup, reps)
    row["fwd+bwd ms"] = _median_ms(fb, args_, warmup, reps)
    # Bitwise repeatable: two calls give the same loss and gradients, bit for bit.
    a, b = fb(*args_), fb(*args_)
    row["bitwise"] = all(bool(jnp.array_equal(p, q)) for p, q in zip(jax.tree.leaves(a), jax.tree.leaves(b)))
    del a, b
    if profile:
        from .jax_timing import device_profile

        prof = device_profile(fb, args_)
        kernels = prof.get("stream", [])
        row["kernel ms"] = sum(k["ms"] for k in kernels)
        row["kernels"] = kernels[:24]
        row["xla ops"] = prof.get("ops", [])[:24]
        row["timeline"] = tl = prof.get("timeline", {})
        if tl:
            print(f"      one call: span {tl['span ms']:.3f} ms, kernels {tl['busy ms']:.3f} ms; gaps: "
                  + "; ".join(f"{g['ms']:.3f} ms after {g['after'][:40]}" for g in tl["gaps"][:4]))
        for k in kernels[:10]:
            print(f"      {k['ms']:8.3f} ms {k['calls']:6.1f}x  {k['name'][:110]}")
        for k in row["xla ops"][:10]:
            print(f"      op {k['ms']:8.3f} ms {k['calls']:6.1f}x  {k['name'][:110]}")
    mem = fb.memory_analysis()
    if mem is not None:
        row["temp MiB"] = mem.temp_size_in_bytes / 2**20
    gemm_ms = _unit(units, m)
    if gemm_ms:
        row["fwd/1 GEMM"] = row["fwd ms"] / gemm_ms
        row["f+b/3 GEMMs"] = row["fwd+bwd ms"] / (3 * gemm_ms)
    row["loss"] = loss
    if ref is not None:
        row["|loss-ref|"] = abs(loss - float(ref.mean()))
        per_tok = np.asarray(jax.jit(tok_fn)(x, w, wt, t), np.float64)
        row["max tok err"] = float(np.abs(per_tok - ref).max())
    if timers is not None:  # only a method that passed every step above is timed again
        timers.append((row, fwd, fb, args_))
    return wt


def interleaved_rounds(entries: list, rounds: int, reps: int) -> None:
    """``--rounds``: ``rounds - 1`` more rounds over the measured rows of one shape, each
    timing every row's fwd and fwd+bwd in turn (``reps`` calls each, one warm-up); each
    row's "fwd ms" / "fwd+bwd ms" become the medians over all rounds (the first one's
    included; the rounds' values in "fwd ms rounds" / "fwd+bwd ms rounds") and its ratios
    are taken again against the median of its layout's GEMM row (``layout``)."""
    import statistics

    for row, _, fb, _ in entries:
        row["fwd ms rounds"] = [row["fwd ms"]]
        if fb is not None:
            row["fwd+bwd ms rounds"] = [row["fwd+bwd ms"]]
    for _ in range(rounds - 1):
        for row, fwd, fb, args_ in entries:
            row["fwd ms rounds"].append(_median_ms(fwd, args_, 1, reps))
            if fb is not None:
                row["fwd+bwd ms rounds"].append(_median_ms(fb, args_, 1, reps))
    units = {}
    for row, _, fb, _ in entries:
        row["fwd ms"] = statistics.median(row["fwd ms rounds"])
        if fb is None:
            units[layout(row["method"])] = row["fwd ms"]
        else:
            row["fwd+bwd ms"] = statistics.median(row["fwd+bwd ms rounds"])
    for row, _, fb, _ in entries:
        gemm_ms = _unit(units, row["method"])
        if gemm_ms and fb is not None:
            row["fwd/1 GEMM"] = row["fwd ms"] / gemm_ms
            row["f+b/3 GEMMs"] = row["fwd+bwd ms"] / (3 * gemm_ms)


def run(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:
        argv = argv[1:]
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds must be >= 1 (1: each method timed once), got {args.rounds}")
    line_buffered_stdout()
    t_start = time.monotonic()
    import jax
    import jax.numpy as jnp
    import numpy as np

    cpu = args.cpu or jax.devices()[0].platform == "cpu"
    names = [s.strip() for s in (args.shapes or "").split(",") if s.strip()]
    shapes = _shapes(cpu, names, args.quick)
    methods = [m.strip() for m in (args.methods or ",".join(DEFAULT_METHODS)).split(",") if m.strip()]
    if methods == ["all"]:
        methods = list(METHODS)
    bad = [m for m in methods if m not in METHODS]
    if bad:
        raise SystemExit(f"unknown method(s) {bad}; known: {', '.join(METHODS)} (or 'all')")
    if "gemm-hv" not in methods and any(layout(m) == "hv" for m in methods):
        methods = ["gemm-hv"] + methods
    if "gemm" not in methods:
        methods = ["gemm"] + methods
    if args.list:
        for s in _shapes(cpu, names, False):
            print(f"{s.name:<14} {s.tokens:>6} {s.hidden:>6} {s.vocab:>7} {s.dtype}")
        print("methods: " + ", ".join(METHODS))
        return 0
    warmup = args.warmup if args.warmup is not None else (1 if args.quick else 2)
    reps = args.reps if args.reps is not None else (3 if args.quick else 8)
    # Soft deadline: no new shape/method after it (files still to write); hard: a timer.
    hard = t_start + 60 * args.max_minutes if args.max_minutes else None
    soft = hard - min(_RESERVE_S, 0.1 * 60 * args.max_minutes) if hard else None
    import signal

    def _interrupt(signum, frame):  # a time limit: unwind so partial results are saved
        raise KeyboardInterrupt(f"signal {signum}")

    use_timer = bool(hard) and hasattr(signal, "setitimer")
    previous = {signal.SIGTERM: signal.signal(signal.SIGTERM, _interrupt)}
    if use_timer:
        previous[signal.SIGALRM] = signal.signal(signal.SIGALRM, _interrupt)
        signal.setitimer(signal.ITIMER_REAL, max(1.0, hard - time.monotonic()))
    meta = environment(argv)
    meta["tag"] = _device_tag(cpu, meta)
    data = {"suite": "jax", "meta": meta,
            "settings": {"warmup": warmup, "reps": reps, "rounds": args.rounds, "seed": args.seed,
                         "memory_budget": args.memory_budget,
                         "max_minutes": args.max_minutes, "method_seconds": args.method_seconds},
            "rows": [], "notes": [], "complete": False}
    if cpu:
        data["notes"].append("CPU run: small fp32 shapes, a harness check, not the benchmark.")
    print(f"device: {meta['device']} | jax {meta['jax']} | python {meta['python']} | peers {meta['peers']}")
    print(f"shapes: {', '.join(s.name for s in shapes)} | methods: {', '.join(methods)}")
    last_s = {}  # method -> seconds it took on the previous shape
    too_slow = {}  # method -> why it is skipped on the remaining shapes
    try:
        for s in shapes:
            def left():
                return soft - time.monotonic() if soft else float("inf")

            if left() <= 0:
                data["rows"].append({"shape": s.label, "method": "*", "note": "skipped: --max-minutes reached"})
                continue
            dtype = jnp.dtype(s.dtype)
            key = jax.random.PRNGKey(args.seed)
            kx, kw, kt = jax.random.split(key, 3)
            x = jax.random.normal(kx, (s.tokens, s.hidden), jnp.float32).astype(dtype)
            w = (jax.random.normal(kw, (s.vocab, s.hidden), jnp.float32) / np.sqrt(s.hidden)).astype(dtype)
            t = jax.random.randint(kt, (s.tokens,), 0, s.vocab, jnp.int32)
            wt = None
            ref = None
            if not args.no_errors:
                t0 = time.perf_counter()
                ref = _reference(x, w, t)
                print(f"  shape={s.label} | float64 reference {time.perf_counter() - t0:.1f} s")
            units = {}
            timers = [] if args.rounds > 1 else None
            for m in methods:
                row = {"shape": s.label, "method": m}
                if left() <= 0:
                    row["note"] = "skipped: --max-minutes reached"
                elif m in too_slow:
                    row["note"] = f"skipped: {too_slow[m]}"
                elif m in last_s and last_s[m] > left():
                    row["note"] = f"skipped: took {last_s[m]:.0f} s on the previous shape, {left():.0f} s left"
                if "note" in row:
                    data["rows"].append(row)
                    print("  " + " | ".join(f"{c}={_fmt(row.get(c))}" for c in COLUMNS if row.get(c) is not None))
                    continue
                t0 = time.monotonic()
                try:
                    wt = _run_method(m, s, x, w, t, wt, ref, units, warmup, reps, row, args.profile,
                                              args.memory_budget, timers)
                except Skip as exc:
                    row["note"] = f"skipped: {exc}"
                except Exception as exc:  # one failing method must not kill the rest
                    row["note"] = f"error: {type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
                took = time.monotonic() - t0
                last_s[m] = took
                if took > args.method_seconds and not m.startswith("gemm"):
                    too_slow[m] = f"took {took:.0f} s on {s.name} (> --method-seconds {args.method_seconds:g})"
                data["rows"].append(row)
                print("  " + " | ".join(f"{c}={_fmt(row.get(c))}" for c in COLUMNS if row.get(c) is not None)
                      + f" | {took:.1f} s")
                save(data, args.out, plot=False)  # a hang or a kill later still leaves this row
            if timers:
                interleaved_rounds(timers, args.rounds, reps)
                print(f"  {s.label}: medians of {args.rounds} interleaved rounds: " + " | ".join(
                    f"{r['method']} {_fmt(r.get('f+b/3 GEMMs') or r.get('fwd/1 GEMM'))}" for r, *_ in timers))
            del x, w, wt, t, timers
            save(data, args.out)
        data["complete"] = not any(str(r.get("note", "")).startswith(("skipped: --max-minutes", "skipped: took"))
                                   for r in data["rows"])
        if not data["complete"]:
            data["notes"].append("time limits reached (--max-minutes / --method-seconds): partial results")
    except KeyboardInterrupt as exc:
        data["notes"].append(f"interrupted ({exc}): partial results")
    finally:
        if use_timer:
            signal.setitimer(signal.ITIMER_REAL, 0)
        for sig, handler in previous.items():  # leave the caller's handlers as they were
            signal.signal(sig, handler)
    written = save(data, args.out)
    print("\n" + markdown(data))
    print("files: " + " ".join(str(p) for p in written))
    return 0 if data["complete"] else 130


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if _suite(argv) == "jax-sharded":
        from .jax_sharded import main as sharded_main

        return sharded_main(argv)
    if _suite(argv) == "jax-distill":
        from .jax_distill import main as distill_main

        return distill_main(argv)
    return run(argv)
