"""logitless.integrations.openrlhf against OpenRLHF 0.11's own ``Actor.forward`` (the real
package, ``openrlhf.models``): a tiny random Llama wrapped in OpenRLHF's ``Actor``, left-padded
rows, a rollout temperature; the patched actor's action log-probs, all log-probs and entropy
equal OpenRLHF's (full fp32 logits, ``log_probs_from_logits``, ``compute_entropy``), and OpenRLHF's
PPO and GSPO ``PolicyLoss`` plus its entropy term give the same loss and the same gradient of
every parameter; logitless' op runs and the head's logits are never built; errors.

OpenRLHF imports ``flash_attn`` (and ``deepspeed``) at import time; on a CPU without them the
test stands them in as OpenRLHF's own CPU test (tests/test_actor_entropy_temperature.py in its
wheel) does. Where OpenRLHF is not installed the file skips: scripts/test_frameworks.sh
installs it (docs/testing.md).
"""

from __future__ import annotations

import copy
import importlib.machinery
import importlib.util
import logging
import sys
from unittest.mock import MagicMock

import pytest
import torch

if importlib.util.find_spec("openrlhf") is None:
    pytest.skip("OpenRLHF is not installed (scripts/test_frameworks.sh openrlhf installs it)", allow_module_level=True)
transformers = pytest.importorskip("transformers")


def _import_openrlhf_models():
    """openrlhf.models, with flash_attn / deepspeed stood in where they are absent (CPU)."""
    absent = {top for top in ("deepspeed", "flash_attn") if importlib.util.find_spec(top) is None}
    for name in ("deepspeed", "flash_attn", "flash_attn.bert_padding", "flash_attn.utils",
                 "flash_attn.utils.distributed"):
        if name.split(".")[0] in absent and name not in sys.modules:
            stub = MagicMock()
            stub.__spec__ = importlib.machinery.ModuleSpec(name, None)
            sys.modules[name] = stub
    import openrlhf.models as models
    import openrlhf.models.utils as utils

    return models, utils


models, orl_utils = _import_openrlhf_models()

import logitless.integrations.openrlhf as lt_openrlhf  # noqa: E402
from logitless.integrations import _announce  # noqa: E402

V, H = 97, 40


def _actor(temperature=0.7, softcap=None, seed=0):
    torch.manual_seed(seed)
    if softcap is None:
        cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2)
        model = transformers.LlamaForCausalLM(cfg)
    else:
        cfg = transformers.Gemma2Config(vocab_size=V, hidden_size=H, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                        final_logit_softcapping=softcap)
        model = transformers.Gemma2ForCausalLM(cfg)
    model.config.use_cache = False
    actor = models.Actor(model.float())
    actor.temperature = temperature
    actor.packing_samples = False
    return actor


def _batch(seed=1):
    g = torch.Generator().manual_seed(seed)
    seq = torch.randint(0, V, (3, 13), generator=g)
    mask = torch.ones_like(seq)
    mask[1, :4] = 0   # left padding, as OpenRLHF's rollouts
    mask[2, :1] = 0
    action_mask = torch.ones(3, 6, dtype=torch.bool)
    action_mask[0, -2:] = False
    return seq, mask, action_mask


def _openrlhf(actor, *args, **kwargs):
    with torch._dynamo.config.patch(disable=True):   # compute_entropy is torch.compile'd: run it eagerly
        return actor(*args, **kwargs)


@pytest.fixture
def spy(monkeypatch):
    calls = []
    original = lt_openrlhf.linear_log_probs

    def counted(*args, **kwargs):
        calls.append(kwargs)
        return original(*args, **kwargs)

    monkeypatch.setattr(lt_openrlhf, "linear_log_probs", counted)
    return calls


def _no_logits(actor):
    def refuse(module, args, output):
        raise AssertionError("the LM head ran: logits were built")
    return actor.model.get_output_embeddings().register_forward_hook(refuse)


@pytest.mark.parametrize("softcap", [None, 5.0])
def test_log_probs_and_entropy_equal_openrlhf(softcap, spy):
    theirs = _actor(softcap=softcap)
    ours = lt_openrlhf.patch_actor(copy.deepcopy(theirs))
    seq, mask, action_mask = _batch()
    ref_lp, ref_out = _openrlhf(theirs, seq, action_mask, attention_mask=mask, return_output=True, return_entropy=True)
    hook = _no_logits(ours)
    lp, out = ours(seq, action_mask, attention_mask=mask, return_output=True, return_entropy=True)
    all_lp = ours(seq, attention_mask=mask, return_logprobs=True)
    hook.remove()
    ref_all = _openrlhf(theirs, seq, attention_mask=mask, return_logprobs=True)
    assert len(spy) == 2 and spy[0]["temperature"] == 0.7 and spy[0]["entropy"] is True
    assert out.logits is None and out.entropy.shape == ref_out.entropy.shape == (3, 12)
    torch.testing.assert_close(lp, ref_lp, rtol=0, atol=2e-6)
    torch.testing.assert_close(all_lp, ref_all, rtol=0, atol=2e-6)
    torch.testing.assert_close(out.entropy, ref_out.entropy, rtol=0, atol=2e-6)


