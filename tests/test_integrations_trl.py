"""logitless.integrations.trl: TRL's fused-LM-head protocol (what GRPOTrainer calls for
the per-token log-probs and entropy) served by logitless, same numbers as TRL's own."""

from __future__ import annotations

import types

import pytest
import torch

trl_utils = pytest.importorskip("trl.trainer.utils", reason="trl (and its deps) not importable")

import logitless.integrations.hf as hf  # noqa: E402
from logitless.integrations.trl import add_logitless_lm_head, patch_grpo  # noqa: E402

from .test_integrations_hf import tiny_llama  # noqa: E402


def _batch(seed=0, vocab=97):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (3, 10), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    mask[2, -2:] = 0
    keep = 5  # completion length, as GRPOTrainer
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :-keep] = -100
    return ids, mask, labels, keep


@pytest.fixture
def counter(monkeypatch):
    calls = []
    real = hf.linear_log_probs

    def counted(*a, **k):
        calls.append(k)
        return real(*a, **k)

    monkeypatch.setattr(hf, "linear_log_probs", counted)
    return calls


def _run(model, ids, mask, labels, keep):
    out = model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)
    return out.log_probs[:, -keep:], out.entropy[:, -keep:], out


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_same_numbers_and_gradients_as_trl(temperature, counter):
    theirs_model, ours_model = tiny_llama(seed=4), tiny_llama(seed=4)
    trl_utils.add_fused_lm_head(theirs_model, temperature=temperature, outputs=("log_probs", "entropy"))
    trl_utils.add_fused_lm_head(ours_model, temperature=temperature, outputs=("log_probs", "entropy"))
    add_logitless_lm_head(ours_model, temperature)
    ids, mask, labels, keep = _batch()
    lp_t, ent_t, out_t = _run(theirs_model, ids, mask, labels, keep)
    lp_o, ent_o, out_o = _run(ours_model, ids, mask, labels, keep)
    assert len(counter) == 1 and counter[0]["temperature"] == temperature and counter[0]["entropy"]
    torch.testing.assert_close(lp_o, lp_t, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent_o, ent_t, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out_o.loss, out_t.loss, rtol=1e-5, atol=1e-5)
    assert torch.equal(out_o.label_mask, out_t.label_mask)
    assert (lp_o[mask[:, -keep:] == 0] == 0).all()
    g1, g2 = torch.randn_like(lp_t), torch.randn_like(ent_t)
    gt = torch.autograd.grad((lp_t * g1).sum() + (ent_t * g2).sum(), list(theirs_model.parameters()), allow_unused=True)
    go = torch.autograd.grad((lp_o * g1).sum() + (ent_o * g2).sum(), list(ours_model.parameters()), allow_unused=True)
    for a, b in zip(go, gt):
        if a is None or b is None:
            assert a is None and b is None
            continue
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    # the non-fused path (generation, plain forward) is untouched
    torch.testing.assert_close(ours_model(input_ids=ids).logits, theirs_model(input_ids=ids).logits)
    assert len(counter) == 1


def test_patch_grpo_routes_policy_and_reference(counter):
    policy, ref = tiny_llama(seed=5), tiny_llama(seed=6)
    for m in (policy, ref):
        trl_utils.add_fused_lm_head(m, temperature=0.9, outputs=("log_probs", "entropy"))
    trainer = types.SimpleNamespace(model=policy, ref_model=ref, temperature=0.9, args=None)
    patch_grpo(trainer)
    ids, mask, labels, keep = _batch(seed=1)
    _run(policy, ids, mask, labels, keep)
    with torch.no_grad():
        out = ref(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)
    assert out.entropy is None and out.log_probs.shape == (3, 9)
    assert [c["temperature"] for c in counter] == [0.9, 0.9]
