"""``python -m logitless_bench --suite jax-distill``: the JAX distillation ops against the
logits a JAX user would write, in one process and one run. Needs only jax (no torch).

JSD (``linear_jsd``, beta 0.5, T 1, mean; the student/teacher shapes of the torch suite
``distill``, ``shapes.DISTILL_SHAPES``): f+b over the four-GEMM floor (x_s W_s^T, x_t W_t^T,
dz W_s, dz^T x_s: jnp.dot in bf16, each timed here), against ``xla-bf16-logits``: both
heads' bf16 logits cast to fp32, the JSD formula, under jax.jit.

Top-k KL (``linear_topk_kl``, forward, tail "bucket", mean; llama3.1-8b 8192 x 4096 x 128256,
K = 20, 100 and 128 (MaxText's example saves 128); also with hard labels, weight 0.5, at T = 2
and 1.5: ``-hard-T2``, ``-hard-T1.5``;
a flax (H, V) kernel: ``-hv``): f+b over three GEMMs and over ``linear_cross_entropy``
(default call, same shape and layout, same run),
against ``xla-bf16-logits``: bf16 logits cast to fp32, log_softmax, the gather at the
ids and the bucket, under jax.jit (``-hard-T2``: at T = 2 plus 0.5 x the cross-entropy).

Every logitless row is the default call (``implementation=None``, ``memory_budget=None``)
unless ``--memory-budget`` says otherwise. Per row: fwd and f+b medians, f+b / floor,
XLA's compiled temporary bytes of the jitted f+b, |loss - xla-bf16-logits|. The
baselines' code is written into the results file. Files: benchmarks/results/
jax-distill-<tag>-<date>.json/.md (+ latest-), <tag> the GPU's short name or "cpu".
"""

from __future__ import annotations

import argparse
import inspect
import math
import os
import sys

from .common import line_buffered_stdout, table_report, write_results
from .jax_timing import environment
from .jax_timing import median_ms as _median_ms

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

#: (name, tokens, hidden, vocab, K) of the top-k cases.
TOPK_SHAPES = (("llama3.1-8b-k20", 8192, 4096, 128256, 20), ("llama3.1-8b-k100", 8192, 4096, 128256, 100),
               ("llama3.1-8b-k128", 8192, 4096, 128256, 128))  # K = 128: MaxText's saved top-k
CPU_TOPK_SHAPES = (("cpu-tiny-k20", 256, 64, 4000, 20),)


def xla_jsd(xs, ws, xt, wt, beta=0.5):
    """The JSD as a JAX user writes it: bf16 logits of both heads, fp32 loss (mean)."""
    import jax
    import jax.numpy as jnp

    lp = jax.nn.log_softmax((xs @ ws.T).astype(jnp.float32), axis=-1)
    lq = jax.nn.log_softmax((xt @ wt.T).astype(jnp.float32), axis=-1)
    lm = jnp.logaddexp(lp + math.log1p(-beta), lq + math.log(beta))
    p, q = jnp.exp(lp), jnp.exp(lq)
    return jnp.mean(beta * jnp.sum(q * (lq - lm), -1) + (1 - beta) * jnp.sum(p * (lp - lm), -1))


def xla_topk_kl(x, w, ids, lp, t=None, temperature=1.0, hard_label_weight=0.0):
    """Top-k forward KL with the tail bucket as a JAX user writes it: bf16 logits, fp32
    log_softmax at the temperature, the gather at the ids, 1 - Q from the gathered mass;
    with a hard-label weight, plus that times the cross-entropy at T = 1 on t (mean)."""
    import jax
    import jax.numpy as jnp

    z = (x @ w.T).astype(jnp.float32)
    logq = jax.nn.log_softmax(z / temperature, axis=-1)
    lq = jnp.take_along_axis(logq, ids, axis=-1)
    p = jnp.exp(lp)
    tail_p = jnp.clip(1.0 - p.sum(-1), 0.0)
    tail_q = jnp.clip(1.0 - jnp.exp(lq).sum(-1), 1e-30)
    kl = jnp.sum(p * (lp - lq), -1) + jnp.where(tail_p > 0, tail_p * (jnp.log(tail_p) - jnp.log(tail_q)), 0.0)
    if hard_label_weight:
        ce = jax.nn.logsumexp(z, axis=-1) - jnp.take_along_axis(z, t[:, None], axis=-1)[:, 0]
        kl = kl + hard_label_weight * ce
    return jnp.mean(kl)


