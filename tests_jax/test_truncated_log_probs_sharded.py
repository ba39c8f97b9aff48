"""logitless.jax.linear_log_probs with top_k / top_p / min_p and batch_invariant=True
under sharded jit (8 host devices on the CPU, a 4 x 2 (data, model) mesh): tokens split,
weight split over the vocabulary ((V, H) and (H, V)), both; values and gradients against
the unsharded call and float64, -inf outside the kept set; compiled HLO: no gather of
x, of the tokens or of the weight and no tokens x vocab array (only the (N_l, C)
candidates and O(N) statistics move); bitwise batch invariance per mesh."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from logitless.jax import linear_log_probs
from logitless.jax.ops.linear_log_probs import truncation as trunc_op
from logitless.jax.ops.linear_log_probs.reference import truncated_keep_reference, truncated_log_probs_reference

from .helpers import DATA, MODEL, hlo_array_shapes, hlo_collectives, make_mesh, needs_devices, put

#: Forces several column and row chunks per device.
SMALL_BUDGET = 40_000

#: (x spec, weight spec, weight layout): tokens split, vocabulary split, both.
LAYOUTS = {
    "data": ((DATA,), (), "vh"),
    "tensor": ((), (MODEL,), "vh"),
    "2d": ((DATA,), (MODEL,), "vh"),
    "tensor-hv": ((), (None, MODEL), "hv"),
    "2d-hv": ((DATA,), (None, MODEL), "hv"),
}
#: ... and tokens and weight over the same axis (FSDP-like), tested once.
PLACES = {**LAYOUTS, "fsdp": ((DATA,), (DATA,), "vh")}

CASES = {
    "top_k": dict(top_k=7),
    "top_p": dict(top_p=0.8),
    "min_p": dict(min_p=0.05),
    "all": dict(top_k=20, top_p=0.9, min_p=0.02),
    "arrays": "per-token",
}
OPTS = dict(temperature=0.7, softcap=4.0)


def _per_token(n, seed=3):
    rng = np.random.default_rng(seed)
    return dict(top_k=rng.integers(0, 12, n).astype(np.int32),
                top_p=np.where(rng.random(n) < 0.3, 1.0, rng.random(n) * 0.5 + 0.45).astype(np.float32),
                min_p=np.where(rng.random(n) < 0.5, 0.0, rng.random(n) * 0.1).astype(np.float32))


def _inputs(n, h, v, seed, tr, scale=3.0, opts=OPTS, share=0.6):
    """float32 x, w (V, H), bias, tokens: most tokens inside the kept set, two ignored."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, h)).astype(np.float32)
    w = (rng.standard_normal((v, h)) * h ** -0.5 * scale).astype(np.float32)
    b = (rng.standard_normal(v) * 0.5).astype(np.float32)
    t = rng.integers(0, v, n).astype(np.int32)
    z = x.astype(np.float64) @ w.T.astype(np.float64) + b
    if opts.get("softcap"):
        z = opts["softcap"] * np.tanh(z / opts["softcap"])
    keep = truncated_keep_reference(z / opts.get("temperature", 1.0), **tr)
    for i in range(n):
        if rng.random() < share:
            t[i] = rng.choice(np.flatnonzero(keep[i]))
    t[[1, 6]] = -100
    return x, w, b, t


def _place(mesh, layout, x, w, b, t, tr):
    xs, ws, wl = PLACES[layout]
    tok = xs[0] if xs else None
    voc = MODEL if MODEL in ws else None
    wa = w.T if wl == "hv" else w
    trs = {k: put(mesh, jnp.asarray(v), tok) for k, v in tr.items() if isinstance(v, np.ndarray)}
    return put(mesh, jnp.asarray(x), tok, None), put(mesh, jnp.asarray(wa), *ws), put(mesh, jnp.asarray(b), voc), \
        put(mesh, jnp.asarray(t), tok), trs


def _numbers(tr):
    """The truncation parameters given as Python numbers (static; arrays are operands)."""
    return {k: v for k, v in tr.items() if not isinstance(v, np.ndarray)}


def _arrays(tr):
    return {k: jnp.asarray(v) for k, v in tr.items() if isinstance(v, np.ndarray)}


def _loss_fn(tr, wl, g1, g2, **kw):
    """jit(value_and_grad) of sum(g1 logp [finite]) + sum(g2 H) over (x, w, b); outputs as
    aux; per-token parameters are operands (the last), numbers static."""

    def f(x, w, b, t, arrs):
        lp, h = linear_log_probs(x, w, t, b, entropy=True, weight_layout=wl, memory_budget=SMALL_BUDGET, **OPTS,
                                 **_numbers(tr), **arrs, **kw)
        return jnp.sum(jnp.where(jnp.isinf(lp), 0.0, lp) * g1) + jnp.sum(h * g2), (lp, h)

    return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True))


