"""The torch formulas (``logitless.formulas``) against the one float64 numpy statement of
the math (tests/formula_cases.py), on the deterministic cases that
tests_jax/test_formulas_agree.py gives the JAX formulas; and torch against JAX directly
where both are importable in one Python.

fp64 statistics: the torch formulas compute in fp64 (to rounding); fp32 statistics: in
fp32. Class weights exist on the torch side only (cases(class_weight=True)).
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

from logitless.formulas import common
from logitless.formulas import cross_entropy as ce
from logitless.options import CrossEntropyOptions
from tests import formula_cases as fc

CASES = fc.cases() + fc.cases(class_weight=True)
TOL = {torch.float64: dict(rtol=1e-12, atol=1e-12), torch.float32: dict(rtol=2e-5, atol=2e-5)}


def torch_formulas(c: fc.FormulaCase, dtype=torch.float64) -> dict:
    """Every formula of the case through logitless.formulas, as float64 numpy."""
    def t(a):
        return torch.as_tensor(np.asarray(a), dtype=dtype)

    opts = CrossEntropyOptions(**c.options)
    target = torch.as_tensor(c.target)
    cw = t(c.class_weight) if c.class_weight is not None else None
    stats = ce.TokenStats(t(c.lse), t(c.target_logit), t(c.smooth_sum), None)
    loss, w_t = ce.token_loss(stats, target, fc.V, cw, opts)
    g = ce.upstream_per_token(t(c.grad_out), w_t, c.reduction)
    coef = ce.grad_coefficients(t(c.lse), target, g, fc.V, cw, opts)
    dz = ce.dlogits_(t(c.z).clone(), t(c.lse), coef, target, c.col0, cw, c.softcap)
    out = dict(token_loss=loss, reduced=common.reduce(loss, w_t, c.reduction), upstream=g,
               grad_coefficients=coef, dlogits=dz)
    return {k: v.double().numpy() for k, v in out.items()}


def expected(c: fc.FormulaCase) -> dict:
    return dict(token_loss=fc.token_loss(c), reduced=fc.reduced_loss(c), upstream=fc.upstream(c),
                grad_coefficients=fc.grad_coefficients(c), dlogits=fc.dlogits(c))


def test_cases_cover_every_option_combination():
    names = {c.name for c in CASES}
    assert len(names) == len(CASES)
    assert {(c.reduction, c.label_smoothing > 0, c.z_loss > 0, c.softcap is not None, c.ignore_index,
             c.class_weight is not None) for c in CASES} == {
        (r, e, z, s, i, w) for r in fc.REDUCTIONS for e in (0, 1) for z in (0, 1) for s in (0, 1)
        for i in (-100, 2) for w in (0, 1)}
    # NaN where a target is out of range, finite elsewhere: the cases can tell them apart.
    c = CASES[0]
    loss = fc.token_loss(c)
    assert np.isnan(loss[9]) and np.isnan(loss[12]) and np.isfinite(np.delete(loss, [9, 12])).all()
    assert loss[1] == 0.0 and loss[6] == 0.0  # ignored


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_torch_formulas_match_numpy(case, dtype):
    ours, ref = torch_formulas(case, dtype), expected(case)
    for key in ref:
        np.testing.assert_allclose(ours[key], ref[key], err_msg=key, **TOL[dtype])


def test_merge_splits_matches_numpy():
    _, _, part_max, part_sum, lse = fc.split_lse_case()
    got = common.merge_splits(torch.as_tensor(part_max), torch.as_tensor(part_sum))
    np.testing.assert_allclose(got.numpy(), lse, rtol=1e-12, atol=1e-12)


@pytest.mark.skipif(importlib.util.find_spec("jax") is None,
                    reason="jax is not installed in this environment (the GPU machine has both)")
def test_torch_and_jax_agree_directly():
    """Same inputs, both frameworks in fp32 (the JAX side computes in fp32), every case."""
    for case in fc.cases():
        _agree_directly(case)


def _agree_directly(case):
    import jax.numpy as jnp

    from logitless.jax.formulas import cross_entropy as jf

    opts = CrossEntropyOptions(**case.options)
    ours = torch_formulas(case, torch.float32)
    f32 = {k: jnp.asarray(getattr(case, k), jnp.float32) for k in ("lse", "target_logit", "smooth_sum", "z")}
    target = jnp.asarray(case.target, jnp.int32)
    loss = jf.token_loss(f32["lse"], f32["target_logit"], f32["smooth_sum"], target, fc.V, opts)
    g = jf.upstream_per_token(jnp.asarray(case.grad_out, jnp.float32), target, opts)
    coef = jf.grad_coefficients(f32["lse"], target, g, fc.V, opts)
    theirs = dict(token_loss=loss, reduced=jf.reduce_loss(loss, target, opts), upstream=g,
                  grad_coefficients=coef, dlogits=jf.dlogits(f32["z"], f32["lse"], coef, target, case.col0,
                                                             case.softcap))
    for key, value in theirs.items():
        np.testing.assert_allclose(np.asarray(value, np.float64), ours[key], err_msg=key, rtol=2e-5, atol=2e-5)