def build_parser():
    p = argparse.ArgumentParser(prog="python -m logitless_bench --suite jax-distill")
    p.add_argument("--suite", default="jax-distill")
    p.add_argument("--ops", default="jsd,topk", help="jsd, topk or both")
    p.add_argument("--shapes", default=None, help="comma-separated shape names (default: all of the op)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--memory-budget", type=int, default=None, help="bytes (default: the device's default)")
    p.add_argument("--no-baseline", action="store_true", help="skip the xla-bf16-logits rows")
    p.add_argument("--cpu", action="store_true", help="run the tiny CPU case (also without a GPU)")
    p.add_argument("--out", default="benchmarks/results")
    return p


def _temp_mib(fn, args):
    try:
        return fn.lower(*args).compile().memory_analysis().temp_size_in_bytes / 2**20
    except Exception:  # memory analysis unavailable on this backend
        return None


def _timed(fn, args, warmup, reps):
    import jax

    jitted = jax.jit(fn)
    return jitted, _median_ms(jitted, args, warmup, reps)


def _fb(loss_fn):
    """value_and_grad over the first two arguments (the student's x and W); the others
    (the teacher's arrays, the targets) are arguments too, never constants of the program."""
    import jax

    return jax.value_and_grad(loss_fn, argnums=(0, 1))


def _gemm_ms(a, b_t, warmup, reps):
    """Median ms of a @ b_t.T in a's dtype."""
    return _timed(lambda a, b: a @ b.T, (a, b_t), warmup, reps)[1]


def run_jsd(shape, args, rows):
    import jax
    import jax.numpy as jnp

    from logitless.jax import linear_jsd

    key = jax.random.split(jax.random.key(0), 5)
    n, hs, ht, v = shape.tokens, shape.hidden_s, shape.hidden_t, shape.vocab
    bf = jnp.bfloat16
    xs = jax.random.normal(key[0], (n, hs), bf)
    ws = (jax.random.normal(key[1], (v, hs), jnp.float32) * hs**-0.5).astype(bf)
    xt = jax.random.normal(key[2], (n, ht), bf)
    wt = (jax.random.normal(key[3], (v, ht), jnp.float32) * ht**-0.5).astype(bf)
    t = jax.random.randint(key[4], (n,), 0, v)
    dz = jax.random.normal(key[4], (n, v), bf)
    floor = {"student_logits": _gemm_ms(xs, ws, args.warmup, args.reps),
             "teacher_logits": _gemm_ms(xt, wt, args.warmup, args.reps),
             "dx": _timed(lambda d, w: d @ w, (dz, ws), args.warmup, args.reps)[1],
             "dW": _timed(lambda d, x: d.T @ x, (dz, xs), args.warmup, args.reps)[1]}
    del dz
    total = sum(floor.values())
    label = shape.label
    print(f"{label}: floor {total:.2f} ms {floor}")
    methods = {"logitless": lambda a, b, c, d, tt: linear_jsd(a, b, c, d, tt, memory_budget=args.memory_budget)}
    if not args.no_baseline:
        methods["xla-bf16-logits"] = lambda a, b, c, d, tt: xla_jsd(a, b, c, d)
    operands = (xs, ws, xt, wt, t)
    losses = {}
    for name, fn in methods.items():
        row = {"shape": label, "op": "jsd", "method": name, "floor ms": round(total, 3)}
        try:
            fwd, row["fwd ms"] = _timed(fn, operands, args.warmup, args.reps)
            fb, row["f+b ms"] = _timed(_fb(fn), operands, args.warmup, args.reps)
            row["f+b/floor"] = row["f+b ms"] / total
            row["temp MiB"] = _temp_mib(fb, operands)
            losses[name] = float(fwd(*operands))
        except Exception as exc:  # out of memory, say: keep the other rows
            row["note"] = f"{type(exc).__name__}: {str(exc)[:120]}"
        rows.append(row)
        print(row)
    if len(losses) == 2:
        rows[-2]["|loss-baseline|"] = abs(losses["logitless"] - losses["xla-bf16-logits"])
    if "logitless" in losses:
        from logitless.jax.budget import resolve_memory_budget
        from logitless.jax.ops.linear_jsd.backends import BACKENDS, choose_backend

        name = choose_backend(None, (n, hs), (v, hs), xs.dtype, None, False)
        budget = resolve_memory_budget(args.memory_budget)
        cfg = BACKENDS[name].plan_call((n, hs), (v, hs), jnp.dtype(bf), budget=budget)
        rows[-len(methods)]["note"] = f"{name}: rows {cfg.grad.rows}, kept {cfg.grad.keep}/{v} columns"


