"""Each integration logs one INFO line per process saying that logitless is active
(``logitless.integrations._announce``): here the ones that run without their framework
installed (``patch_torch``, TRL's head, the axolotl plugin's model patch, verl's drop-ins); torchtitan, OpenRLHF,
NeMo Automodel and LLaMA-Factory check theirs in their own tests."""

from __future__ import annotations

import logging

import pytest
import torch

from logitless.integrations import _announce


@pytest.fixture
def lines(monkeypatch, caplog):
    monkeypatch.setattr(_announce, "_announced", set())
    caplog.set_level(logging.INFO)
    return lambda: [(r.name, r.getMessage()) for r in caplog.records if "logitless is active" in r.getMessage()]


def _tiny_llama():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=67, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2)
    return transformers.LlamaForCausalLM(cfg)


def test_announce_once_per_integration(lines):
    assert _announce.announce("a", "first") is True
    assert _announce.announce("a", "again") is False
    assert _announce.announce("b", "other", logger="framework.logitless") is True
    assert lines() == [("logitless", "logitless is active (a): first"),
                       ("framework.logitless", "logitless is active (b): other")]


def test_patch_torch(lines):
    import logitless

    if not hasattr(torch.nn.functional, "linear_cross_entropy"):
        pytest.skip("torch < 2.13 has no F.linear_cross_entropy to patch")
    try:
        logitless.patch_torch()
        logitless.patch_torch(memory_budget=2**20)
    finally:
        logitless.unpatch_torch()
    assert lines() == [("logitless", "logitless is active (patch_torch): torch.nn.functional.linear_cross_entropy "
                                     "runs on logitless")]


def test_trl_head(lines):
    from logitless.integrations.trl import add_logitless_lm_head

    for _ in range(2):
        add_logitless_lm_head(_tiny_llama())
    assert lines() == [("logitless", "logitless is active (trl): the TRL trainer's LM head computed by logitless "
                                     "(no logits)")]


def test_axolotl_plugin_logs_on_an_axolotl_logger(lines):
    from logitless.integrations.axolotl import LOGGER, patch_model

    for _ in range(2):
        patch_model({"logitless": True}, _tiny_llama())
    patch_model({"logitless": False}, _tiny_llama())
    assert LOGGER.startswith("axolotl.")   # axolotl shows INFO only from axolotl.* loggers
    assert lines() == [(LOGGER, "logitless is active (axolotl): the model's loss computed by logitless (no logits), "
                                "LlamaForCausalLM")]


def test_verl_entry_points(lines):
    """verl's drop-ins (no verl needed): the log-prob function and the top-k distillation loss,
    each once however often it is called."""
    from logitless.integrations import verl

    g = torch.Generator().manual_seed(0)
    h, w = torch.randn(2, 5, 8, generator=g), torch.randn(31, 8, generator=g)
    labels = torch.randint(0, 31, (2, 5), generator=g)
    lp_t, ids = torch.log_softmax(torch.randn(2, 5, 31, generator=g), -1).topk(4, dim=-1)
    for _ in range(2):
        verl.linear_cross_entropy(h, w, labels)
        verl.compute_forward_kl_topk(h, w, lp_t, ids)
    assert lines() == [
        ("logitless", "logitless is active (verl): the actor's log-probs and entropy from linear_log_probs (hidden "
                      "states and the head), no logits"),
        ("logitless", "logitless is active (verl_topk): compute_forward_kl_topk from the student's hidden states and "
                      "head (linear_topk_kl), no logits")]
