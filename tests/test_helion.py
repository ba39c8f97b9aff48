"""The Helion kernels (logitless.helion_lib) against the float64 references, on the CPU
under HELION_INTERPRET=1 (Helion's eager ref mode) or compiled on CUDA, and their lowering to
Triton source (no GPU needed). Skipped with a reason when helion >= 1.5 is not importable."""

import math
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("HELION_INTERPRET", "1")  # read when the kernels are decorated

from logitless.helion_lib import runtime  # noqa: E402

if not runtime.available():
    pytest.skip("helion >= 1.5 is not installed (pip install 'logitless[helion]')", allow_module_level=True)

from logitless.formulas import cross_entropy as ce_f  # noqa: E402
from logitless.formulas import jsd as jsd_f  # noqa: E402
from logitless.formulas import log_probs as lp_f  # noqa: E402
from logitless.helion_lib import configs  # noqa: E402
from logitless.helion_lib import linear_cross_entropy as hce  # noqa: E402
from logitless.helion_lib import linear_jsd as hjsd  # noqa: E402
from logitless.helion_lib import linear_log_probs as hlp  # noqa: E402
from logitless.ops.linear_cross_entropy.reference import linear_cross_entropy_reference  # noqa: E402
from logitless.ops.linear_jsd.reference import linear_jsd_reference  # noqa: E402
from logitless.ops.linear_log_probs.reference import linear_log_probs_reference  # noqa: E402
from logitless.options import CrossEntropyOptions, JSDOptions, LogProbOptions  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOL = dict(rtol=2e-4, atol=2e-5)
# (tokens, hidden, vocab): odd sizes, V prime, H not a multiple of 16; one token; none.
SIZES = [(13, 20, 37), (1, 7, 5), (0, 20, 37)]


@pytest.fixture(autouse=True)
def _small_tiles(monkeypatch):
    """Tiles of 8 in the ref mode, blocks of 16 on CUDA (tests/_helion_tiles.py): several
    vocabulary, row and hidden tiles, the last partial."""
    from tests._helion_tiles import small_tiles

    with small_tiles(monkeypatch, 8):
        yield


@pytest.fixture(params=[None, 16], ids=["one-split", "span16"])
def vocab_span(request, monkeypatch):
    """The forward kernels' vocabulary splits: as ``configs.forward_span`` picks (one split
    on the CPU, where it sees one SM, and at these sizes on a GPU), or 16 columns each
    (several splits, the last partial: the partials' merge)."""
    if request.param is not None:
        monkeypatch.setattr(configs, "forward_span", lambda config, sizes, device=None: request.param)
    return request.param


def _data(n, h, v, seed, ignore=True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, h, generator=g)
    w = torch.randn(v, h, generator=g) * (1.5 / math.sqrt(h))
    b = torch.randn(v, generator=g)
    t = torch.randint(0, v, (n,), generator=g)
    if ignore and n > 2:
        t[2] = -100
    return x.to(DEVICE), w.to(DEVICE), b.to(DEVICE), t.to(DEVICE)


def _leaf(*ts):
    return [None if t is None else t.double().requires_grad_() for t in ts]


# ----------------------------------------------------------------------------- cross-entropy

CE_CASES = {
    "plain": dict(),
    "bias": dict(bias=True),
    "softcap": dict(softcap=2.5),
    "smoothing": dict(label_smoothing=0.15),
    "smoothing_cw": dict(label_smoothing=0.15, class_weight=True),
    "class_weight": dict(class_weight=True),
    "z_loss": dict(z_loss=1e-2),
    "all": dict(bias=True, softcap=2.5, label_smoothing=0.1, class_weight=True, z_loss=1e-3),
}


