"""The JAX formulas (``logitless.jax.formulas``) against the one float64 numpy statement of
the math (tests/formula_cases.py, imported by path: tests/ needs torch), on the cases
that tests/test_formulas_agree.py gives the torch formulas. JAX computes in fp32."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from logitless.jax.formulas import cross_entropy as jf
from logitless.options import CrossEntropyOptions


def _load_cases():
    path = Path(__file__).resolve().parents[1] / "tests" / "formula_cases.py"
    spec = importlib.util.spec_from_file_location("formula_cases", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


fc = _load_cases()
TOL = dict(rtol=2e-5, atol=2e-5)


def jax_formulas(c) -> dict:
    opts = CrossEntropyOptions(**c.options)
    f32 = {k: jnp.asarray(getattr(c, k), jnp.float32) for k in ("lse", "target_logit", "smooth_sum", "z")}
    target = jnp.asarray(c.target, jnp.int32)
    loss = jf.token_loss(f32["lse"], f32["target_logit"], f32["smooth_sum"], target, fc.V, opts)
    g = jf.upstream_per_token(jnp.asarray(c.grad_out, jnp.float32), target, opts)
    coef = jf.grad_coefficients(f32["lse"], target, g, fc.V, opts)
    out = dict(token_loss=loss, reduced=jf.reduce_loss(loss, target, opts), upstream=g,
               grad_coefficients=coef, dlogits=jf.dlogits(f32["z"], f32["lse"], coef, target, c.col0, c.softcap),
               capped=jf.softcap_logits(f32["z"], c.softcap))
    return {k: np.asarray(v, np.float64) for k, v in out.items()}


@pytest.mark.parametrize("case", fc.cases(), ids=lambda c: c.name)
def test_jax_formulas_match_numpy(case):
    ours = jax_formulas(case)
    ref = dict(token_loss=fc.token_loss(case), reduced=fc.reduced_loss(case), upstream=fc.upstream(case),
               grad_coefficients=fc.grad_coefficients(case), dlogits=fc.dlogits(case),
               capped=case.z if case.softcap is None else case.softcap * np.tanh(case.z / case.softcap))
    for key in ref:
        np.testing.assert_allclose(ours[key], ref[key], err_msg=key, **TOL)


def test_merge_lse_splits_matches_numpy():
    _, part_lse, _, _, lse = fc.split_lse_case()
    got = jf.merge_lse_splits(jnp.asarray(part_lse, jnp.float32))
    np.testing.assert_allclose(np.asarray(got, np.float64), lse, rtol=1e-5, atol=1e-5)
