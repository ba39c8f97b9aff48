"""One smoke call of a logitless.jax op's "triton" backend, fwd+bwd under jit, vs float64:
prints "automatic choice: <backend>", then "smoke ok in <s> s: <errors>" or the traceback
and "smoke FAILED" (exit 0 either way: the GPU scripts read the line).
   python benchmarks/gpu/jax_triton_smoke.py linear_cross_entropy|linear_log_probs
Shape (300, 128, 5003) bf16 on a GPU, (20, 16, 101) on the CPU (Triton's interpreter)."""

from __future__ import annotations

import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np


def _err(a, b) -> float:
    return float(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)).max())


def linear_cross_entropy(x, w, t) -> str:
    from logitless.jax import linear_cross_entropy
    from logitless.jax.ops.linear_cross_entropy.reference import linear_cross_entropy_ref

    f = jax.jit(jax.value_and_grad(lambda x, w: linear_cross_entropy(x, w, t, implementation="triton"),
                                   argnums=(0, 1)))
    loss, (dx, dw) = jax.block_until_ready(f(x, w))
    ref, _, (rdx, rdw, _) = linear_cross_entropy_ref(x, w, t)
    return (f"loss {float(loss):.6f} ref {ref:.6f} |err| {abs(float(loss) - ref):.2e}"
            f" dx err {_err(dx, rdx):.2e} dw err {_err(dw, rdw):.2e}")


def linear_log_probs(x, w, t) -> str:
    from logitless.jax import linear_log_probs
    from logitless.jax.ops.linear_log_probs.reference import linear_log_probs_reference as ref

    kw = dict(temperature=0.7, entropy=True, softcap=30.0)
    loss = lambda x, w: sum(jnp.sum(o) for o in linear_log_probs(x, w, t, implementation="triton", **kw))
    f = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
    _, (dx, dw) = jax.block_until_ready(f(x, w))
    lp, hh = linear_log_probs(x, w, t, implementation="triton", **kw)
    with jax.enable_x64(True):
        x64, w64 = jnp.asarray(np.asarray(x, np.float64)), jnp.asarray(np.asarray(w, np.float64))
        r = lambda x, w: ref(x, w, t, temperature=0.7, softcap=30.0)
        rlp, rh = r(x64, w64)
        rdx, rdw = jax.grad(lambda x, w: sum(jnp.sum(o) for o in r(x, w)), argnums=(0, 1))(x64, w64)
    return (f"|logp err| {_err(lp, rlp):.2e} |H err| {_err(hh, rh):.2e} dx err {_err(dx, rdx):.2e} "
            f"dw err {_err(dw, rdw):.2e} (max |dw| {float(np.abs(rdw).max()):.2e})")


def main(op: str) -> None:
    import importlib

    try:
        rng = np.random.default_rng(0)
        n, h, v = (300, 128, 5003) if jax.devices()[0].platform == "gpu" else (20, 16, 101)
        x = jnp.asarray(rng.standard_normal((n, h)), jnp.bfloat16)
        w = jnp.asarray(rng.standard_normal((v, h)) / 8, jnp.bfloat16)
        t = jnp.asarray(rng.integers(0, v, n), jnp.int32)
        api = importlib.import_module(f"logitless.jax.ops.{op}.api")
        print("automatic choice:", api.choose_backend(None, (n, h), (v, h), jnp.bfloat16, None, False))
        t0 = time.time()
        errors = {"linear_cross_entropy": linear_cross_entropy, "linear_log_probs": linear_log_probs}[op](x, w, t)
        print(f"smoke ok in {time.time() - t0:.1f} s: {errors}")
    except Exception:  # noqa: BLE001 - the traceback is the diagnosis
        traceback.print_exc()
        print("smoke FAILED")


if __name__ == "__main__":
    main(sys.argv[1])
