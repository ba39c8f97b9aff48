"""Host work per call (issue 23 item 3): memoised planning that still follows overrides and
tuned configs, and a bound on the device ops one forward+backward issues."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch

from logitless.planning import memo as _memo
from logitless.planning import plans as _plans
from logitless.planning import tiles as _tiles
from logitless.planning import tuned as _tuned
from logitless.planning.overrides import override
from tests.conftest import DEVICE  # the GPU when there is one, else the CPU (interpreter)
from tests.helpers import eager_fast_path, load_benchmark
from tests.planning_seams import H100, described

CPU = torch.device("cpu")


def test_plans_are_memoised_and_follow_overrides():
    args = (300, 1001, 72, 2, 1 << 20, CPU)
    p1 = _plans.triton_plan(*args, keep_allowed=True)
    assert _plans.triton_plan(*args, keep_allowed=True) is p1  # served from the memo
    assert p1 == _plans.triton_plan.uncached(*args, keep_allowed=True)
    assert _plans.triton_plan(*args, keep_allowed=False) == _plans.triton_plan.uncached(*args, keep_allowed=False)
    with override(tiles=(32, 64, 16, 4, 1)):
        p2 = _plans.triton_plan(*args, keep_allowed=True)
        assert (p2.block_n, p2.block_v) == (32, 64)
    with override(strategy=("grad_in_forward", 7)):
        assert _plans.lce_strategy(*args).token_chunk == 7
    assert _plans.lce_strategy(*args).strategy != "grad_in_forward"
    assert _plans.triton_plan(*args, keep_allowed=True) is p1  # back outside: the same plan again
    # A described device is its own key: the CPU's plan stays memoised beside it.
    sms132 = described(sms=132)
    wide = _plans.triton_plan(*args[:5], sms132, keep_allowed=True)
    assert wide.vocab_splits > p1.vocab_splits and _plans.triton_plan(*args[:5], sms132, keep_allowed=True) is wide
    assert _plans.triton_plan(*args, keep_allowed=True) is p1


def test_memo_sees_a_new_tuned_config(tmp_path, monkeypatch):
    """A GPU plan reads tuned tiles; after the tuner writes new ones (``tuned.clear``), the
    next plan has them. The GPU is described (``DeviceFacts``): this runs on the CPU."""
    path = tmp_path / "cache.json"
    monkeypatch.setattr(_tuned, "cache_path", lambda device: path)
    gpu = dataclasses.replace(H100, name="cpu")
    args = (512, 32000, 1024, 2, 1 << 30, gpu)

    def write(tiles):
        path.write_text(json.dumps({"configs": {"16-bit/n1k-h2k": {"tiles": list(tiles)}}}))
        _tuned.clear()

    try:
        write((64, 128, 32, 4, 2))
        p1 = _plans.triton_plan(*args, keep_allowed=True)
        assert (p1.block_n, p1.block_v, p1.block_h) == (64, 128, 32)
        assert _plans.triton_plan(*args, keep_allowed=True) is p1
        write((128, 64, 64, 8, 3))
        p2 = _plans.triton_plan(*args, keep_allowed=True)
        assert (p2.block_n, p2.block_v, p2.block_h) == (128, 64, 64)
        monkeypatch.setenv("LOGITLESS_TUNED", "0")  # the environment is part of the key
        p3 = _plans.triton_plan(*args, keep_allowed=True)
        assert (p3.block_n, p3.block_v) == _tiles.CUDA_TILES[2][:2]
    finally:
        _tuned.clear()


def test_memo_is_bounded_and_cleared():
    _memo.clear()
    calls = []

    @_memo.memoised
    def f(a, device=None):
        calls.append(a)
        return (a,)

    assert f(1, device=CPU) is f(1, device=CPU) and calls == [1]
    assert f([1]) == ([1],) and f([1]) == ([1],) and calls == [1, [1], [1]]  # unhashable: not cached
    _memo.clear()
    f(1, device=CPU)
    assert calls == [1, [1], [1], 1]
    for i in range(_memo.MAX_ENTRIES + 5):
        f(i)
    assert all(len(m) <= _memo.MAX_ENTRIES for m in _memo._MEMOS)


# --------------------------------------------------------------------------- fused epilogues

EPILOGUE_CASES = [
    dict(),
    dict(reduction="sum"),
    dict(reduction="none"),
    dict(label_smoothing=0.1),
    dict(class_weight=True),
    dict(z_loss=1e-3),
    dict(ignore_index=3),
    dict(label_smoothing=0.2, class_weight=True, z_loss=1e-2, reduction="sum"),
    dict(label_smoothing=0.05, class_weight=True, z_loss=1e-4, reduction="none", ignore_index=0),
    dict(label_smoothing=0.3, class_weight=True, reduction="mean", z_loss=0.5),
]


def _epilogue_inputs(n, v, splits, case, g):
    part_max = torch.randn(splits, n, generator=g) * 3
    part_max[0, :1] = float("-inf")  # a split with no column for the first token
    part_sum = torch.rand(splits, n, generator=g) * 5 + 0.5
    part_sum[0, :1] = 0.0
    part_tgt = torch.randn(splits, n, generator=g)
    part_smooth = torch.randn(splits, n, generator=g) * 10
    target = torch.randint(0, v, (n,), generator=g)
    ignore = case.get("ignore_index", -100)
    target[torch.rand(n, generator=g) < 0.2] = ignore
    if n > 4:
        target[2] = v + 5  # out of range: NaN loss and coefficients
    cw = torch.rand(v, generator=g) + 0.25 if case.get("class_weight") else None
    from logitless.options import CrossEntropyOptions

    opts = CrossEntropyOptions.checked(ignore_index=ignore, reduction=case.get("reduction", "mean"),
                                       label_smoothing=case.get("label_smoothing", 0.0),
                                       z_loss=case.get("z_loss", 0.0))
    dev = [t.to(DEVICE) if t is not None else None for t in (part_max, part_sum, part_tgt, part_smooth, target, cw)]
    return (*dev, opts)


def _split_order_sum(parts):
    """The sum over splits (dim 0) in split order, as the epilogues add them."""
    out = torch.zeros_like(parts[0])
    for p in parts:
        out = out + p
    return out


@pytest.mark.parametrize("case", EPILOGUE_CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()) or "plain")
@pytest.mark.parametrize("n,splits", [(1, 1), (7, 3), (1500, 2), (300, 37)])  # (several programs and split steps)
def test_fused_epilogues_match_the_torch_formulas(case, n, splits):
    """``ce_epilogue`` (one Triton launch each) against the spec, ``formulas``: the forward's
    split merge + token_loss + reduce, and the backward's upstream_per_token +
    grad_coefficients (+ a gradient of lse). Per-token values are bitwise the formulas'
    given the same lse; the sums over tokens agree to fp32 rounding."""
    from logitless.formulas.common import merge_splits, reduce
    from logitless.formulas.cross_entropy import TokenStats, grad_coefficients, token_loss, upstream_per_token
    from logitless.triton_lib import ce_epilogue

    g = torch.Generator().manual_seed(n * 31 + splits)
    v = 101
    part_max, part_sum, part_tgt, part_smooth, target, cw, opts = _epilogue_inputs(n, v, splits, case, g)
    smooth = part_smooth if opts.needs_smooth_sum else None
    lse, loss, w_t = ce_epilogue.forward_loss(part_max, part_sum, part_tgt, smooth, target, cw, opts, v)
    ref_lse = merge_splits(part_max, part_sum)
    torch.testing.assert_close(lse, ref_lse, rtol=2e-6, atol=2e-6)
    stats = TokenStats(lse, _split_order_sum(part_tgt), _split_order_sum(smooth) if smooth is not None else None,
                       None)
    ref_tok, ref_wt = token_loss(stats, target, v, cw, opts)
    assert torch.equal(w_t, ref_wt)
    ref_loss = reduce(ref_tok, ref_wt, opts.reduction)
    if opts.reduction == "none":
        assert torch.equal(loss.isnan(), ref_loss.isnan()) and (n <= 4 or loss[2].isnan())
        ok = ~ref_loss.isnan()
        assert torch.equal(loss[ok], ref_loss[ok])  # bitwise, per token
    else:
        assert loss.shape == ()
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6, equal_nan=True)
    # backward: the gradient of the reduced loss (strided for "none") and of lse
    for with_lse in (False, True):
        if opts.reduction == "none":
            grad = torch.randn(1, generator=g).to(DEVICE).expand(n)  # e.g. loss.sum().backward(): stride 0
        else:
            grad = torch.randn((), generator=g).to(DEVICE)
        grad_lse = torch.randn(2 * n, generator=g).to(DEVICE)[::2] if with_lse else None
        coef = ce_epilogue.grad_coefficients(grad, grad_lse, lse, w_t, target, cw, opts, v)
        ref = grad_coefficients(lse, target, upstream_per_token(grad, ref_wt, opts.reduction), v, cw, opts)
        if grad_lse is not None:
            ref[0] += grad_lse
        assert torch.equal(coef.isnan(), ref.isnan())
        ok = ~ref.isnan()
        if opts.reduction == "mean":  # g = grad / sum w_t: the sum's order differs
            torch.testing.assert_close(coef[ok], ref[ok], rtol=1e-6, atol=1e-6 * ref[ok].abs().max().item())
        else:
            assert torch.equal(coef[ok], ref[ok])


@pytest.mark.parametrize("entropy", [False, True])
@pytest.mark.parametrize("n,splits", [(1, 1), (7, 3), (1500, 2), (300, 37)])
def test_fused_log_prob_epilogues_match_the_formulas(entropy, n, splits):
    """``log_probs_epilogue`` against ``formulas.log_probs``: merge_splits + token_outputs,
    and grad_coefficients for each combination of upstream gradients (strided ones too)."""
    from logitless.formulas import log_probs as F
    from logitless.options import LogProbOptions
    from logitless.triton_lib import log_probs_epilogue

    g = torch.Generator().manual_seed(7 * n + splits)
    v = 101
    part_max = torch.randn(splits, n, generator=g) * 3
    part_max[0, :1] = float("-inf")
    part_sum = torch.rand(splits, n, generator=g) * 5 + 0.5
    part_sum[0, :1] = 0.0
    part_u = -torch.rand(splits, n, generator=g) * 2
    part_tgt = torch.randn(splits, n, generator=g)
    tokens = torch.randint(0, v, (n,), generator=g)
    tokens[torch.rand(n, generator=g) < 0.2] = 4
    if n > 4:
        tokens[2] = -3  # out of range
    part_max, part_sum, part_u, part_tgt, tokens = (t.to(DEVICE) for t in (part_max, part_sum, part_u, part_tgt,
                                                                            tokens))
    opts = LogProbOptions(temperature=0.7, entropy=entropy, softcap=None, ignore_index=4)
    logp, ent, lse = log_probs_epilogue.forward_outputs(part_max, part_sum, part_u if entropy else None, part_tgt,
                                                        tokens, opts, v)
    ref_lse, ref_ent = F.merge_splits(part_max, part_sum, part_u if entropy else None)
    torch.testing.assert_close(lse, ref_lse, rtol=2e-6, atol=2e-6)
    ref_logp, ref_ent_out = F.token_outputs(F.LogProbStats(lse, _split_order_sum(part_tgt), ent if entropy else None),
                                            tokens, v, opts)
    assert torch.equal(logp.isnan(), ref_logp.isnan())
    assert torch.equal(logp.nan_to_num(), ref_logp.nan_to_num())  # bitwise given lse
    if entropy:
        ok = ~ref_ent_out.isnan()
        assert torch.equal(ent.isnan(), ref_ent_out.isnan() | ent.isnan()) and ent[ok].isfinite().all()
        clean = F.token_outputs(F.LogProbStats(ref_lse, _split_order_sum(part_tgt), ref_ent), tokens, v, opts)[1]
        torch.testing.assert_close(ent, clean, rtol=1e-5, atol=1e-5, equal_nan=True)
    else:
        assert ent is None
    g_full = torch.randn(2 * n, generator=g).to(DEVICE)[::2]
    g_h_full = torch.randn(1, generator=g).to(DEVICE).expand(n)
    for g_lp, g_h in ((g_full, None), (None, g_h_full), (g_full, g_h_full)):
        coef = log_probs_epilogue.grad_coefficients(ent, tokens, g_lp, g_h, v, opts)
        ref = F.grad_coefficients(ent, tokens, g_lp, g_h if entropy else None, v, opts, lse)
        assert torch.equal(coef.isnan(), ref.isnan())
        assert torch.equal(coef.nan_to_num(), ref.nan_to_num())  # bitwise


def test_epilogue_edge_cases():
    """Every token ignored: "mean" is 0/0 = NaN (as torch) and the coefficients are 0;
    NaN statistics propagate to lse (the max over splits propagates NaN)."""
    from logitless.options import CrossEntropyOptions
    from logitless.triton_lib import ce_epilogue

    opts = CrossEntropyOptions.checked()
    pm, ps, pt = (torch.zeros(2, 5, device=DEVICE), torch.ones(2, 5, device=DEVICE),
                  torch.zeros(2, 5, device=DEVICE))
    target = torch.full((5,), -100, device=DEVICE)
    lse, loss, w_t = ce_epilogue.forward_loss(pm, ps, pt, None, target, None, opts, 11)
    assert loss.isnan() and torch.equal(w_t, torch.zeros(5, device=DEVICE))
    torch.testing.assert_close(lse, torch.full((5,), 2.0, device=DEVICE).log())
    coef = ce_epilogue.grad_coefficients(torch.tensor(1.0, device=DEVICE), None, lse, w_t, target, None, opts, 11)
    assert torch.equal(coef, torch.zeros(3, 5, device=DEVICE))
    pm[1, 3] = float("nan")
    lse, _, _ = ce_epilogue.forward_loss(pm, ps, pt, None, torch.zeros(5, dtype=torch.long, device=DEVICE), None,
                                         opts, 11)
    assert lse[3].isnan() and not lse[:3].isnan().any()


# --------------------------------------------------------------------------- eager fast path

FAST_PATH_CASES = [
    dict(),
    dict(reduction="none", label_smoothing=0.1, z_loss=1e-3, softcap=20.0),
    dict(reduction="sum", class_weight=True, ignore_index=2, return_stats=True),
    dict(memory_budget=1 << 12, bias=True),  # recomputed chunks, not kept columns
]


def _graph_nodes(fn, depth=4):
    if fn is None or depth == 0:
        return []
    return [type(fn).__name__] + [m for nxt, _ in fn.next_functions for m in _graph_nodes(nxt, depth - 1)]


@pytest.mark.parametrize("case", FAST_PATH_CASES, ids=str)
def test_eager_fast_path_is_bitwise_the_custom_op(case):
    """The public function's eager fast path (a plain autograd.Function around the custom
    ops' implementations) against the custom ops (``helpers.eager_fast_path(False)``):
    the same loss, statistics and gradients bitwise, through a second backward
    (retain_graph) and a gradient of the returned lse."""
    import logitless

    g = torch.Generator().manual_seed(3)
    n, h, v = 37, 24, 97
    case = dict(case)
    x0 = torch.randn(n, h, generator=g).to(DEVICE, torch.bfloat16)
    w0 = (torch.randn(v, h, generator=g) * 0.3).to(DEVICE, torch.bfloat16)
    b0 = torch.randn(v, generator=g).to(DEVICE, torch.bfloat16) if case.pop("bias", False) else None
    t = torch.randint(0, v, (n,), generator=g).to(DEVICE)
    t[::5] = case.get("ignore_index", -100)
    if case.pop("class_weight", False):
        case["class_weight"] = (torch.rand(v, generator=g) + 0.5).to(DEVICE)

    def run(fast):
        x, w = x0.clone().requires_grad_(True), w0.clone().requires_grad_(True)
        b = b0.clone().requires_grad_(True) if b0 is not None else None
        with eager_fast_path(fast):
            out = logitless.linear_cross_entropy(x, w, t, b, backend="triton", **case)
            loss, stats = out if case.get("return_stats") else (out, None)
            kind = " ".join(_graph_nodes(loss.grad_fn))
            total = loss.sum() + (stats.lse.sum() * 0.25 if stats is not None else 0)
            total.backward(retain_graph=True)
            first = [p.grad.clone() for p in (x, w, b) if p is not None]
            total.backward()  # recomputes (the kept columns served the first backward)
            second = [p.grad for p in (x, w, b) if p is not None]
        res = [loss.detach(), *first, *second]
        if stats is not None:
            res += [stats.lse.detach(), stats.correct, stats.num_tokens]
        return res, kind

    fast, kind_fast = run(True)
    slow, kind_slow = run(False)
    assert "Eager" in kind_fast and "Eager" not in kind_slow, (kind_fast, kind_slow)
    for a, b in zip(fast, slow):
        assert torch.equal(a, b) or (a.isnan() == b.isnan()).all() and torch.equal(a[~a.isnan()], b[~b.isnan()])


@pytest.mark.parametrize("case", [dict(), dict(entropy=True, temperature=0.7, softcap=15.0),
                                  dict(memory_budget=1 << 12, ignore_index=5)], ids=str)
def test_eager_fast_path_log_probs_is_bitwise_the_custom_op(case):
    """linear_log_probs' eager fast path against its custom ops: bitwise, two backwards."""
    import logitless

    g = torch.Generator().manual_seed(4)
    n, h, v = 29, 24, 89
    x0 = torch.randn(n, h, generator=g).to(DEVICE, torch.bfloat16)
    w0 = (torch.randn(v, h, generator=g) * 0.3).to(DEVICE, torch.bfloat16)
    t = torch.randint(0, v, (n,), generator=g).to(DEVICE)
    t[::4] = case.get("ignore_index", -100)

    def run(fast):
        x, w = x0.clone().requires_grad_(True), w0.clone().requires_grad_(True)
        with eager_fast_path(fast):
            out = logitless.linear_log_probs(x, w, t, backend="triton", **case)
            logp, ent = out if isinstance(out, tuple) else (out, None)
            kind = " ".join(_graph_nodes(logp.grad_fn))
            total = (logp * torch.linspace(0, 1, n, device=DEVICE)).sum() + (ent.sum() * 0.5 if ent is not None else 0)
            total.backward(retain_graph=True)
            first = [x.grad.clone(), w.grad.clone()]
            total.backward()
        return [logp.detach(), *([ent.detach()] if ent is not None else []), *first, x.grad, w.grad], kind

    fast, kind_fast = run(True)
    slow, kind_slow = run(False)
    assert "Eager" in kind_fast and "Eager" not in kind_slow, (kind_fast, kind_slow)
    for a, b in zip(fast, slow):
        assert torch.equal(a, b)