@pytest.mark.parametrize("size", SIZES, ids=str)
@pytest.mark.parametrize("case", list(CE_CASES))
def test_linear_cross_entropy(case, size, vocab_span):
    kw = dict(CE_CASES[case])
    n, h, v = size
    x, w, b, t = _data(n, h, v, seed=1)
    bias = b if kw.pop("bias", False) else None
    cw = (torch.rand(v, generator=torch.Generator().manual_seed(2)) + 0.5).to(DEVICE) if kw.pop("class_weight",
                                                                                                False) else None
    opts = CrossEntropyOptions(**kw)
    stats = hce.lce_forward(x, w, bias, t, cw, opts, need_argmax=True)
    loss_tok, w_t = ce_f.token_loss(stats, t, v, cw, opts)
    loss = loss_tok.sum() / w_t.sum()
    xr, wr, br = _leaf(x, w, bias)
    ref, ref_lse, ref_correct = linear_cross_entropy_reference(
        xr, wr, t, br, class_weight=None if cw is None else cw.double(), **kw)
    if n == 0:
        assert stats.lse.shape == (0,)
        return
    torch.testing.assert_close(loss.double(), ref, **TOL)
    valid = t != -100
    torch.testing.assert_close(stats.lse[valid].double(), ref_lse.reshape(-1)[valid], **TOL)
    assert torch.equal(ce_f.loss_stats(stats, t, opts).correct, ref_correct.reshape(-1))
    ref.backward()
    g = ce_f.upstream_per_token(torch.ones((), device=DEVICE), w_t, "mean")
    coef = ce_f.grad_coefficients(stats.lse, t, g, v, cw, opts)
    dx, dw, db = hce.lce_backward(x, w, bias, t, hce.dz_class_weight(cw, opts), stats.lse, coef, opts.softcap)
    torch.testing.assert_close(dx.double(), xr.grad, **TOL)
    torch.testing.assert_close(dw.double(), wr.grad, **TOL)
    if bias is not None:
        torch.testing.assert_close(db.double(), br.grad, **TOL)
    else:
        assert db is None


def test_argmax_first_of_ties_across_tiles(vocab_span):
    """Equal row maxima in two vocabulary tiles (and splits, with ``vocab_span``): the first
    column wins (torch.argmax), as return_stats' ``correct`` needs. Integer-valued inputs:
    the logits are exact."""
    n, h, v = 5, 6, 37
    gen = torch.Generator().manual_seed(11)
    x = torch.randint(-2, 3, (n, h), generator=gen).float().to(DEVICE)
    w = torch.randint(-2, 3, (v, h), generator=gen).float()
    w[3] = w[29] = 3 * x.sign()[0].cpu()  # columns 3 and 29 (tiles 0 and 3) tie for row 0
    w = w.to(DEVICE)
    t = torch.tensor([3, 29, 0, 1, 2], device=DEVICE)
    stats = hce.lce_forward(x, w, None, t, None, CrossEntropyOptions(), need_argmax=True)
    assert torch.equal(stats.argmax, torch.argmax(x @ w.T, dim=1))
    assert stats.argmax[0] == 3


def test_backward_in_vocabulary_chunks():
    """The backward in chunks of 16 columns (V = 37: three chunks, the last partial; the
    dX accumulator across chunks, dW / db written per chunk) gives the one-chunk gradients,
    for the three ops with every option on; fp32 and bf16 (one cast of the fp32 accumulator:
    the bf16 chunked dx is the one-chunk dx to bf16 rounding); ``dx_acc`` returns the fp32
    accumulator; and the budget sizes the chunks."""
    from logitless.helion_lib import grad_kernels

    n, h, v = 13, 20, 37
    x, w, b, xt, wt, bt, t = _jsd_data(n, h, v, seed=21)
    cw = (torch.rand(v, generator=torch.Generator().manual_seed(22)) + 0.5).to(DEVICE)
    for dtype in (torch.float32, torch.bfloat16):
        xd, wd, xtd, wtd = (a.to(dtype) for a in (x, w, xt, wt))
        tol = TOL if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-3)
        ce = CrossEntropyOptions(label_smoothing=0.1, softcap=2.5, z_loss=1e-3)
        stats = hce.lce_forward(xd, wd, b, t, cw, ce)
        coef = ce_f.grad_coefficients(stats.lse, t, torch.full((n,), 1.0 / n, device=DEVICE), v, cw, ce)
        lp = LogProbOptions(entropy=True, temperature=1.3, softcap=3.0)
        lst = hlp.logp_forward(xd, wd, b, t, lp)
        gen = torch.Generator().manual_seed(23)
        lcoef = lp_f.grad_coefficients(lst.entropy, t, torch.randn(n, generator=gen).to(DEVICE),
                                       torch.randn(n, generator=gen).to(DEVICE), v, lp, like=lst.lse)
        jo = JSDOptions(beta=0.3, temperature=1.5, student_softcap=2.5, hard_label_weight=0.3)
        jst = hjsd.jsd_forward(xd, wd, b, xtd, wtd, bt, t, jo)
        g = jsd_f.upstream(torch.ones(n, device=DEVICE), t, jo.ignore_index)
        for run in (lambda **k: hce.lce_backward(xd, wd, b, t, hce.dz_class_weight(cw, ce), stats.lse, coef,
                                                 ce.softcap, **k),
                    lambda **k: hlp.logp_backward(xd, wd, b, t, lst.lse, lcoef, lp, **k),
                    lambda **k: hjsd.jsd_backward(xd, wd, b, xtd, wtd, bt, t, jst, g, jo, **k)):
            whole = run(chunk=v)
            parts = run(chunk=16)
            acc = run(chunk=16, dx_acc=True)[0]
            assert parts[0].dtype == dtype and acc.dtype == torch.float32
            torch.testing.assert_close(acc.to(dtype), parts[0], rtol=0, atol=0)
            for got, want in zip(parts, whole):
                torch.testing.assert_close(got.double(), want.double(), **tol)
    assert grad_kernels.vocab_chunk(8192, 4096, 128256, 2, 256 * 2**20) == 8192
    assert grad_kernels.vocab_chunk(8192, 4096, 128256, 2, 2**20) == grad_kernels.MIN_CHUNK  # raised to the floor
    assert grad_kernels.vocab_chunk(8192, 4096, 128256, 2, 2**40) == 128256  # all of dz fits: one chunk
    assert grad_kernels.vocab_chunk(8192, 4096, 128256, 2, 2**30) == grad_kernels.MAX_CHUNK
    assert grad_kernels.vocab_chunk(13, 20, 37, 4, None) == 37


