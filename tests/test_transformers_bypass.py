"""logitless.transformers.patch under a trainer that bypasses it: TRL's SFTTrainer and
GRPOTrainer install a fused-LM-head forward that runs the backbone and reads the head
weight itself, so a plainly patched model would silently train with TRL's head. The
patch warns once (PatchBypassedWarning) naming the fix; logitless' own paths never warn."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

trl_utils = pytest.importorskip("trl.trainer.utils", reason="trl (and its deps) not importable")

import logitless.transformers as lt  # noqa: E402
import logitless.transformers.loss as lt_loss  # noqa: E402
from logitless.integrations import hf_log_probs  # noqa: E402
from logitless.integrations.trl import patch_grpo  # noqa: E402
from logitless.ops.linear_cross_entropy import api as lce_api  # noqa: E402
from logitless.transformers.bypass import BACKBONE_ATTR, PatchBypassedWarning, pre_hook  # noqa: E402

from .test_integrations_hf import tiny_llama  # noqa: E402


def _batch(seed=0, vocab=97):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (2, 7), generator=g)
    labels = ids.clone()
    labels[:, :3] = -100
    return ids, labels


def _bypassed(record):
    return [w for w in record if issubclass(w.category, PatchBypassedWarning)]


@pytest.fixture
def lce_counter(monkeypatch):
    calls = []
    real = lce_api.linear_cross_entropy

    def counted(*a, **k):
        calls.append(k)
        return real(*a, **k)

    monkeypatch.setattr(lce_api, "linear_cross_entropy", counted)  # patch_sft's head
    monkeypatch.setattr(lt_loss, "linear_cross_entropy", counted)  # patch's head, causal_lm_loss
    return calls


def test_trl_fused_head_over_patch_warns_once_naming_the_fix(lce_counter):
    model = lt.patch(tiny_llama(seed=1)).train()
    trl_utils.add_fused_lm_head(model, outputs=("log_probs", "entropy"))  # what SFTTrainer / GRPOTrainer do
    ids, labels = _batch()
    with pytest.warns(PatchBypassedWarning, match=r"TRL's fused LM head") as record:
        out = model(input_ids=ids, labels=labels, fused_lm_head=True)
    assert lce_counter == []  # the reason for the warning: logitless computed nothing
    assert len(_bypassed(record)) == 1
    msg = str(_bypassed(record)[0].message)
    assert "patch_sft(trainer)" in msg and "patch_grpo(trainer)" in msg and "LlamaForCausalLM" in msg
    out.loss.backward()
    with warnings.catch_warnings(record=True) as again:
        warnings.simplefilter("always")
        model(input_ids=ids, labels=labels, fused_lm_head=True)
    assert _bypassed(again) == []  # once


def test_no_warning_without_grad_in_eval_or_on_the_patched_paths(lce_counter):
    model = lt.patch(tiny_llama(seed=2)).train()
    ids, labels = _batch(1)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        model(input_ids=ids, labels=labels).loss.backward()         # the patched loss
        assert len(lce_counter) == 1
        model(input_ids=ids).logits.sum().backward()                 # training without labels: own loss
        hidden = model.model(input_ids=ids).last_hidden_state        # the user runs the backbone ...
        lt.causal_lm_loss(model, hidden, labels).backward()          # ... then causal_lm_loss
        hf_log_probs(model, ids, entropy=True)[0].sum().backward()
        trl_utils.add_fused_lm_head(model)                           # TRL's head installed, but:
        hf_log_probs(model, ids, entropy=True)[0].sum().backward()   # logitless' own backbone path
        with torch.no_grad():                                        # no autograd (generation, reference)
            model(input_ids=ids, labels=labels, fused_lm_head=True)
        model.eval()                                                 # eval mode
        model(input_ids=ids, labels=labels, fused_lm_head=True)
        model.train()
        model(input_ids=ids, labels=labels).loss.backward()  # TRL's head's non-fused path calls the patched forward
    assert _bypassed(seen) == []
    assert len(lce_counter) == 3


def test_patch_grpo_on_a_patched_model_does_not_warn():
    policy, ref = lt.patch(tiny_llama(seed=3)).train(), lt.patch(tiny_llama(seed=3)).eval()
    for m in (policy, ref):
        trl_utils.add_fused_lm_head(m, temperature=0.8, outputs=("log_probs", "entropy"))
    patch_grpo(type("T", (), {"model": policy, "ref_model": ref, "temperature": 0.8, "args": None})())
    ids, labels = _batch(2)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        out = policy(input_ids=ids, labels=labels, fused_lm_head=True)
        (out.log_probs.sum() + out.entropy.sum()).backward()
    assert _bypassed(seen) == []


def test_another_library_replacing_the_forward_is_named():
    model = lt.patch(tiny_llama(seed=4)).train()

    def my_forward(self, input_ids=None, labels=None, **kw):  # runs the backbone and its own head
        hidden = self.model(input_ids=input_ids).last_hidden_state
        return torch.nn.functional.cross_entropy(self.lm_head(hidden)[:, :-1].flatten(0, 1), labels[:, 1:].flatten())

    model.forward = my_forward.__get__(model)
    ids, labels = _batch(3)
    with pytest.warns(PatchBypassedWarning, match="my_forward") as record:
        model(input_ids=ids, labels=labels)
    assert "patch_sft" not in str(_bypassed(record)[0].message)


def test_accelerate_wrapper_over_the_patched_forward_does_not_warn():
    """accelerate (mixed precision) wraps the instance's forward, keeping _original_forward."""
    model = lt.patch(tiny_llama(seed=5)).train()
    original = model.forward
    model._original_forward = original
    model.forward = lambda *a, **k: original(*a, **k)
    ids, labels = _batch(4)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        model(input_ids=ids, labels=labels).loss.backward()
        model(input_ids=ids).logits.sum().backward()
        lt.causal_lm_loss(model, model.model(input_ids=ids).last_hidden_state, labels).backward()
    assert _bypassed(seen) == []


