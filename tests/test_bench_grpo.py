"""The end-to-end RL/SFT benchmark rows on the CPU (harness checks, tiny models):
``--suite grpo`` (one GRPO step per LM-head method) and the TRL SFTTrainer rows of
``--suite train``."""

from __future__ import annotations

import argparse
import json
import math

import pytest
import torch

from logitless_bench import grpo, timing


def _trl_ok() -> bool:
    try:
        import datasets  # noqa: F401
        import tokenizers  # noqa: F401
        from trl.trainer.utils import add_fused_lm_head  # noqa: F401
    except Exception:  # noqa: BLE001
        return False
    return True


def test_grpo_loss_formula_in_float64():
    """The loss against the formula written out per token in float64: clipped surrogate, k3 KL, entropy bonus,
    mean over the masked tokens; the clipped side carries no gradient."""
    g = torch.Generator().manual_seed(3)
    B, C = 3, 7
    logp = (torch.randn(B, C, generator=g, dtype=torch.float64) - 4).requires_grad_(True)
    ent = torch.rand(B, C, generator=g, dtype=torch.float64) * 5
    old = logp.detach() + 0.3 * torch.randn(B, C, generator=g, dtype=torch.float64)
    ref = logp.detach() + 0.5 * torch.randn(B, C, generator=g, dtype=torch.float64)
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    mask = (torch.rand(B, C, generator=g) > 0.3).double()
    cfg = grpo.LossConfig(temperature=0.7, beta=0.04, entropy_coef=0.01, epsilon=0.2)
    loss, pg_kl = grpo.grpo_loss(logp, ent, old, ref, adv, mask, cfg)
    total = bonus = 0.0
    for b in range(B):
        for t in range(C):
            if not mask[b, t]:
                continue
            r = math.exp(float(logp[b, t].detach() - old[b, t]))
            a = float(adv[b])
            pg = -min(r * a, min(max(r, 0.8), 1.2) * a)
            d = float(ref[b, t] - logp[b, t].detach())
            total += pg + 0.04 * (math.exp(d) - d - 1)
            bonus += float(ent[b, t])
    n = float(mask.sum())
    assert abs(pg_kl.item() - total / n) < 1e-12
    assert abs(loss.item() - (total - 0.01 * bonus) / n) < 1e-12
    loss.backward()
    r = torch.exp(logp.detach() - old)
    a = adv[:, None].expand(B, C)
    clipped = ((r > 1.2) & (a > 0)) | ((r < 0.8) & (a < 0))
    d = ref - logp.detach()
    kl_grad = 0.04 * (1 - torch.exp(d)) / n
    torch.testing.assert_close(logp.grad[clipped.bool() & mask.bool()], kl_grad[clipped.bool() & mask.bool()])
    assert (logp.grad[~mask.bool()] == 0).all()
    # no entropy: both returns are the same scalar
    a1, a2 = grpo.grpo_loss(logp.detach(), None, old, ref, adv, mask, cfg)
    assert a1.item() == a2.item() == pytest.approx(total / n, abs=1e-12)


def test_grpo_batches_mask_the_padding():
    bs = grpo.make_batches(2, 50, batch=4, prompt=3, completion=9, min_frac=0.5, seed=1, device="cpu")
    assert len(bs) == 2
    for b in bs:
        assert b["input_ids"].shape == (4, 12) and b["completion_mask"].shape == (4, 9)
        m = b["completion_mask"]
        lengths = m.sum(1)
        assert ((lengths >= 5) & (lengths <= 9)).all()
        assert torch.equal(m, (torch.arange(9)[None] < lengths[:, None]).float())  # a prefix of the completion
        assert torch.equal(b["attention_mask"][:, 3:].float(), m) and (b["attention_mask"][:, :3] == 1).all()
        labels = grpo._fused_labels(b)
        assert (labels[:, :3] == -100).all() and torch.equal(labels[:, 3:] != -100, m.bool())
    again = grpo.make_batches(2, 50, batch=4, prompt=3, completion=9, min_frac=0.5, seed=1, device="cpu")
    assert torch.equal(again[1]["input_ids"], bs[1]["input_ids"])  # seeded


def test_step_times_ms_cpu():
    seen = []
    times = timing.step_times_ms(seen.append, 3, device="cpu", first=2)
    assert seen == [2, 3, 4] and len(times) == 3 and all(t >= 0 for t in times)
    assert timing.step_times_ms(seen.append, 0, device="cpu") == []