def test_backward_skips_unneeded_kernels():
    x, w, b, t = _data(9, 12, 17, seed=12)
    opts = CrossEntropyOptions()
    stats = hce.lce_forward(x, w, b, t, None, opts)
    coef = torch.rand(3, 9).to(DEVICE)
    dx, dw, db = hce.lce_backward(x, w, b, t, None, stats.lse, coef, opts.softcap)
    only_dx = hce.lce_backward(x, w, b, t, None, stats.lse, coef, opts.softcap, need_dw=False)
    only_dw = hce.lce_backward(x, w, b, t, None, stats.lse, coef, opts.softcap, need_dx=False)
    assert only_dx[1] is None and only_dx[2] is None and torch.equal(only_dx[0], dx)
    assert only_dw[0] is None and torch.equal(only_dw[1], dw) and torch.equal(only_dw[2], db)


# ----------------------------------------------------------------------------- log-probs

LP_CASES = {
    "plain": dict(),
    "entropy": dict(entropy=True),
    "temperature": dict(temperature=0.7),
    "softcap": dict(softcap=2.0),
    "bias": dict(bias=True),
    "all": dict(bias=True, entropy=True, temperature=1.3, softcap=3.0),
}


@pytest.mark.parametrize("size", SIZES, ids=str)
@pytest.mark.parametrize("case", list(LP_CASES))
def test_linear_log_probs(case, size, vocab_span):
    kw = dict(LP_CASES[case])
    n, h, v = size
    x, w, b, t = _data(n, h, v, seed=3)
    bias = b if kw.pop("bias", False) else None
    opts = LogProbOptions(**kw)
    stats = hlp.logp_forward(x, w, bias, t, opts)
    logp, ent = lp_f.token_outputs(stats, t, v, opts)
    xr, wr, br = _leaf(x, w, bias)
    ref_lp, ref_ent = linear_log_probs_reference(xr, wr, t, br, temperature=opts.temperature,
                                                 softcap=opts.softcap)
    if n == 0:
        assert logp.shape == (0,)
        return
    torch.testing.assert_close(logp.double(), ref_lp, **TOL)
    if opts.entropy:
        torch.testing.assert_close(ent.double(), ref_ent, **TOL)
    gen = torch.Generator().manual_seed(4)
    g_lp = torch.randn(n, generator=gen).to(DEVICE)
    g_h = torch.randn(n, generator=gen).to(DEVICE) if opts.entropy else None
    obj = (ref_lp * g_lp.double()).sum() + ((ref_ent * g_h.double()).sum() if opts.entropy else 0.0)
    obj.backward()
    coef = lp_f.grad_coefficients(stats.entropy, t, g_lp, g_h, v, opts, like=stats.lse)
    dx, dw, db = hlp.logp_backward(x, w, bias, t, stats.lse, coef, opts)
    torch.testing.assert_close(dx.double(), xr.grad, **TOL)
    torch.testing.assert_close(dw.double(), wr.grad, **TOL)
    if bias is not None:
        torch.testing.assert_close(db.double(), br.grad, **TOL)