def run_topk(spec, args, rows):
    import jax
    import jax.numpy as jnp

    from logitless.jax import linear_cross_entropy, linear_topk_kl

    name, n, h, v, k = spec
    key = jax.random.split(jax.random.key(1), 5)
    bf = jnp.bfloat16
    x = jax.random.normal(key[0], (n, h), bf)
    w = (jax.random.normal(key[1], (v, h), jnp.float32) * h**-0.5).astype(bf)
    t = jax.random.randint(key[2], (n,), 0, v)
    # a teacher's top-k: its own logits' top-k and their log-probs under its full distribution
    tz = jax.random.normal(key[3], (n, v), jnp.float32) * 3.0
    top, ids = jax.lax.top_k(tz, k)
    lp = top - jax.nn.logsumexp(tz, axis=-1, keepdims=True)
    ids = ids.astype(jnp.int32)
    del tz, top
    gemm = _gemm_ms(x, w, args.warmup, args.reps)
    label = f"{name} ({n}, {h}, {v}, K={k})"
    print(f"{label}: 1 GEMM {gemm:.2f} ms")
    budget = args.memory_budget
    methods = {"logitless-topk": lambda a, b, i, p, tt: linear_topk_kl(a, b, i, p, tt, memory_budget=budget),
               # the distillation loss with the labels' cross-entropy at T = 1 beside the KL at T = 2, 1.5
               "logitless-topk-hard-T2": lambda a, b, i, p, tt: linear_topk_kl(
                   a, b, i, p, tt, hard_label_weight=0.5, temperature=2.0, memory_budget=budget),
               "logitless-topk-hard-T1.5": lambda a, b, i, p, tt: linear_topk_kl(
                   a, b, i, p, tt, hard_label_weight=0.5, temperature=1.5, memory_budget=budget),
               "logitless-lce": lambda a, b, i, p, tt: linear_cross_entropy(a, b, tt, memory_budget=budget),
               # a flax (H, V) kernel (its own array, transposed once here)
               "logitless-topk-hv": lambda a, b, i, p, tt: linear_topk_kl(a, b, i, p, tt, weight_layout="hv",
                                                                           memory_budget=budget),
               "logitless-lce-hv": lambda a, b, i, p, tt: linear_cross_entropy(a, b, tt, weight_layout="hv",
                                                                               memory_budget=budget)}
    if not args.no_baseline:
        methods["xla-bf16-logits-topk"] = lambda a, b, i, p, tt: xla_topk_kl(a, b, i, p)
        methods["xla-bf16-logits-topk-hard-T2"] = lambda a, b, i, p, tt: xla_topk_kl(
            a, b, i, p, tt, temperature=2.0, hard_label_weight=0.5)
    operands = (x, w, ids, lp, t)
    operands_hv = (x, jax.block_until_ready(jnp.asarray(w.T)), ids, lp, t)
    losses, fbs = {}, {}
    for mname, fn in methods.items():
        row = {"shape": label, "op": "topk", "method": mname, "gemm ms": round(gemm, 3)}
        ops = operands_hv if mname.endswith("-hv") else operands
        try:
            fwd, row["fwd ms"] = _timed(fn, ops, args.warmup, args.reps)
            fb, row["f+b ms"] = _timed(_fb(fn), ops, args.warmup, args.reps)
            row["fwd/1 GEMM"] = row["fwd ms"] / gemm
            row["f+b/3 GEMMs"] = row["f+b ms"] / (3 * gemm)
            row["temp MiB"] = _temp_mib(fb, ops)
            losses[mname] = float(fwd(*ops))
            fbs[mname] = row["f+b ms"]
        except Exception as exc:
            row["note"] = f"{type(exc).__name__}: {str(exc)[:120]}"
        rows.append(row)
        print(row)
    if "logitless-topk" in losses:
        from logitless.jax.budget import resolve_memory_budget
        from logitless.jax.ops.linear_topk_kl.backends import BACKENDS, choose_backend

        bname = choose_backend(None, (n, h), (v, h), x.dtype, None, False)
        cfg = BACKENDS[bname].plan_call((n, h), (v, h), jnp.dtype(bf), budget=resolve_memory_budget(args.memory_budget))
        rows[-len(methods)]["note"] = f"{bname}: rows {cfg.grad.rows}, kept {cfg.grad.keep}/{v} columns"
    if "logitless-topk" in fbs and "logitless-lce" in fbs:
        for r in rows[-len(methods):]:
            lce = "logitless-lce-hv" if r["method"].endswith("-hv") else "logitless-lce"
            if r["method"] in fbs and r["method"].startswith("logitless-topk") and lce in fbs:
                r["f+b/lce"] = fbs[r["method"]] / fbs[lce]
            base = {"logitless-topk": "xla-bf16-logits-topk",
                    "logitless-topk-hard-T2": "xla-bf16-logits-topk-hard-T2"}.get(r["method"])
            if base in losses and r["method"] in losses:
                r["|loss-baseline|"] = abs(losses[r["method"]] - losses[base])