def test_grpo_suite_cpu(tmp_path, capsys):
    """--suite grpo on the CPU in fp32 (no autocast): every importable method trains; its losses and its
    first gradient agree with unpatched's to fp32 rounding."""
    from logitless_bench import cli

    rc = cli.main(["--suite", "grpo", "--cpu", "--mode", "fp32", "--steps", "2", "--warmup", "1",
                   "--out", str(tmp_path)])
    assert rc == 0
    assert "NO GPU FOUND" in capsys.readouterr().out
    data = json.loads((tmp_path / "latest-grpo-cpu.json").read_text())
    rows = {r["method"]: r for r in data["rows"]}
    assert list(rows) == list(grpo.METHODS)
    for name in ("unpatched", "logitless", "logitless-trl"):
        assert rows[name]["status"] == "ok", rows[name]
        assert len(rows[name]["losses"]) == 3 and len(rows[name]["step_ms"]) == 2
    assert rows["logitless-trl"]["policy_forward"].endswith("logitless/integrations/trl.py")
    assert rows["unpatched"]["policy_forward"].startswith("transformers/")  # the model's own forward
    for name in ("logitless", "logitless-trl"):
        # same weights, batches and optimizer: the losses agree to fp32 rounding over all steps
        assert rows[name]["loss_diff_max"] < 1e-5, rows[name]
        assert rows[name]["loss_compared"] == "loss"
        assert rows[name]["grad_norm_rel_diff_first"] < 1e-4, rows[name]  # the backward agrees too
    if _trl_ok():
        assert rows["trl-head"]["status"] == "ok" and rows["trl-head"]["loss_diff_max"] < 1e-5
        assert rows["trl-head"]["policy_forward"].endswith("trl/trainer/utils.py")
        assert rows["trl-logits"]["status"] == "ok" and rows["trl-logits"]["loss_diff_max"] < 1e-5
    else:
        for name in ("trl-head", "trl-logits"):
            assert rows[name]["status"] == "skipped" and "trl" in rows[name]["reason"]
    if rows["liger"]["status"] == "ok":  # liger installed: compared without the entropy bonus
        assert rows["liger"]["loss_compared"] == "loss without entropy bonus"
        assert rows["liger"]["loss_diff_max"] < 1e-5
    else:
        assert rows["liger"]["status"] == "skipped" and "liger" in rows["liger"]["reason"]
    md = (tmp_path / "latest-grpo-cpu.md").read_text()
    assert "NO GPU FOUND" in md and "| logitless | ok | none" in md and "Targets (issue 20)" in md
    assert data["settings"]["completion_tokens"] == 2 * 24 and data["settings"]["min_completion_frac"] == 0.5
    assert data["settings"]["mode"] == "fp32" and data["settings"]["reference_model"].startswith("fp32")


def test_grpo_suite_cpu_autocast(tmp_path):
    """The default mode (bf16 autocast, bf16 reference model) on the CPU: the rows run, the losses agree to bf16
    rounding."""
    from logitless_bench import cli

    rc = cli.main(["--suite", "grpo", "--cpu", "--methods", "unpatched,logitless", "--steps", "1", "--warmup", "0",
                   "--out", str(tmp_path)])
    assert rc == 0
    rows = {r["method"]: r for r in json.loads((tmp_path / "latest-grpo-cpu.json").read_text())["rows"]}
    assert rows["logitless"]["status"] == "ok" and rows["logitless"]["loss_diff_first"] < 1e-3
    assert rows["logitless"]["grad_norm_rel_diff_first"] < 2e-2