# ----------------------------------------------------------------------------- JSD

JSD_CASES = {
    "beta0.3": dict(beta=0.3),
    "forward_kl": dict(beta=0.0),
    "reverse_kl": dict(beta=1.0),
    "temperature": dict(beta=0.5, temperature=2.0),
    "softcaps": dict(beta=0.7, student_softcap=3.0, teacher_softcap=2.0),
    "hard_label": dict(beta=0.4, hard_label_weight=0.5),
    "bias": dict(beta=0.6, bias=True),
    "all": dict(beta=0.25, temperature=1.5, student_softcap=2.5, teacher_softcap=4.0, hard_label_weight=0.3,
                bias=True),
    "all_kl": dict(beta=0.0, temperature=0.8, student_softcap=2.5, hard_label_weight=0.3, bias=True),
}


def _jsd_data(n, h, v, seed):
    x, w, b, t = _data(n, h, v, seed)
    gen = torch.Generator().manual_seed(seed + 100)
    ht = h + 3  # teacher hidden of its own size
    xt = torch.randn(n, ht, generator=gen).to(DEVICE)
    wt = (torch.randn(v, ht, generator=gen) * (1.5 / math.sqrt(ht))).to(DEVICE)
    bt = torch.randn(v, generator=gen).to(DEVICE)
    return x, w, b, xt, wt, bt, t


def _jsd_loss(x, w, bias, xt, wt, bt, t, opts):
    """Helion forward + formulas: (sum of per-token losses, statistics)."""
    stats = hjsd.jsd_forward(x, w, bias, xt, wt, bt, t, opts)
    return jsd_f.token_loss(stats, t, w.shape[0], opts).sum(), stats


@pytest.mark.parametrize("size", SIZES, ids=str)
@pytest.mark.parametrize("case", list(JSD_CASES))
def test_linear_jsd(case, size):
    kw = dict(JSD_CASES[case])
    n, h, v = size
    x, w, b, xt, wt, bt, t = _jsd_data(n, h, v, seed=5)
    use_bias = kw.pop("bias", False)
    bias, tbias = (b, bt) if use_bias else (None, None)
    opts = JSDOptions(**kw)
    loss, stats = _jsd_loss(x, w, bias, xt, wt, bt if use_bias else None, t, opts)
    xr, wr, br = _leaf(x, w, bias)
    ref = linear_jsd_reference(xr, wr, xt, wt, t, student_bias=br, teacher_bias=tbias, reduction="sum", **kw)
    if n == 0:
        assert stats.shape == (jsd_f.NUM_STATS, 0)
        return
    torch.testing.assert_close(loss.double(), ref, **TOL)
    ref.backward()
    g = jsd_f.upstream(torch.ones(n, device=DEVICE), t, opts.ignore_index)
    dx, dw, db = hjsd.jsd_backward(x, w, bias, xt, wt, tbias, t, stats, g, opts)
    torch.testing.assert_close(dx.double(), xr.grad, **TOL)
    torch.testing.assert_close(dw.double(), wr.grad, **TOL)
    if use_bias:
        torch.testing.assert_close(db.double(), br.grad, **TOL)


