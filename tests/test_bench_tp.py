"""The tp suite's baselines and its CPU (gloo) harness: the Megatron-style log-prob
baseline must be right for its timings to mean anything."""

import datetime
import json
import os
import subprocess
import sys
import tempfile

import pytest
import torch
import torch.distributed as dist

from logitless_bench import tp


@pytest.fixture(scope="module")
def one_rank_group():
    if dist.is_initialized():
        yield dist.group.WORLD
        return
    with tempfile.TemporaryDirectory(prefix="logitless-tp-") as tmp:  # a file, not a racy free port
        dist.init_process_group("gloo", store=dist.FileStore(os.path.join(tmp, "store"), 1), rank=0, world_size=1,
                                timeout=datetime.timedelta(minutes=1))
        yield dist.group.WORLD
        dist.destroy_process_group()


def test_megatron_style_log_probs_match_autograd(one_rank_group):
    g = torch.Generator().manual_seed(0)
    n, h, v, temp = 7, 5, 13, tp.TEMPERATURE
    x = torch.randn(n, h, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(v, h, dtype=torch.float64, generator=g, requires_grad=True)
    t = torch.randint(0, v, (n,), generator=g)
    g1, g2 = torch.rand(n, dtype=torch.float64, generator=g), torch.rand(n, dtype=torch.float64, generator=g)
    a = torch.log_softmax((x @ w.T) / temp, dim=-1)
    ref_lp, ref_h = a.gather(1, t[:, None])[:, 0], -(a.exp() * a).sum(-1)
    ref_dx, ref_dw = torch.autograd.grad((ref_lp * g1 + ref_h * g2).sum(), (x, w))
    # float64 end to end: the baseline's .float() would round, so feed it logits via its Function.
    lp, ent = tp._VocabParallelLogProbs.apply((x @ w.T) / temp, t, 0, one_rank_group)
    dx, dw = torch.autograd.grad((lp * g1 + ent * g2).sum(), (x, w))
    for got, ref in ((lp, ref_lp), (ent, ref_h), (dx, ref_dx), (dw, ref_dw)):
        torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-10)


def test_tp_suite_log_prob_rows_on_cpu(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(["src", "benchmarks", os.environ.get("PYTHONPATH", "")]))
    env.pop("TRITON_INTERPRET", None)  # the torch path: the harness, not the kernels
    methods = "logitless-tp-logp,megatron-style-logp,logitless-1gpu-logp"
    proc = subprocess.run([sys.executable, "-m", "logitless_bench", "--suite", "tp", "--cpu", "--methods", methods,
                           "--warmup", "0", "--reps", "1", "--out", str(tmp_path)],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    data = json.loads((tmp_path / "latest-tp-cpu.json").read_text())
    rows = data["rows"][0]["methods"]
    assert set(rows) == set(methods.split(","))
    for name, r in rows.items():
        assert "error" not in r, (name, r)
        assert r["logp_err_fp64"] < 1e-5 and r["entropy_err_fp64"] < 1e-5, (name, r)
    assert rows["logitless-tp-logp"]["rel_err_1gpu"] < 1e-6


def _logits_tp_jsd_rank(rank, world, device):
    """Each rank's rows of both heads: the loss, dx (complete on every rank) and this
    rank's dW rows of the logits-way baseline equal float64 autograd of the whole heads."""
    from logitless.ops.linear_jsd.reference import linear_jsd_reference
    from tests._distributed import blocks

    g = torch.Generator().manual_seed(3)
    n, h, rows = 6, 5, [7, 4]  # uneven blocks, V = 11 (prime)
    xs, xt = torch.randn(n, h, generator=g, dtype=torch.float64), torch.randn(n, h, generator=g, dtype=torch.float64)
    ws, wt = torch.randn(11, h, generator=g, dtype=torch.float64), torch.randn(11, h, generator=g, dtype=torch.float64)
    mine = blocks(rows, rank)
    xr, wr = xs.clone().requires_grad_(), ws.clone().requires_grad_()
    ref = linear_jsd_reference(xr, wr, xt, wt, beta=tp.JSD_BETA)
    ref.backward()
    xl, wl = xs.clone().requires_grad_(), ws[mine].clone().requires_grad_()
    # The baseline casts the logits to fp32: compared at fp32's precision.
    loss = tp.logits_tp_jsd(xl, wl, xt, wt[mine], dist.group.WORLD)
    loss.backward()
    for got, want in ((loss, ref), (xl.grad, xr.grad), (wl.grad, wr.grad[mine])):
        torch.testing.assert_close(got.double(), want, rtol=2e-5, atol=2e-6)


def test_logits_tp_jsd_baseline_matches_float64_over_two_ranks():
    from tests._distributed import spawn

    spawn(_logits_tp_jsd_rank, 2, backend="gloo")


def test_tp_suite_distillation_rows_on_cpu(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(["src", "benchmarks", os.environ.get("PYTHONPATH", "")]))
    env.pop("TRITON_INTERPRET", None)
    methods = ",".join(tp.JSD_METHODS)
    proc = subprocess.run([sys.executable, "-m", "logitless_bench", "--suite", "tp", "--cpu", "--methods", methods,
                           "--warmup", "0", "--reps", "1", "--out", str(tmp_path)],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = json.loads((tmp_path / "latest-tp-cpu.json").read_text())["rows"][0]["methods"]
    assert set(rows) == set(tp.JSD_METHODS)
    for name, r in rows.items():
        assert "error" not in r, (name, r)
        assert r["rel_err_fp64"] < 1e-5, (name, r)
    assert rows["logitless-tp-jsd"]["rel_err_1gpu"] < 1e-6 and rows["logits-tp-jsd"]["rel_err_1gpu"] < 1e-5
    assert "rel_err_1gpu" not in rows["logitless-tp-kl"]  # no one-GPU KL row to compare with
