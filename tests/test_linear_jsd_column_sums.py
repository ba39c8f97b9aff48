"""linear_jsd's second pass under vocabulary parallelism, one process: ``column_sums`` of
both backends over a part of the columns, with the full rows' log-sum-exps given, against
float64 row statistics of the full rows (``formulas.jsd.row_stats``). The parts' sums add
up to the full rows' S, K and target logit (what the TP forward's collective 3 does).

The Triton backend runs on the GPU when there is one, else on the CPU interpreter
(conftest.py), at small sizes.
"""

from __future__ import annotations

import pytest
import torch

from logitless.formulas.common import apply_softcap
from logitless.formulas.jsd import K_ROW, LSE_S, LSE_T, S_ROW, row_stats
from logitless.ops.linear_jsd.api import BACKENDS
from logitless.options import JSDOptions
from tests.conftest import DEVICE

CASES = [
    dict(beta=0.5),
    dict(beta=0.3, temperature=0.7, student_softcap=3.0, teacher_softcap=5.0, hard_label_weight=0.5),
    dict(beta=0.0, hard_label_weight=1.0),  # the KL limits, forced through the second pass
    dict(beta=1.0, temperature=1.5),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("case", CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_column_sums_of_parts_add_up_to_the_full_rows(case, bias, dtype):
    g = torch.Generator().manual_seed(3)
    n, hs, ht, v, cut = 13, 17, 23, 331, 140  # odd sizes; V prime, parts of 140 + 191 columns (3 splits each)
    xs, xt = torch.randn(n, hs, generator=g, dtype=torch.float64), torch.randn(n, ht, generator=g, dtype=torch.float64)
    ws = torch.randn(v, hs, generator=g, dtype=torch.float64) * hs ** -0.5 * 2
    wt = torch.randn(v, ht, generator=g, dtype=torch.float64) * ht ** -0.5 * 2
    bs = torch.randn(v, generator=g, dtype=torch.float64) * 0.5 if bias else None
    bt = torch.randn(v, generator=g, dtype=torch.float64) * 0.5 if bias else None
    target = torch.randint(0, v, (n,), generator=g)
    target[2] = -100
    opts = JSDOptions(**case)
    # inputs as the op sees them (rounded to dtype), float64 statistics of the full rows
    xs, xt, ws, wt = (u.to(dtype).double() for u in (xs, xt, ws, wt))
    bs, bt = (None if u is None else u.to(dtype).double() for u in (bs, bt))
    zs = apply_softcap(xs @ ws.T + (bs if bias else 0), opts.student_softcap)
    zt = apply_softcap(xt @ wt.T + (bt if bias else 0), opts.teacher_softcap)
    full = row_stats(zs, zt, target.clamp(0), opts)
    lse_s, lse_t = full[LSE_S], full[LSE_T]
    for name, cd in (("torch", torch.float64), ("triton", dtype)):
        backend = BACKENDS[name]
        total = torch.zeros(3, n, dtype=torch.float64)
        for v0, v1 in ((0, cut), (cut, v)):
            local = target - v0
            local = torch.where((local >= 0) & (local < v1 - v0), local, torch.full_like(local, -1))
            args = [u.to(DEVICE, cd) if u is not None else None
                    for u in (xs, ws[v0:v1], None if bs is None else bs[v0:v1], xt, wt[v0:v1],
                              None if bt is None else bt[v0:v1])]
            stat = torch.float64 if name == "torch" else torch.float32
            config = backend.plan(args[0], args[1], args[3], opts, budget=1 << 20, column_sums=True)
            out = backend.column_sums(*args, local.to(DEVICE), lse_s.to(DEVICE, stat), lse_t.to(DEVICE, stat),
                                      opts, config)
            assert out.shape == (3, n) and torch.isfinite(out).all(), name
            total += out.double().cpu()
        tol = 1e-10 if name == "torch" else 2e-5
        scale = max(1.0, full.abs().max().item())
        for row, what in ((S_ROW, "S"), (K_ROW, "K")):
            err = (total[row - 2] - full[row]).abs().max().item()
            assert err <= tol * scale, f"{name} {what}: {err:.3g}"
        picked = zs.gather(1, target.clamp(0)[:, None])[:, 0]
        want = torch.where(target >= 0, picked, torch.zeros_like(picked))
        err = (total[2] - want).abs().max().item()
        assert err <= tol * scale, f"{name} target logit: {err:.3g}"


def test_column_sums_without_columns_or_tokens():
    opts = JSDOptions(beta=0.5)
    x = torch.randn(4, 8, device=DEVICE)
    lse = torch.zeros(4, device=DEVICE)
    t = torch.zeros(4, dtype=torch.long, device=DEVICE)
    for name in ("torch", "triton"):  # (no Config: nothing to plan)
        backend = BACKENDS[name]
        out = backend.column_sums(x, x[:0], None, x, x[:0], None, t, lse, lse, opts, None)
        assert out.shape == (3, 4) and (out == 0).all()
        out = backend.column_sums(x[:0], x, None, x[:0], x, None, t[:0], lse[:0], lse[:0], opts, None)
        assert out.shape == (3, 0)