@pytest.mark.parametrize("case", ["all", "all_kl", "reverse_kl"])
def test_jsd_forward_in_row_chunks(case):
    """The forward in chunks of 4 rows (13 tokens: four chunks of cuBLAS logits and
    ``jsd_row_stats``, the last of one row) gives the one-chunk statistics and the float64
    loss; the memory budget sizes the chunks (``logits.jsd_forward_rows``: 3 rows here)."""
    from logitless.planning.logits import jsd_forward_rows

    kw = dict(JSD_CASES[case])
    n, h, v = 13, 20, 37
    x, w, b, xt, wt, bt, t = _jsd_data(n, h, v, seed=31)
    bias, tbias = (b, bt) if kw.pop("bias", False) else (None, None)
    opts = JSDOptions(**kw)
    whole = hjsd.jsd_forward(x, w, bias, xt, wt, tbias, t, opts, rows=n)
    chunked = hjsd.jsd_forward(x, w, bias, xt, wt, tbias, t, opts, rows=4)
    torch.testing.assert_close(chunked, whole, rtol=1e-6, atol=1e-6)
    budget = 3 * 8 * v + 5
    assert jsd_forward_rows(n, v, budget, False) == 3
    torch.testing.assert_close(hjsd.jsd_forward(x, w, bias, xt, wt, tbias, t, opts, budget=budget), whole,
                               rtol=1e-6, atol=1e-6)
    ref = linear_jsd_reference(*_leaf(x, w), xt, wt, t, student_bias=bias, teacher_bias=tbias, reduction="sum", **kw)
    torch.testing.assert_close(jsd_f.token_loss(chunked, t, v, opts).sum().double(), ref, **TOL)


def test_jsd_gradient_finite_differences_mixture():
    """0 < beta < 1: the kernels' dx against central differences of the kernels' own loss
    (Helion's example's (1 - beta)/T (p - m) fails this by far more than the tolerance)."""
    n, h, v = 6, 9, 23
    x, w, _, xt, wt, _, t = _jsd_data(n, h, v, seed=7)
    opts = JSDOptions(beta=0.35, temperature=1.7)
    _, stats = _jsd_loss(x, w, None, xt, wt, None, t, opts)
    g = jsd_f.upstream(torch.ones(n, device=DEVICE), t, opts.ignore_index)
    dx, _, _ = hjsd.jsd_backward(x, w, None, xt, wt, None, t, stats, g, opts)
    direction = torch.randn(n, h, generator=torch.Generator().manual_seed(8)).to(DEVICE)
    eps = 1e-2
    up, _ = _jsd_loss(x + eps * direction, w, None, xt, wt, None, t, opts)
    down, _ = _jsd_loss(x - eps * direction, w, None, xt, wt, None, t, opts)
    fd = (up - down).double() / (2 * eps)
    analytic = (dx * direction).sum().double()
    assert abs(fd - analytic) <= 2e-3 * abs(analytic) + 1e-4, (fd.item(), analytic.item())
    # The seed's gradient, (1 - beta)/T (p - m) in the student logits, is rejected by the same check.
    zs, zt = (x @ w.T).double(), (xt @ wt.T).double()
    p = torch.softmax(zs / opts.temperature, 1)
    m = opts.beta * torch.softmax(zt / opts.temperature, 1) + (1 - opts.beta) * p
    seed_dx = ((1 - opts.beta) / opts.temperature * (p - m)) @ w.double()
    assert abs(fd - (seed_dx * direction.double()).sum()) > 10 * (2e-3 * abs(analytic) + 1e-4)


# ----------------------------------------------------------------------------- lowering and configs


def _compiled(kernel):
    """The same kernel with Helion's ref mode off, to generate Triton source on the CPU."""
    import helion
    from helion.runtime.settings import RefMode

    return helion.kernel(kernel.fn, **{**runtime.kernel_settings(), "ref_mode": RefMode.OFF})