def _reference64(x, w, b, t, tr, g1, g2):
    with jax.enable_x64(True):
        f64 = lambda a: jnp.asarray(np.asarray(a, np.float64))  # noqa: E731

        def f(x, w, b):
            lp, h = truncated_log_probs_reference(x, w, jnp.asarray(t), b, **OPTS, **tr)
            return jnp.sum(jnp.where(jnp.isinf(lp), 0.0, lp) * g1) + jnp.sum(h * g2), (lp, h)

        (_, outs), grads = jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True)(f64(x), f64(w), f64(b))
        return [np.asarray(o) for o in outs], [np.asarray(g) for g in grads]


def _check_logp(lp, ref, tol):
    lp, ref = np.asarray(lp, np.float64), np.asarray(ref, np.float64)
    fin = np.isfinite(ref)
    assert (np.isfinite(lp) == fin).all() and (lp[~fin] == -np.inf).all(), (lp, ref)
    assert np.abs(lp[fin] - ref[fin]).max() <= tol


def _check_sharded(mesh, layout, tr, n=32, h=24, v=268, seed=5, **kw):
    """Sharded == unsharded (tight) and both within 1e-4 of float64, values and gradients."""
    wl = PLACES[layout][2]
    x, w, b, t = _inputs(n, h, v, seed, tr)
    rng = np.random.default_rng(seed + 1)
    g1, g2 = (rng.standard_normal(n).astype(np.float32) for _ in range(2))
    fn = _loss_fn(tr, wl, jnp.asarray(g1), jnp.asarray(g2), **kw)
    xs, ws, bs, ts, trs = _place(mesh, layout, x, w, b, t, tr)
    (_, (lp, ent)), grads = fn(xs, ws, bs, ts, trs)
    wa = w.T if wl == "hv" else w
    (_, (ulp, uent)), ugrads = fn(jnp.asarray(x), jnp.asarray(wa), jnp.asarray(b), jnp.asarray(t), _arrays(tr))
    (rlp, rent), rgrads = _reference64(x, w, b, t, tr, g1, g2)
    _check_logp(lp, ulp, 1e-5)
    _check_logp(lp, rlp, 1e-4)
    np.testing.assert_allclose(np.asarray(ent), np.asarray(uent), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(ent), rent, rtol=1e-4, atol=1e-4)
    if wl == "hv":
        rgrads[1] = rgrads[1].T
    for name, g, u, r, p in zip(("dx", "dw", "db"), grads, ugrads, rgrads, (xs, ws, bs)):
        assert g.shape == p.shape and g.dtype == p.dtype, name
        scale = max(1.0, float(np.abs(r).max()))
        np.testing.assert_allclose(np.asarray(g), np.asarray(u), rtol=1e-5, atol=1e-5 * scale, err_msg=name)
        np.testing.assert_allclose(np.asarray(g), r, rtol=1e-4, atol=1e-4 * scale, err_msg=name)
    return lp, ent


def _tr(case, n=32):
    return _per_token(n) if CASES[case] == "per-token" else dict(CASES[case])


@needs_devices
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("case", list(CASES))
def test_truncated_sharded_against_unsharded_and_float64(layout, case):
    _check_sharded(make_mesh("auto", layout), layout, _tr(case))


@needs_devices
def test_truncated_fsdp_reduce_scatters_dw():
    """Tokens and weight split over the same axis (FSDP): W gathered along it for the
    computation, as FSDP does anyway, dW reduce-scattered back to the weight's split."""
    mesh = make_mesh("auto", "fsdp")
    _check_sharded(mesh, "fsdp", _tr("all"))
    # 3 N >= 2 V: W gathered (a smaller x splits the vocabulary: ``sharding.split_shared``).
    x, w, b, t = _inputs(32, 24, 44, 5, _tr("all"))
    xs, ws, bs, ts, _ = _place(mesh, "fsdp", x, w, b, t, {})
    fn = _loss_fn(_tr("all"), "vh", jnp.ones(32), jnp.ones(32))
    (_, _), grads = fn(xs, ws, bs, ts, {})
    assert grads[1].sharding.spec[0] == DATA
    colls = hlo_collectives(fn.lower(xs, ws, bs, ts, {}).compile().as_text())
    assert any(kind == "reduce-scatter" for kind, _ in colls), colls


