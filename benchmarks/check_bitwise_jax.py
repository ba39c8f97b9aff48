"""Bitwise-neutrality check of a refactor of the JAX ops (``check_bitwise.py``'s twin, no torch).

    python benchmarks/check_bitwise_jax.py digest FILE   # run every case, save a SHA-256 per array (JSON)
    python benchmarks/check_bitwise_jax.py compare A B   # every digest of A equal to B's

Cases: logitless.jax.linear_cross_entropy (every option) and linear_log_probs (entropy,
temperature, soft-cap; top-k/top-p/min-p; batch-invariant) on each implementation the
machine runs ("xla" everywhere; "triton" and "mosaic_gpu" on an NVIDIA GPU, Hopper for the
latter), at budgets that chunk and that do not, bf16 and fp32: the value and the gradients
of x, weight and bias. Only the public API is used, so the same script runs against the
code before and after a change.
"""

from __future__ import annotations

import hashlib
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

from logitless import jax as ljax


def _inputs(n, h, v, dtype, seed):
    k = jax.random.split(jax.random.PRNGKey(seed), 4)
    x = jax.random.normal(k[0], (n, h), jnp.float32).astype(dtype)
    w = (jax.random.normal(k[1], (v, h), jnp.float32) * h ** -0.5 * 2).astype(dtype)
    b = (jax.random.normal(k[2], (v,), jnp.float32) * 0.5).astype(dtype)
    t = jax.random.randint(k[3], (n,), 0, v)
    t = jnp.where(jnp.arange(n) % 5 == 0, -100, t)
    return x, w, b, t


def _implementations():
    dev = jax.devices()[0]
    out = ["xla"]
    if dev.platform == "gpu":
        out.append("triton")
        if str(getattr(dev, "compute_capability", "")).startswith("9"):
            out.append("mosaic_gpu")
    return out


def _run(fn, x, w, b):
    val, grads = jax.value_and_grad(lambda x, w, b: jnp.sum(fn(x, w, b) * 1.0), argnums=(0, 1, 2))(x, w, b)
    return [val, *grads]


def all_results():
    gpu = jax.devices()[0].platform == "gpu"
    n, h, v = (300, 136, 1500) if gpu else (29, 40, 257)
    out = {}
    for dtype in (jnp.bfloat16, jnp.float32):
        for impl in _implementations():
            for budget_name, budget in (("small", 20000), ("default", None)):
                x, w, b, t = _inputs(n, h, v, dtype, 1)
                for name, kw in (("plain", {}), ("all", dict(label_smoothing=0.1, softcap=6.0, z_loss=1e-3))):
                    def lce(x, w, b, kw=kw):
                        return ljax.linear_cross_entropy(x, w, t, b, memory_budget=budget, implementation=impl,
                                                         reduction="sum", **kw)
                    key = f"lce/{impl}/{jnp.dtype(dtype).name}/{budget_name}/{name}"
                    try:
                        out[key] = _run(lce, x, w, b)
                    except (ValueError, NotImplementedError) as e:  # (a case this implementation refuses)
                        out[key] = f"refused: {type(e).__name__}"
                for name, kw in (("plain", {}), ("ent", dict(entropy=True, temperature=0.7, softcap=6.0)),
                                 ("top_p", dict(top_p=0.8, temperature=0.9)), ("top_k", dict(top_k=17)),
                                 ("min_p", dict(min_p=0.05)), ("invariant", dict(batch_invariant=True))):
                    def llp(x, w, b, kw=kw):
                        r = ljax.linear_log_probs(x, w, t, b, memory_budget=budget, implementation=impl, **kw)
                        return sum(jnp.sum(a * (i + 1.5)) for i, a in enumerate(r)) if isinstance(r, tuple) else r
                    key = f"llp/{impl}/{jnp.dtype(dtype).name}/{budget_name}/{name}"
                    try:
                        out[key] = _run(llp, x, w, b)
                    except (ValueError, NotImplementedError) as e:
                        out[key] = f"refused: {type(e).__name__}"
    return out


def _digest(arrays) -> list[str]:
    if isinstance(arrays, str):
        return [arrays]
    res = []
    for a in arrays:
        a = np.asarray(a)
        h = hashlib.sha256(f"{a.dtype}{a.shape}".encode())
        h.update(a.tobytes())
        res.append(h.hexdigest())
    return res


def main(argv) -> int:
    if argv[0] == "digest":
        res = {k: _digest(v) for k, v in all_results().items()}
        json.dump(res, open(argv[1], "w"), indent=0)
        print(f"digested {len(res)} cases on {jax.devices()[0].platform} to {argv[1]}")
        return 0
    a, b = (json.load(open(p)) for p in argv[1:3])
    diff = [k for k in a if a[k] != b.get(k)]
    for k in diff:
        print("DIFFERENT", k)
    print(f"{len(a) - len(diff)}/{len(a)} cases bitwise equal")
    return 1 if diff else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