@pytest.mark.parametrize("op", ["cross_entropy", "jsd"])
def test_eager_fast_path_logits_ops_is_bitwise_the_custom_op(op):
    """cross_entropy's and jsd's eager path against their custom ops: the same loss,
    statistics and gradients bitwise, through a second backward (retain_graph) and, for
    cross_entropy, a gradient of the returned lse."""
    import logitless

    g = torch.Generator().manual_seed(5)
    n, v = 23, 97
    z0 = (torch.randn(n, v, generator=g) * 3).to(DEVICE, torch.bfloat16)
    zt = (torch.randn(n, v, generator=g) * 3).to(DEVICE, torch.bfloat16)
    t = torch.randint(0, v, (n,), generator=g).to(DEVICE)
    t[::4] = -100

    def run(fast):
        z = z0.clone().requires_grad_(True)
        with eager_fast_path(fast):
            if op == "cross_entropy":
                loss, stats = logitless.cross_entropy(z, t, backend="triton", reduction="none", label_smoothing=0.1,
                                                      softcap=6.0, z_loss=1e-3, return_stats=True)
                total = (loss * torch.linspace(0, 1, n, device=DEVICE)).sum() + stats.lse.sum() * 0.25
                extra = [stats.lse.detach(), stats.correct]
            else:
                loss = logitless.jsd(z, zt, t, backend="triton", beta=0.3, temperature=1.5, hard_label_weight=0.2,
                                     student_softcap=8.0)
                total, extra = loss, []
            kind = " ".join(_graph_nodes(loss.grad_fn))
            total.backward(retain_graph=True)
            first = z.grad.clone()
            total.backward()
        return [loss.detach(), *extra, first, z.grad], kind

    fast, kind_fast = run(True)
    slow, kind_slow = run(False)
    assert "Eager" in kind_fast and "Eager" not in kind_slow, (kind_fast, kind_slow)
    for a, b in zip(fast, slow):
        assert torch.equal(a, b)