def markdown(data) -> str:
    meta = data["meta"]
    head = [f"# JAX distillation: {meta['device']}, {meta['date']}", "",
            f"jax {meta['jax']}, python {meta['python']}; `{meta['command']}`; warmup {data['settings']['warmup']}, "
            f"reps {data['settings']['reps']}", ""]
    cols = ["shape", "op", "method", "fwd ms", "f+b ms", "f+b/floor", "fwd/1 GEMM", "f+b/3 GEMMs", "f+b/lce",
            "temp MiB", "|loss-baseline|", "note"]

    def fmt(v):
        if v is None:
            return "-"
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 1e4 else f"{v:.0f}"
        return str(v)

    notes = ["floor: four bf16 GEMMs timed here (student and teacher logits, dx, dW); 1 GEMM: x @ W.T",
             "xla-bf16-logits: the baselines below, jitted, value_and_grad over (x_s, W_s) / (x, W)",
             "```python\n" + inspect.getsource(xla_jsd) + "\n" + inspect.getsource(xla_topk_kl) + "```"]
    return table_report(head, cols, data["rows"], fmt, notes)


def main(argv=None) -> int:
    import jax

    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    line_buffered_stdout()
    cpu = args.cpu or jax.default_backend() != "gpu"
    from .shapes import CPU_DISTILL_SHAPES, DISTILL_SHAPES

    jsd_shapes = CPU_DISTILL_SHAPES if cpu else DISTILL_SHAPES
    topk_shapes = CPU_TOPK_SHAPES if cpu else TOPK_SHAPES
    wanted = set(s.strip() for s in args.shapes.split(",")) if args.shapes else None
    ops = set(s.strip() for s in args.ops.split(","))
    rows = []
    meta = environment(argv)
    tag = "cpu" if cpu else str(meta["device"]).replace("NVIDIA ", "").split()[0]
    stem = f"jax-distill-{tag}-{meta['date'][:10]}"

    def save():  # after every shape: a run cut short keeps what it measured
        data = {"meta": meta, "settings": {"warmup": args.warmup, "reps": args.reps,
                                           "memory_budget": args.memory_budget},
                "rows": rows, "baselines": inspect.getsource(xla_jsd) + "\n" + inspect.getsource(xla_topk_kl)}
        md = markdown(data)
        write_results(args.out, [stem, f"latest-jax-distill-{tag}"], data, md)
        return md

    md = save()
    if "topk" in ops:
        for spec in topk_shapes:
            if wanted is None or spec[0] in wanted:
                run_topk(spec, args, rows)
                md = save()
    if "jsd" in ops:
        for shape in jsd_shapes:
            if wanted is None or shape.name in wanted:
                run_jsd(shape, args, rows)
                md = save()
    print(md)
    return 0