def _lowering_cases():
    from logitless.helion_lib import ce_kernels, grad_kernels, jsd_kernels, log_probs_kernels

    n, h, v = 13, 20, 37
    x, w, b, xt, wt, bt, t = _jsd_data(n, h, v, seed=9)
    cw = torch.rand(v).to(DEVICE)
    lse, coef, g = (torch.zeros(shape, device=DEVICE) for shape in ((n,), (3, n), (n,)))
    stats = torch.zeros(6, n, device=DEVICE)
    ce_all = CrossEntropyOptions(label_smoothing=0.1, softcap=2.0, z_loss=1e-3)
    ce_plain = CrossEntropyOptions()
    lp_all, lp_plain = LogProbOptions(entropy=True, softcap=2.0, temperature=0.7), LogProbOptions()
    sizes = {"n": n, "v": v, "h": h}
    cases = []
    for name, kernel, args in [
        ("ce_forward", ce_kernels.ce_forward, hce.forward_args(x, w, b, t, cw, ce_all, True)),
        ("ce_forward", ce_kernels.ce_forward, hce.forward_args(x, w, None, t, None, ce_plain)),
        ("ce_dz", grad_kernels.linear_dlogits,
         hce.backward_args(x, w, b, t, hce.dz_class_weight(cw, ce_all), lse, coef, ce_all.softcap)),
        ("ce_dz", grad_kernels.linear_dlogits, hce.backward_args(x, w, None, t, None, lse, coef, ce_plain.softcap)),
        ("logp_forward", log_probs_kernels.logp_forward, hlp.forward_args(x, w, b, t, lp_all)),
        ("logp_forward", log_probs_kernels.logp_forward, hlp.forward_args(x, w, None, t, lp_plain)),
        ("logp_dz", grad_kernels.linear_dlogits, hlp.backward_args(x, w, b, t, lse, coef, lp_all)),
    ]:
        cases.append((name, kernel, args, sizes))
    for beta in (0.3, 0.0, 1.0):
        o = JSDOptions(beta=beta, temperature=1.5, student_softcap=2.0, teacher_softcap=3.0, hard_label_weight=0.2)
        cases += [
            ("jsd_stats", jsd_kernels.jsd_row_stats, hjsd.stats_args(x @ w.T, xt @ wt.T, t, o), sizes),
            ("jsd_dz", jsd_kernels.jsd_dlogits, hjsd.backward_args(x, w, b, xt, wt, bt, t, stats, g, o), sizes),
        ]
    return cases


def test_kernels_lower_to_triton():
    """Every kernel (with every option on, and plain) generates Triton source with the
    heuristic's default config and with the shipped ones: the number of block sizes matches
    configs.KERNEL_DIMS."""
    import json

    shipped = [json.loads(f.read_text()) for f in sorted(configs._DIR.glob("*.json"))]
    for name, kernel, args, sizes in _lowering_cases():
        cfg = configs.default_config(name, sizes)
        assert len(cfg["block_sizes"]) == len(configs.KERNEL_DIMS[name])
        for c in [cfg] + [e["config"] for f in shipped for e in f.get(name, ())]:
            code = runtime.triton_code(_compiled(kernel), args, c)
            assert "@triton.jit" in code, name
            if "h" in configs.KERNEL_DIMS[name]:  # the GEMM kernels; fp32 inputs: about fp32 accuracy
                assert "tl.dot" in code and "input_precision='tf32x3'" in code, name


def test_configs_pick():
    sizes = {"n": 5, "v": 1000, "h": 8}
    cfg = configs.pick("ce_forward", sizes)
    assert cfg["block_sizes"] == [16, 128, 16]
    assert configs.pick("ce_dz", {"n": 10**6, "v": 10**5, "h": 4096})["block_sizes"] == [64, 128, 64]
    assert configs.pick("jsd_dz", {"n": 10**6, "v": 10**5, "h": 4096})["block_sizes"] == [64, 128, 64, 64]
    assert configs.device_class(torch.device("cpu")) == "cpu"


# ----------------------------------------------------------------------------- bf16, no target