def test_grpo_suite_bad_options(tmp_path):
    from logitless_bench import cli

    with pytest.raises(SystemExit, match="unknown grpo method"):
        cli.main(["--suite", "grpo", "--cpu", "--methods", "nope", "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="--min-completion-frac"):
        cli.main(["--suite", "grpo", "--cpu", "--min-completion-frac", "0", "--out", str(tmp_path)])


def test_grpo_failure_is_a_row_not_a_crash(monkeypatch):
    """A method that raises (an OOM, a peer's bug) becomes a failed row; the next method still runs."""
    def boom(self, model, b, entropy):
        raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

    monkeypatch.setattr(grpo.Unpatched, "logps", boom)
    from logitless_bench.train import CPU_MODEL

    args = argparse.Namespace(mode="autocast", seed=0, lr=1e-6, warmup=0, steps=1)
    cfg = dict(CPU_MODEL, num_hidden_layers=1)
    batches = grpo.make_batches(1, cfg["vocab_size"], 1, 2, 4, 1.0, 0, "cpu")
    res = grpo.run_method("unpatched", cfg, args, grpo.LossConfig(), batches, torch.device("cpu"))
    assert res["status"] == "failed" and res["oom"] and "OutOfMemoryError" in res["reason"]
    ok = grpo.run_method("logitless", cfg, args, grpo.LossConfig(), batches, torch.device("cpu"))
    assert ok["status"] == "ok" and len(ok["losses"]) == 1


@pytest.mark.skipif(not _trl_ok(), reason="trl, datasets or tokenizers not importable")
def test_train_suite_trl_sft_rows_cpu(tmp_path):
    """--suite train --methods hf,trl-head,trl+logitless: TRL's SFTTrainer.compute_loss on the same model and
    batches, with its own head and with patch_sft; both follow the hf (unpatched) curve."""
    from logitless_bench import cli

    rc = cli.main(["--suite", "train", "--cpu", "--steps", "2", "--modes", "autocast", "--methods",
                   "hf,trl-head,trl+logitless", "--no-big", "--no-spread", "--out", str(tmp_path)])
    assert rc == 0
    data = json.loads((tmp_path / "latest-train-cpu.json").read_text())
    runs = {r["name"]: r for r in data["runs"]}
    assert set(runs) == {"hf-autocast", "trl-head-autocast", "trl+logitless-autocast"}
    assert all(len(r["losses"]) == 2 and not r.get("error") for r in runs.values()), runs
    assert runs["trl-head-autocast"]["forward_file"].endswith("trl/trainer/utils.py")
    assert runs["trl+logitless-autocast"]["forward_file"].endswith("logitless/integrations/trl.py")
    hf = runs["hf-autocast"]["losses"]
    for name in ("trl-head-autocast", "trl+logitless-autocast"):
        assert abs(runs[name]["losses"][0] - hf[0]) < 2e-2  # same model, same data, bf16 autocast
    summary = {r["run"]: r for r in data["summary"]}
    assert summary["trl+logitless-autocast"]["time_vs_hf"] is not None
    assert any("trl+logitless vs trl-head" in t[0] for t in data["targets"])
    assert "| trl+logitless-autocast | 2 |" in (tmp_path / "latest-train-cpu.md").read_text()


@pytest.mark.parametrize("device", [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                   reason="CUDA only: the heads' Triton kernels on the GPU")),
])
def test_grpo_methods_against_float64(device):
    """Our methods' per-token log p and entropy (bf16 autocast, as the benchmark runs them) and the gradient of
    the GRPO loss to the LM-head weight, against an fp64 copy of the model: |ours - ref| <= |unpatched - ref| + tol
    (V prime, H not a multiple of 16, ragged completions)."""
    import copy

    from logitless_bench.train import CPU_MODEL, _build

    dev = torch.device(device)
    cfg = dict(CPU_MODEL, vocab_size=4099 if device == "cpu" else 32003, hidden_size=72, head_dim=18,
               num_attention_heads=4, num_key_value_heads=2)
    lc = grpo.LossConfig()
    b = grpo.make_batches(1, cfg["vocab_size"], 2, 5, 33, 0.5, 0, dev)[0]
    mask = b["completion_mask"].bool()
    g = torch.Generator().manual_seed(1)
    old = (torch.randn(2, 33, generator=g) * 0.1).to(dev)  # offsets to each method's own log p
    ref_off = (torch.randn(2, 33, generator=g) * 0.1).to(dev)
    policy = _build(cfg, "autocast", "hf", dev, 0)

    def run(name, model, autocast):
        m = grpo.make_method(name, lc, dev)
        pol, ref = copy.deepcopy(model), copy.deepcopy(model)
        m.setup(pol, ref)
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=autocast):
            lp, ent = m.logps(pol, b, True)
            base = lp.detach()
            loss, _ = grpo.grpo_loss(lp, ent, base + old.to(lp.dtype), base + ref_off.to(lp.dtype), b["advantages"],
                                     b["completion_mask"], lc)
        loss.backward()
        return lp.detach().double(), ent.detach().double(), pol.get_output_embeddings().weight.grad.double()

    lp64, ent64, gw64 = run("unpatched", policy.double(), False)
    policy.float()
    lp_t, ent_t, gw_t = run("unpatched", policy, True)

    def err(a, b_):
        return (a - b_)[mask].abs().max().item()

    for name in ("logitless", "logitless-trl"):  # ours (the peers' precision shows in the suite's loss diff)
        lp, ent, gw = run(name, policy, True)
        assert err(lp, lp64) <= err(lp_t, lp64) + 2e-3, name
        assert err(ent, ent64) <= err(ent_t, ent64) + 2e-3, name
        rel = ((gw - gw64).norm() / gw64.norm()).item()
        assert rel <= ((gw_t - gw64).norm() / gw64.norm()).item() + 1e-2, (name, rel)


def test_grpo_time_guard_skips_and_saves(tmp_path):
    from logitless_bench import cli

    rc = cli.main(["--suite", "grpo", "--cpu", "--methods", "unpatched,logitless", "--max-minutes", "1e-9",
                   "--out", str(tmp_path)])
    assert rc == 0
    rows = json.loads((tmp_path / "latest-grpo-cpu.json").read_text())["rows"]
    assert [(r["method"], r["status"]) for r in rows] == [("unpatched", "skipped"), ("logitless", "skipped")]
    assert "time guard" in rows[0]["reason"]