@needs_devices
@pytest.mark.parametrize("layout", ["2d", "tensor-hv"])
def test_truncated_explicit_mesh(layout):
    _check_sharded(make_mesh("explicit", layout), layout, _tr("arrays"))


@needs_devices
@pytest.mark.parametrize("layout", ["tensor", "2d"])
@pytest.mark.parametrize("tr", [dict(top_p=0.97), dict(min_p=0.1, top_p=0.99), dict(top_k=300, top_p=0.995)])
def test_bisection_fallback_sharded(layout, tr, monkeypatch):
    """Kept sets past the candidates (flat rows; a per-token top_k above the array
    candidates, made 65 here): the fallback's passes with counts and masses summed over
    the vocabulary devices."""
    from logitless.jax.formulas import truncation as tf

    monkeypatch.setattr(tf, "ARRAY_TOP_K_CANDIDATES", 65)
    mesh = make_mesh("auto", layout)
    n, v = 8, 1010
    x, w, b, t = _inputs(n, 17, v, 11, tr, scale=0.3)
    assert truncated_keep_reference((x @ w.T + b) / 0.7, **tr).sum(1).min() > 65
    kw = dict(tr, top_k=np.full((n,), tr["top_k"], np.int32)) if "top_k" in tr else tr
    xs, ws, bs, ts, trs = _place(mesh, layout, x, w, b, t, kw)
    lp, ent = jax.jit(lambda x, w, b, t, arrs: linear_log_probs(x, w, t, b, entropy=True, temperature=0.7,
                                                                **_numbers(kw), **arrs))(xs, ws, bs, ts, trs)
    with jax.enable_x64(True):
        rlp, rent = truncated_log_probs_reference(*(jnp.asarray(np.asarray(a, np.float64)) for a in (x, w)),
                                                  jnp.asarray(t), jnp.asarray(np.asarray(b, np.float64)),
                                                  temperature=0.7, **tr)
    _check_logp(lp, np.asarray(rlp), 1e-4)
    np.testing.assert_allclose(np.asarray(ent), np.asarray(rent), rtol=1e-4, atol=1e-4)


# ------------------------------------------------------------------------------------
# batch_invariant under a mesh
# ------------------------------------------------------------------------------------

def _invariant_call(mesh, layout, x, w, b, t, tr, g):
    """(logp, H, dx) of the rows of x under ``mesh`` (None: unsharded) with batch_invariant."""
    wl = LAYOUTS[layout][2]

    def f(x, w, b, t, arrs):
        lp, h = linear_log_probs(x, w, t, b, entropy=True, weight_layout=wl, batch_invariant=True, **OPTS,
                                 **_numbers(tr), **arrs)
        return jnp.sum(jnp.where(jnp.isinf(lp), 0.0, lp) * g) + jnp.sum(h * g), (lp, h)

    fn = jax.jit(jax.value_and_grad(f, has_aux=True))
    args = _place(mesh, layout, x, w, b, t, tr) if mesh is not None else (
        jnp.asarray(x), jnp.asarray(w.T if wl == "hv" else w), jnp.asarray(b), jnp.asarray(t), _arrays(tr))
    (_, (lp, h)), dx = fn(*args)
    return np.asarray(lp), np.asarray(h), np.asarray(dx)


@needs_devices
@pytest.mark.parametrize("tr", [{}, dict(top_k=5, top_p=0.9), dict(min_p=0.1, top_p=0.97)])
def test_batch_invariant_data_parallel_is_the_unsharded_call_bitwise(tr):
    """Tokens split: each device runs the unsharded invariant computation on its rows, so
    log p and H are bitwise the unsharded call's (dx: equal within an ulp, not bitwise:
    the two compiled programs may differ in how they emit the gradient GEMM)."""
    mesh = make_mesh("auto", "data")
    x, w, b, t = _inputs(40, 19, 134, 7, tr)
    g = np.random.default_rng(0).standard_normal(40).astype(np.float32)
    got = _invariant_call(mesh, "data", x, w, b, t, tr, g)
    want = _invariant_call(None, "data", x, w, b, t, tr, g)
    assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])
    np.testing.assert_allclose(got[2], want[2], rtol=1e-6, atol=1e-6)


