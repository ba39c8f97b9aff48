"""Bench of logitless.jax.linear_log_probs backends at the RL shapes (issue 20):
``python benchmarks/gpu/jax_log_probs_bench.py --out DIR [--methods triton,xla] [--cpu]``.

Per shape (``ops/linear_log_probs/bench_shapes.py``: bf16, T = 0.7, entropy on):
x ~ N(0, 1), W ~ N(0, 1/H), tokens uniform, random upstream gradients on both outputs.
Columns: fwd ms (jit forward) and fwd+bwd ms (jit value_and_grad to x and W) as medians
after warm-up; their ratios to one jnp GEMM x @ W.T and to three (x @ W.T, dz @ W,
dz^T @ x, one jit); compile s (the first fwd+bwd call); max |logp - float64| and
|entropy - float64| over all tokens (the float64 reference computed in token chunks
under jax.enable_x64). Without a GPU (``--cpu``) one tiny fp32 case, loudly labelled.
Writes jax-log-probs-<device>.json/.md under --out; prints the table last. A method
that fails is a row with its error, never the end of the run.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import platform
import sys
import time
import traceback
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from _jax_bench_common import median_ms

ROOT = Path(__file__).resolve().parents[2]


def _shapes(cpu: bool):
    # The torch op's shape file, loaded by path (its package imports torch).
    path = ROOT / "src/logitless/ops/linear_log_probs/bench_shapes.py"
    spec = importlib.util.spec_from_file_location("_rl_bench_shapes", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod.CPU_SHAPES if cpu else mod.SHAPES


def _median_ms(fn, args):
    return median_ms(fn, *args, iters=7, warmup=2)


def _inputs(s, seed=0):
    k = jax.random.split(jax.random.PRNGKey(seed), 5)
    dt = jnp.dtype(s.dtype)
    x = jax.random.normal(k[0], (s.tokens, s.hidden), jnp.float32).astype(dt)
    w = (jax.random.normal(k[1], (s.vocab, s.hidden), jnp.float32) * s.hidden ** -0.5).astype(dt)
    t = jax.random.randint(k[2], (s.tokens,), 0, s.vocab, jnp.int32)
    g1 = jax.random.normal(k[3], (s.tokens,), jnp.float32)
    g2 = jax.random.normal(k[4], (s.tokens,), jnp.float32)
    return x, w, t, g1, g2


def _reference(x, w, t, temperature, chunk=512):
    """(logp, entropy) in float64 (numpy), token chunks on the device."""
    with jax.enable_x64(True):
        w64 = jnp.asarray(w, jnp.float64)

        @jax.jit
        def rows(xc, tc, w64):  # w64 an argument: a closure would embed it as a constant
            ls = jax.nn.log_softmax((xc.astype(jnp.float64) @ w64.T) / temperature, axis=-1)
            return jnp.take_along_axis(ls, tc[:, None], axis=-1)[:, 0], -jnp.sum(jnp.exp(ls) * ls, axis=-1)

        lp, ent = [], []
        for n0 in range(0, x.shape[0], chunk):
            a, b = rows(x[n0:n0 + chunk], t[n0:n0 + chunk], w64)
            lp.append(np.asarray(a))
            ent.append(np.asarray(b))
        del w64
    return np.concatenate(lp), np.concatenate(ent)


def _gemm_ms(x, w):
    one = jax.jit(lambda x, w: x @ w.T)
    z = one(x, w)
    three = jax.jit(lambda x, w, z: (x @ w.T, z @ w, z.T @ x))
    g1 = _median_ms(one, (x, w))
    g3 = _median_ms(three, (x, w, z))
    del z
    return g1, g3


def _run_method(impl, s, x, w, t, g1, g2, ref, gemm1, gemm3):
    from logitless.jax import linear_log_probs

    row = {"shape": s.label, "method": f"logitless-{impl}"}
    kw = dict(temperature=s.temperature, entropy=True, implementation=impl)
    fwd = jax.jit(lambda x, w: linear_log_probs(x, w, t, **kw))

    def loss(x, w):
        lp, h = linear_log_probs(x, w, t, **kw)
        return jnp.sum(lp * g1) + jnp.sum(h * g2)

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
    try:
        t0 = time.perf_counter()
        jax.block_until_ready(step(x, w))
        row["compile s"] = time.perf_counter() - t0
        lp, h = fwd(x, w)
        row["logp err"] = float(np.abs(np.asarray(lp, np.float64) - ref[0]).max())
        row["H err"] = float(np.abs(np.asarray(h, np.float64) - ref[1]).max())
        row["fwd ms"] = _median_ms(fwd, (x, w))
        row["fwd+bwd ms"] = _median_ms(step, (x, w))
        row["fwd/1 GEMM"] = row["fwd ms"] / gemm1
        row["f+b/3 GEMMs"] = row["fwd+bwd ms"] / gemm3
    except Exception as exc:  # noqa: BLE001  (a failing method is a row, not the end)
        row["note"] = f"{type(exc).__name__}: {str(exc)[:200]}"
        traceback.print_exc()
    return row


COLUMNS = ("shape", "method", "fwd ms", "fwd+bwd ms", "fwd/1 GEMM", "f+b/3 GEMMs", "logp err", "H err",
           "compile s", "note")


def _fmt(v):
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1e-2 or abs(v) >= 1e4 else f"{v:.3f}"
    return str(v)


def markdown(data) -> str:
    env = data["environment"]
    lines = [f"# JAX linear_log_probs backends ({env['device']}, {env['date']})", "",
             f"`{env['command']}`; jax {env['jax']}, jaxlib {env['jaxlib']}, triton {env.get('triton')}, "
             f"jax_triton {env.get('jax_triton')}", "", __doc__.split("\n\n")[1].replace("\n", " "), "",
             "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in data["rows"]:
        lines.append("| " + " | ".join(_fmt(r.get(c)) for c in COLUMNS) + " |")
    return "\n".join(lines) + "\n"


def environment(argv):
    import jaxlib

    dev = jax.devices()[0]
    env = {
        "device": dev.device_kind if dev.platform != "cpu" else f"cpu ({platform.machine()}) SMOKE",
        "platform": dev.platform, "compute_capability": str(getattr(dev, "compute_capability", "")),
        "jax": jax.__version__, "jaxlib": jaxlib.__version__, "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": "python benchmarks/gpu/jax_log_probs_bench.py " + " ".join(argv),
    }
    for mod in ("triton", "jax_triton"):
        try:
            env[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001
            env[mod] = None
    return env


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--methods", default="triton,xla")
    p.add_argument("--cpu", action="store_true", help="one tiny fp32 case (no GPU)")
    p.add_argument("--max-seconds", type=float, default=150.0, help="stop starting new shapes after this")
    args = p.parse_args(argv)
    cpu = args.cpu or jax.devices()[0].platform != "gpu"
    data = {"environment": environment(argv), "rows": []}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tag = "cpu" if cpu else "-".join(data["environment"]["device"].split()[:2]).replace("/", "-")
    start = time.perf_counter()

    def save():
        (out / f"jax-log-probs-{tag}.json").write_text(json.dumps(data, indent=1))
        (out / f"jax-log-probs-{tag}.md").write_text(markdown(data))

    for s in _shapes(cpu):
        if time.perf_counter() - start > args.max_seconds:
            data["rows"].append({"shape": s.label, "method": "-", "note": "skipped: time limit"})
            continue
        x, w, t, g1, g2 = _inputs(s)
        ref = _reference(x, w, t, s.temperature)
        gemm1, gemm3 = _gemm_ms(x, w)
        data["rows"].append({"shape": s.label, "method": "jnp GEMMs", "fwd ms": gemm1, "fwd+bwd ms": gemm3,
                             "note": "1 GEMM x @ W.T; 3 GEMMs (+ dz @ W, dz^T @ x)"})
        for m in args.methods.split(","):
            if m == "triton" and cpu:
                data["rows"].append({"shape": s.label, "method": "logitless-triton",
                                     "note": "skipped on CPU (the interpreter is for tests)"})
                continue
            row = _run_method(m, s, x, w, t, g1, g2, ref, gemm1, gemm3)
            data["rows"].append(row)
            print(" | ".join(f"{c}={_fmt(row.get(c))}" for c in COLUMNS if c in row), flush=True)
            save()
        del x, w, t, g1, g2, ref
        save()
    save()
    print(markdown(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