def test_eager_fast_path_is_off_where_it_must_be():
    """Dispatch modes, subclasses and torch.compile get the custom op."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from logitless.ops.common.glue import eager_fast_path_ok

    x = torch.randn(3)
    assert eager_fast_path_ok((x, torch.nn.Parameter(x), None))

    class Mode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    with Mode():
        assert not eager_fast_path_ok((x,))
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fake = mode.from_tensor(x)
        assert not eager_fast_path_ok((fake,))
    assert not eager_fast_path_ok((x.as_subclass(type("Sub", (torch.Tensor,), {})),))
    seen = []
    torch.compile(lambda: seen.append(eager_fast_path_ok((x,))), backend="eager", fullgraph=False)()
    assert seen == [False] or seen == []  # traced (False) or skipped by dynamo


# --------------------------------------------------------------------------- launch count




#: Device ops (ATen compute ops + Triton launches) per eager forward+backward of
#: linear_cross_entropy, at most. Before issue 23 item 3: 58 ATen ops + 2 launches on the
#: CPU (52 CUDA kernels on the H100). The CPU count includes 7 ops of the CPU-only
#: target range check (``validate.check_targets_in_range``), which the GPU skips.
MAX_OPS = {"plain": (16, 4), "all_options": (23, 4), "log_probs": (17, 4)}


@pytest.mark.parametrize("which", sorted(MAX_OPS))
def test_launch_count_per_forward_backward(which):
    """A regression guard on the number of device ops one f+b issues (the small-shape
    cost: each is a launch and tens of microseconds of host work)."""
    import logitless
    from tests.conftest import DEVICE

    probe = load_benchmark("probe_host")
    g = torch.Generator().manual_seed(0)
    n, h, v = 45, 24, 101
    x = torch.randn(n, h, generator=g).to(DEVICE, torch.bfloat16).requires_grad_(True)
    w = (torch.randn(v, h, generator=g) * 0.3).to(DEVICE, torch.bfloat16).requires_grad_(True)
    t = torch.randint(0, v, (n,), generator=g).to(DEVICE)
    kw = {}
    if which == "all_options":
        kw = dict(label_smoothing=0.1, z_loss=1e-3, softcap=30.0, class_weight=torch.rand(v, device=DEVICE) + 0.5,
                  ignore_index=3, return_stats=True)

    def step():
        if which == "log_probs":  # (before: 54 ATen ops on the CPU)
            logitless.linear_log_probs(x, w, t, backend="triton").sum().backward()
            return
        out = logitless.linear_cross_entropy(x, w, t, backend="triton", **kw)
        loss = out[0] if isinstance(out, tuple) else out
        loss.backward()

    ops, launches = probe.count_ops(step, run_kernels=True)
    aten, triton_launches = sum(ops.values()), sum(launches.values())
    bound_aten, bound_triton = MAX_OPS[which]
    assert x.grad is not None and torch.isfinite(x.grad.float()).all()
    assert aten <= bound_aten and triton_launches <= bound_triton, (dict(ops), dict(launches))
    prefix = "logp" if which == "log_probs" else "ce"
    assert launches[f"{prefix}_forward_epilogue_kernel"] == 1 and launches[f"{prefix}_grad_coefficients_kernel"] == 1


# --------------------------------------------------------------------------- host work per call

#: Python function calls and allocations (ATen empty*) per eager forward+backward at most,
#: kernels as no-ops (interpreter). Before this guard (d48626d): linear_cross_entropy 589
#: calls and 17 allocations, linear_log_probs 524 and 13 (``benchmarks/probe_host.py``);
#: after the fast launches (68cb997) 342 / 15, 299 / 11 and linear_jsd 391 / 10; after the
#: options, memo, load_backend and validation cuts (docs/design.md, host overhead) 200 / 15,
#: 190 / 11 and 238 / 10 on Python 3.11 (3.12 inlines comprehensions: fewer). linear_jsd's
#: forward op then took over its gradient-in-forward strategy: three more (size-0)
#: gradient outputs when the strategy is not used, as linear_cross_entropy's (13 allocations).
#: The allocations are counted under a dispatch mode, so through the custom ops, where the
#: kept columns' dz takes a buffer of its own (``glue.Owned``; the eager path writes it over
#: them): linear_log_probs 12.
MAX_HOST_WORK = {"linear_cross_entropy": (215, 15), "linear_log_probs": (205, 12), "linear_jsd": (255, 13)}
#: The ops on given logits: their counts under the positional glue (a3f0b1b: cross_entropy 134
#: calls, jsd 141; 4 allocations each), which the declared calls must not exceed (128 and 136).
MAX_HOST_WORK.update({"cross_entropy": (134, 4), "jsd": (141, 4)})


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="counts the host path with the interpreter's launches as no-ops (CPU runs)")
@pytest.mark.parametrize("op", sorted(MAX_HOST_WORK))
def test_python_calls_and_allocations_per_forward_backward(op):
    """A regression guard on the host work of one f+b (no timing): the Python function
    calls (``sys.setprofile`` events: deterministic) and the allocations it makes."""
    probe = load_benchmark("probe_host")
    step = probe.make_steps(64, 16, 128)[op]
    for _ in range(2):  # plans memoised, kernels' launch keys known
        step()
    counts = probe.count_host(step)
    bound_calls, bound_allocs = MAX_HOST_WORK[op]
    assert counts["python_calls"] <= bound_calls, counts
    assert counts["allocations"] <= bound_allocs, counts["allocs"]
    assert counts["python_calls"] == probe.python_calls(step)  # deterministic


# --------------------------------------------------------------------------- cheap host helpers

def test_options_args_round_trip_every_class():
    """``args()`` gives every field in ``dataclasses.fields`` order (the per-class getters:
    the custom ops take the fields so), for every options class and a subclass with a field
    more (its own getters, not its parent's)."""
    import dataclasses

    from logitless import options as O

    values = {
        O.CrossEntropyOptions: dict(ignore_index=3, reduction="sum", label_smoothing=0.25, softcap=30.0,
                                    z_loss=1e-4),
        O.JSDOptions: dict(beta=0.3, temperature=2.0, ignore_index=-1, student_softcap=5.0, teacher_softcap=None,
                           hard_label_weight=0.5),
        O.LogProbOptions: dict(temperature=0.7, entropy=True, softcap=20.0, ignore_index=7),
        O.VocabParallelOptions: dict(tp_group="tp0", vocab_size=1000, partial_dx=True),
    }

    @dataclasses.dataclass(frozen=True)
    class Wider(O.CrossEntropyOptions):
        extra: int = 5

    @dataclasses.dataclass(frozen=True)
    class One(O._Args):
        only: str = "a"

    values[Wider] = dict(values[O.CrossEntropyOptions], extra=9)
    values[One] = dict(only="b")
    for cls, kw in values.items():
        for opts in (cls(), cls(**kw)):
            expected = tuple(getattr(opts, f.name) for f in dataclasses.fields(cls))
            assert opts.args() == expected and type(opts.args()) is tuple
            assert type(opts)(*opts.args()) == opts
    assert O.CrossEntropyOptions(**values[O.CrossEntropyOptions]).args() == (3, "sum", 0.25, 30.0, 1e-4)


def test_memo_state_key_follows_the_environment(monkeypatch):
    """The planner's key reads the environment at every call (``os.environ.get``):
    setting, changing or deleting each variable, or the fp32 matmul precision, changes it;
    an ``os.environ`` replaced by another mapping is read too."""
    keys = set()
    for i, name in enumerate(_memo.ENV_NAMES):
        monkeypatch.setenv(name, f"/tmp/{name}-a")
        k1 = _memo._state_key()
        monkeypatch.setenv(name, f"/tmp/{name}-b")
        k2 = _memo._state_key()
        monkeypatch.delenv(name)
        k3 = _memo._state_key()
        assert len({k1, k2, k3}) == 3 and k3[i] is None and not keys & {k1, k2}, (name, k1, k2, k3)
        assert k1[:i] == k2[:i] == k3[:i] and k1[i + 1:] == k2[i + 1:] == k3[i + 1:]  # only this variable
        keys |= {k1, k2, k3}
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("high" if before != "high" else "highest")
        assert _memo._state_key()[-1] == torch.get_float32_matmul_precision()
        assert _memo._state_key() not in keys
    finally:
        torch.set_float32_matmul_precision(before)
    fake = {"LOGITLESS_TUNED": "0", "HOME": "/nowhere"}
    monkeypatch.setattr(os, "environ", fake)
    assert _memo._state_key()[:3] == ("0", None, "/nowhere")


def test_memo_plans_follow_the_environment_of_each_call(monkeypatch, tmp_path):
    """End to end: a memoised GPU plan made with LOGITLESS_TUNED unset reads the tuned cache
    of LOGITLESS_CACHE_DIR; the same call after ``setenv("LOGITLESS_TUNED", "0")`` plans
    with the shipped tile table, and after ``delenv`` the cached plan comes back."""
    monkeypatch.delenv("LOGITLESS_TUNED", raising=False)
    monkeypatch.setenv("LOGITLESS_CACHE_DIR", str(tmp_path))
    gpu = dataclasses.replace(H100, name="cpu")
    path = _tuned.cache_path(gpu)
    path.write_text(json.dumps({"configs": {"16-bit/n1k-h2k": {"tiles": [64, 128, 32, 4, 2]}}}))
    _tuned.clear()
    args = (512, 32000, 1024, 2, 1 << 30, gpu)
    try:
        p1 = _plans.triton_plan(*args, keep_allowed=True)
        assert (p1.block_n, p1.block_v, p1.block_h) == (64, 128, 32)
        monkeypatch.setenv("LOGITLESS_TUNED", "0")
        p2 = _plans.triton_plan(*args, keep_allowed=True)
        assert (p2.block_n, p2.block_v) == _tiles.CUDA_TILES[2][:2] != (64, 128)
        monkeypatch.delenv("LOGITLESS_TUNED")
        assert _plans.triton_plan(*args, keep_allowed=True) is p1
    finally:
        _tuned.clear()


def test_memo_keys_default_and_equal_overrides_alike():
    """Outside any override the memo keys the overrides by identity (``overrides.DEFAULT``);
    an equal ``override()`` with no field plans the same, a changed one plans anew."""
    from logitless.planning import overrides as _ov

    assert _ov.current() is _ov.DEFAULT
    args = (300, 1001, 72, 2, 1 << 20, CPU)
    p0 = _plans.triton_plan(*args, keep_allowed=True)
    with override() as same:
        assert same == _ov.DEFAULT and same is not _ov.DEFAULT
        assert _plans.triton_plan(*args, keep_allowed=True) == p0
    with override(tiles=(32, 64, 16, 4, 1)):
        assert _plans.triton_plan(*args, keep_allowed=True).block_v == 64
    assert _plans.triton_plan(*args, keep_allowed=True) is p0


def test_memo_device_keys():
    """Devices in the key: an index-less CUDA device is the current one (device 0 without
    CUDA), so "cuda" and "cuda:0" share a plan there; CPU and other indices do not."""
    calls = []

    @_memo.memoised
    def f(n, device, flag=False):
        calls.append((n, device, flag))
        return object()

    cuda, cuda0, cuda1 = torch.device("cuda"), torch.device("cuda", 0), torch.device("cuda", 1)
    a = f(1, cuda0)
    assert f(1, cuda0) is a and len(calls) == 1
    if not torch.cuda.is_available() or torch.cuda.current_device() == 0:
        assert f(1, cuda) is a and len(calls) == 1
    assert f(1, cuda1) is not a and f(1, CPU) is not a
    assert f(1, device=cuda0) is f(1, device=cuda0) and f(1, cuda0, flag=True) is not a
    assert f(1, flag=True, device=CPU) is f(1, device=CPU, flag=True)  # keyword order does not matter


def test_cast_like_linear_outside_and_inside_autocast():
    """Outside autocast the tensors come back as they are (the same objects); under CPU
    autocast the castable floats are cast, float64 and None are left alone."""
    from logitless.ops.common.autocast import cast_like_linear

    x, w = torch.randn(3, 4), torch.randn(5, 4, dtype=torch.bfloat16)
    d = torch.randn(5, dtype=torch.float64)
    out = cast_like_linear(x, w, None)
    assert out[0] is x and out[1] is w and out[2] is None and len(out) == 3
    assert cast_like_linear(None, x)[1] is x
    with torch.autocast("cpu", dtype=torch.bfloat16):
        cx, cw, cb, cd = cast_like_linear(x, w, None, d)
    assert cx.dtype == torch.bfloat16 and cw is w and cb is None and cd is d


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