def test_bf16_inputs_all_options():
    """bf16 x and W (fp32 accumulation; d(logits) rounded to bf16 before the dX / dW matmuls,
    as the Triton kernels do): the three ops with every option on, against float64."""
    tol = dict(rtol=3e-2, atol=3e-3)
    n, h, v = 13, 20, 37
    x, w, b, xt, wt, bt, t = _jsd_data(n, h, v, seed=13)
    x16, w16, xt16, wt16 = (a.bfloat16() for a in (x, w, xt, wt))
    xr, wr, br = _leaf(x16, w16, b)
    # cross-entropy
    opts = CrossEntropyOptions(label_smoothing=0.1, softcap=2.5, z_loss=1e-3)
    stats = hce.lce_forward(x16, w16, b, t, None, opts)
    loss_tok, w_t = ce_f.token_loss(stats, t, v, None, opts)
    ref, _, _ = linear_cross_entropy_reference(xr, wr, t, br, label_smoothing=0.1, softcap=2.5, z_loss=1e-3)
    torch.testing.assert_close((loss_tok.sum() / w_t.sum()).double(), ref, **tol)
    ref.backward()
    g = ce_f.upstream_per_token(torch.ones((), device=DEVICE), w_t, "mean")
    coef = ce_f.grad_coefficients(stats.lse, t, g, v, None, opts)
    dx, dw, db = hce.lce_backward(x16, w16, b, t, None, stats.lse, coef, opts.softcap)
    assert dx.dtype == dw.dtype == torch.bfloat16
    for got, want in ((dx, xr.grad), (dw, wr.grad), (db, br.grad)):
        torch.testing.assert_close(got.double(), want, **tol)
    # log-probs
    lopts = LogProbOptions(entropy=True, temperature=1.3, softcap=3.0)
    st = hlp.logp_forward(x16, w16, b, t, lopts)
    logp, ent = lp_f.token_outputs(st, t, v, lopts)
    ref_lp, ref_ent = linear_log_probs_reference(x16, w16, t, b, temperature=1.3, softcap=3.0)
    torch.testing.assert_close(logp.double(), ref_lp, **tol)
    torch.testing.assert_close(ent.double(), ref_ent, **tol)
    # JSD
    jopts = JSDOptions(beta=0.3, temperature=1.5, student_softcap=2.5, hard_label_weight=0.3)
    loss, jst = _jsd_loss(x16, w16, b, xt16, wt16, bt, t, jopts)
    xr2, wr2 = _leaf(x16, w16)
    jref = linear_jsd_reference(xr2, wr2, xt16, wt16, t, student_bias=b, teacher_bias=bt, reduction="sum",
                                beta=0.3, temperature=1.5, student_softcap=2.5, hard_label_weight=0.3)
    torch.testing.assert_close(loss.double(), jref, **tol)
    jref.backward()
    g = jsd_f.upstream(torch.ones(n, device=DEVICE), t, jopts.ignore_index)
    jdx, jdw, _ = hjsd.jsd_backward(x16, w16, b, xt16, wt16, bt, t, jst, g, jopts)
    torch.testing.assert_close(jdx.double(), xr2.grad, **tol)
    torch.testing.assert_close(jdw.double(), wr2.grad, **tol)


def test_jsd_without_target():
    n, h, v = 7, 10, 19
    x, w, _, xt, wt, _, _ = _jsd_data(n, h, v, seed=14)
    opts = JSDOptions(beta=0.5)
    loss, stats = _jsd_loss(x, w, None, xt, wt, None, torch.zeros(n, dtype=torch.int64, device=DEVICE), opts)
    nt = hjsd.jsd_forward(x, w, None, xt, wt, None, None, opts)
    torch.testing.assert_close(nt, stats)
    ref = linear_jsd_reference(x, w, xt, wt, None, reduction="sum", beta=0.5)
    zeros = torch.zeros(n, dtype=torch.int64, device=DEVICE)
    torch.testing.assert_close(jsd_f.token_loss(nt, zeros, v, opts).sum().double(),
                               ref, **TOL)


def test_minus_inf_bias_masks_classes():
    """A -inf bias (padded vocabulary) masks classes, a whole first vocabulary tile included:
    the online statistics start from an all -inf tile without NaN."""
    n, h, v = 9, 12, 29
    x, w, b, t = _data(n, h, v, seed=15, ignore=False)
    b[:10] = float("-inf")
    t = t.clamp(min=10)
    opts = CrossEntropyOptions()
    stats = hce.lce_forward(x, w, b, t, None, opts, need_argmax=True)
    loss_tok, w_t = ce_f.token_loss(stats, t, v, None, opts)
    xr, wr = _leaf(x, w)
    ref, _, _ = linear_cross_entropy_reference(xr, wr, t, b.double())
    torch.testing.assert_close((loss_tok.sum() / w_t.sum()).double(), ref, **TOL)
    ref.backward()
    coef = ce_f.grad_coefficients(stats.lse, t, ce_f.upstream_per_token(torch.ones((), device=DEVICE), w_t, "mean"),
                                  v, None, opts)
    dx, dw, _ = hce.lce_backward(x, w, b, t, None, stats.lse, coef, opts.softcap)
    torch.testing.assert_close(dx.double(), xr.grad, **TOL)
    torch.testing.assert_close(dw.double(), wr.grad, **TOL)
    lopts = LogProbOptions(temperature=0.9)
    st = hlp.logp_forward(x, w, b, t, lopts)
    logp, _ = lp_f.token_outputs(st, t, v, lopts)
    ref_lp, _ = linear_log_probs_reference(x, w, t, b, temperature=0.9)
    torch.testing.assert_close(logp.double(), ref_lp, **TOL)
