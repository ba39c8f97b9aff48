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
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(["src", os.environ.get("PYTHONPATH", "")]))
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