def test_patch_over_accelerate_wrapper_does_not_warn():
    """patch after accelerate wrapped the (unpatched) forward: _original_forward is the class's."""
    model = tiny_llama(seed=5).train()
    model._original_forward = model.forward
    wrapped = model.forward
    model.forward = lambda *a, **k: wrapped(*a, **k)
    lt.patch(model)
    ids, labels = _batch(4)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        model(input_ids=ids, labels=labels).loss.backward()
        lt.causal_lm_loss(model, model.model(input_ids=ids).last_hidden_state, labels).backward()
    assert _bypassed(seen) == []


def test_deepcopy_and_unpatch():
    model = lt.patch(tiny_llama(seed=6)).train()
    twin = copy.deepcopy(model)  # TRL's reference models, ZeRO-3 copies
    assert vars(twin.model)[BACKBONE_ATTR].owner is twin and vars(model.model)[BACKBONE_ATTR].owner is model
    trl_utils.add_fused_lm_head(twin)
    ids, labels = _batch(5)
    with pytest.warns(PatchBypassedWarning):
        twin(input_ids=ids, labels=labels, fused_lm_head=True)
    assert not vars(model.model)[BACKBONE_ATTR].warned  # the original's detector is its own
    lt.unpatch(model)
    assert BACKBONE_ATTR not in vars(model.model)
    assert pre_hook not in model.model._forward_pre_hooks.values()
    lt.patch(model)
    lt.patch(model)  # patching again: one hook
    assert list(model.model._forward_pre_hooks.values()).count(pre_hook) == 1


def test_patch_after_trl_head_is_refused_naming_the_fix():
    model = tiny_llama(seed=7)
    trl_utils.add_fused_lm_head(model)
    with pytest.raises(ValueError, match=r"TRL's fused LM head.*patch_sft\(trainer\).*patch_grpo\(trainer\)"):
        lt.patch(model)


# ---------------------------------------------------------------- a real SFTTrainer


def _sft(tmp_path, name, patch_model, patch_trainer):
    sft = pytest.importorskip("tests.test_integrations_trl_sft", reason="datasets / tokenizers not importable")
    from trl import SFTConfig, SFTTrainer

    from logitless.integrations.trl import patch_sft

    args = SFTConfig(output_dir=str(tmp_path / name), max_steps=2, per_device_train_batch_size=4,
                     learning_rate=1e-2, logging_steps=1, save_strategy="no", report_to="none", use_cpu=True,
                     bf16=False, fp16=False, seed=7, max_length=32, dataloader_num_workers=0)
    model = tiny_llama(seed=3, vocab=93)
    if patch_model:
        lt.patch(model)
    trainer = SFTTrainer(model=model, args=args, train_dataset=sft._dataset("completion"),
                         processing_class=sft._tokenizer())
    if patch_trainer:
        patch_sft(trainer)
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def test_sft_trainer_on_a_plainly_patched_model_warns(tmp_path, lce_counter):
    with pytest.warns(PatchBypassedWarning, match=r"patch_sft\(trainer\)") as record:
        _sft(tmp_path, "plain", patch_model=True, patch_trainer=False)
    assert len(_bypassed(record)) == 1
    assert lce_counter == []  # indeed TRL's own head computed the loss


def test_sft_trainer_patched_and_patch_sft_does_not_warn(tmp_path, lce_counter):
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        losses = _sft(tmp_path, "both", patch_model=True, patch_trainer=True)
    assert _bypassed(seen) == []
    assert len(lce_counter) >= 2 and len(losses) == 2