@pytest.mark.parametrize("loss_type", ["ppo", "gspo"])
def test_policy_loss_and_every_gradient_equal_openrlhf(loss_type, spy):
    """OpenRLHF's PolicyLoss and entropy term, as its PPO actor step computes them."""
    theirs = _actor()
    ours = lt_openrlhf.patch_actor(copy.deepcopy(theirs))
    seq, mask, action_mask = _batch()
    with torch.no_grad():
        old = _openrlhf(theirs, seq, action_mask, attention_mask=mask) + 0.05 * torch.randn(3, 6)
    adv = torch.randn(3, 6)
    loss_fn = models.PolicyLoss(policy_loss_type=loss_type)
    losses = []
    for actor, run in ((theirs, _openrlhf), (ours, lambda a, *x, **k: a(*x, **k))):
        lp, out = run(actor, seq, action_mask, attention_mask=mask, return_output=True, return_entropy=True)
        policy = loss_fn(lp, old, adv, action_mask=action_mask)[0]
        entropy = models.aggregate_loss(out.entropy[:, -action_mask.shape[1]:], action_mask)
        loss = policy - 0.01 * entropy
        loss.backward()
        losses.append(loss.detach())
    assert len(spy) == 1
    torch.testing.assert_close(losses[1], losses[0], rtol=0, atol=2e-6)
    for (name, p), q in zip(theirs.named_parameters(), ours.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_logits_requests_run_openrlhf_forward(spy):
    ours = lt_openrlhf.patch_actor(_actor())
    seq, mask, _ = _batch()
    out = _openrlhf(ours, seq, attention_mask=mask, return_output=True)
    assert out["logits"].shape == (3, 13, V) and not spy


def test_patch_replaces_the_class_forward(monkeypatch, spy):
    monkeypatch.setattr(models.actor.Actor, "forward", models.actor.Actor.forward)
    monkeypatch.setattr(lt_openrlhf, "_openrlhf_forward", None)
    original = models.actor.Actor.forward
    lt_openrlhf.patch()
    lt_openrlhf.patch()   # idempotent
    assert models.actor.Actor.forward is lt_openrlhf.forward and lt_openrlhf._openrlhf_forward is original
    seq, mask, action_mask = _batch()
    lp = _actor()(seq, action_mask, attention_mask=mask)
    assert len(spy) == 1 and lp.shape == (3, 6)
    out = _openrlhf(_actor(), seq, attention_mask=mask, return_output=True)   # logits asked: OpenRLHF's own
    assert out["logits"].shape == (3, 13, V)


def test_logs_once_per_process(monkeypatch, caplog):
    monkeypatch.setattr(_announce, "_announced", set())
    with caplog.at_level(logging.INFO, logger="logitless"):
        lt_openrlhf.patch_actor(_actor())
        lt_openrlhf.patch_actor(_actor())
    lines = [r.getMessage() for r in caplog.records if "logitless is active" in r.getMessage()]
    assert lines == ["logitless is active (openrlhf): the actor's log-probs and entropy from linear_log_probs, "
                     "no logits"]


def test_errors():
    seq, mask, action_mask = _batch()
    with pytest.raises(TypeError, match="expected an openrlhf.models.Actor"):
        lt_openrlhf.patch_actor(torch.nn.Linear(2, 2))
    vlm = _actor()
    vlm.is_vlm = True
    with pytest.raises(ValueError, match="vision-language"):
        lt_openrlhf.patch_actor(vlm)
    scaled = _actor()
    scaled.model.config.logit_scale = 2.0
    with pytest.raises(ValueError, match="scales its logits"):
        lt_openrlhf.patch_actor(scaled)
    zero3 = lt_openrlhf.patch_actor(_actor())
    zero3.model.get_output_embeddings().weight.ds_id = 7   # what DeepSpeed ZeRO-3 sets on a partitioned parameter
    with pytest.raises(ValueError, match="ZeRO-3"):
        zero3(seq, action_mask, attention_mask=mask)
    actor = lt_openrlhf.patch_actor(_actor())
    with pytest.raises(ValueError, match="return_entropy needs return_output"):
        actor(seq, action_mask, attention_mask=mask, return_entropy=True)
    _, out = actor(seq, action_mask, attention_mask=mask, return_output=True)
    with pytest.raises(AttributeError, match="aux_loss_coef 0"):
        out.__getattr__("aux_loss")