@needs_devices
@pytest.mark.parametrize("layout", ["tensor", "2d", "2d-hv"])
@pytest.mark.parametrize("tr", [{}, dict(top_k=5, top_p=0.9), dict(min_p=0.1, top_p=0.97)])
def test_batch_invariant_vocab_parallel_rows_bitwise(layout, tr):
    """Vocabulary split: a row's log p and H are bitwise the same whatever the batch (its
    size, the row's position, its neighbours) on a given mesh: the merges' sums run in
    device order. Against the unsharded call: equal within 1e-5 (another summation
    order, not bitwise), and so is dx."""
    mesh = make_mesh("auto", layout)
    n = trunc_op.INVARIANT_ROWS.get(jax.default_backend(), 1024) + 8
    x, w, b, t = _inputs(n, 19, 134, 9, tr)
    g = np.ones(n, np.float32)
    base = _invariant_call(mesh, layout, x[:8], w, b, t[:8], tr, g[:8])
    unsharded = _invariant_call(None, layout, x[:8], w, b, t[:8], tr, g[:8])
    _check_logp(base[0], unsharded[0], 1e-5)
    np.testing.assert_allclose(base[1], unsharded[1], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(base[2], unsharded[2], rtol=1e-5, atol=1e-5)  # dx
    rng = np.random.default_rng(1)
    for order in (rng.permutation(16), np.r_[np.arange(8, n), np.arange(8)]):
        lp, h, _ = _invariant_call(mesh, layout, x[order], w, b, t[order], tr, g[order])
        for pos, row in enumerate(order):
            if row < 8:
                assert np.array_equal(lp[pos], base[0][row]) and np.array_equal(h[pos], base[1][row]), (pos, row)


# ------------------------------------------------------------------------------------
# Compiled HLO
# ------------------------------------------------------------------------------------

@needs_devices
@pytest.mark.parametrize("layout", ["data", "tensor", "2d", "tensor-hv"])
@pytest.mark.parametrize("kw", [dict(top_k=20, top_p=0.9, min_p=0.02), dict(top_p=0.9, batch_invariant=True)],
                         ids=["truncated", "invariant"])
def test_hlo_no_gather_of_weight_x_or_logits(layout, kw):
    """Forward + backward at a budget that forces chunking: the only all-gathers are the
    (N_l, C) candidates over the vocabulary devices and, with batch_invariant, the
    merges' (P, k, rows) statistics; all-reduces are per-token (N_l x H at most) or dW
    over the token axis; no tokens x vocab array."""
    mesh = make_mesh("auto", layout)
    # n_local != h: a flat buffer of XLA's GPU all-reduce combiner holding dW (V_l * H,
    # + db and scalars) must not look like a tokens x vocab array (N_l * V_l).
    n, h, v = 96, 32, 1024
    tr = {k: kw[k] for k in ("top_k", "top_p", "min_p") if k in kw}
    x, w, b, t = _inputs(n, h, v, 2, tr)
    xs, ws, bs, ts, trs = _place(mesh, layout, x, w, b, t, tr)
    fn = _loss_fn(tr, LAYOUTS[layout][2], jnp.ones(n), jnp.ones(n),
                  **{k: val for k, val in kw.items() if k == "batch_invariant"})
    text = fn.lower(xs, ws, bs, ts, trs).compile().as_text()
    nvoc = mesh.shape[MODEL] if MODEL in LAYOUTS[layout][1] else 1
    ntok = mesh.shape[DATA] if LAYOUTS[layout][0] else 1
    n_l, v_l = n // ntok, v // nvoc
    rows = max(n_l, trunc_op.INVARIANT_ROWS.get(jax.default_backend(), 1024)) if "batch_invariant" in kw else n_l
    colls = hlo_collectives(text)
    for kind, shapes in colls:
        for s in shapes:
            size = int(np.prod(s))
            if kind == "all-gather":
                assert nvoc > 1, (kind, s)  # nothing gathered with the tokens split only
                assert size <= nvoc * rows * 64, (kind, s)  # (rows, C) candidates or (P, 3, rows) statistics
                assert h not in s, (kind, s)
            elif kind == "all-reduce" and s in ((v_l, h), (h, v_l), (v_l,)):
                assert ntok > 1, (kind, s)  # dW and db over the token axis
            elif kind == "all-reduce" and ntok > 1 and len(s) == 1 and size > max(n_l, rows) * (h + 4) + 8:
                # XLA's GPU all-reduce combiner: dW, db and scalars packed in one flat array
                assert size <= v_l * (h + 1) + 8, (kind, s)
            else:
                assert kind in ("all-reduce",) and size <= max(n_l, rows) * (h + 4) + 8, (kind, s)
    big = [s for s in hlo_array_shapes(text) if np.prod(s) >= rows * v_l and h not in s]  # (rows: padded block)
    assert not big, f"a tokens x vocab array was materialised: {big}"
