"""logitless.integrations.trl.patch_grpo: a real TRL GRPOTrainer run (CPU, fp32, tiny
Llama, transformers' own sampling) whose policy and reference log-probs and entropies
come from logitless.linear_log_probs, with the same completions, per-step losses, KL and
entropy as TRL's own fused head."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

pytest.importorskip("trl", reason="trl (and its deps) not importable")
datasets = pytest.importorskip("datasets", reason="datasets not importable")
pytest.importorskip("tokenizers", reason="tokenizers not importable")

import transformers  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

import logitless.integrations.hf as hf  # noqa: E402
import logitless.integrations.trl as lt_trl  # noqa: E402
import logitless.transformers as lt  # noqa: E402
from logitless.transformers.bypass import PatchBypassedWarning  # noqa: E402

from .test_integrations_hf import tiny_llama  # noqa: E402
from .test_integrations_trl_sft import WORDS, _tokenizer  # noqa: E402

#: logged every step by GRPOTrainer, from the log-probs / entropies we serve
COMPARED = ("loss", "kl", "entropy")
#: logged on the steps that generate (num_iterations=2: every other step)
COMPARED_ON_GENERATION = ("reward", "reward_std", "completions/mean_length")


def _prompts():
    g = torch.Generator().manual_seed(1)
    rows = [{"prompt": " ".join(WORDS[i] for i in torch.randint(0, len(WORDS), (2 + k % 3,), generator=g).tolist())}
            for k in range(8)]
    return datasets.Dataset.from_list(rows)


def _saved_model(tmp_path):
    """A tiny random Llama saved to disk: GRPOTrainer builds the reference model from the path."""
    path = tmp_path / "tiny"
    if not path.exists():
        tiny_llama(seed=3, vocab=93).save_pretrained(path)
    return str(path)


def _train(tmp_path, patched, steps=3, prepare=None, peft=False, **cfg):
    seen = []

    def reward(prompts, completions, **kw):
        # deterministic, varies between completions (non-zero advantages)
        seen.extend(completions)
        return [float(sum(int(w[1:]) % 7 for w in c.split() if w[1:].isdigit())) for c in completions]

    args = GRPOConfig(output_dir=str(tmp_path / ("ours" if patched else "theirs")), max_steps=steps,
                      per_device_train_batch_size=4, num_generations=2, max_completion_length=6, beta=0.1,
                      temperature=0.9, num_iterations=2, learning_rate=1e-2, logging_steps=1, save_strategy="no",
                      report_to="none", use_cpu=True, bf16=False, fp16=False, seed=11, dataloader_num_workers=0,
                      disable_dropout=True, **cfg)
    model = transformers.AutoModelForCausalLM.from_pretrained(_saved_model(tmp_path))
    if prepare is not None:
        prepare(model)
    extra = {}
    if peft:
        peft_mod = pytest.importorskip("peft", reason="peft not importable")
        extra["peft_config"] = peft_mod.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                                   target_modules=["q_proj", "v_proj"], init_lora_weights="gaussian")
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=_prompts(),
                          processing_class=_tokenizer(), **extra)
    # beta > 0: the reference log-probs are computed (by the reference model, or with LoRA by the
    # policy with its adapters disabled)
    assert (trainer.ref_model is None) == peft
    if patched:
        lt_trl.patch_grpo(trainer)
    trainer.train()
    return [h for h in trainer.state.log_history if "loss" in h], seen


@pytest.fixture
def counter(monkeypatch):
    calls = []
    real = hf.linear_log_probs

    def counted(*a, **k):
        calls.append(k)
        return real(*a, **k)

    monkeypatch.setattr(hf, "linear_log_probs", counted)
    return calls


@pytest.mark.parametrize("cfg", [
    {},
    # the entropy's gradient in the loss (entropy bonus) and the high-entropy token mask
    {"entropy_coef": 0.05, "top_entropy_quantile": 0.5, "loss_type": "dr_grpo"},
], ids=["grpo", "entropy_bonus_dr_grpo"])
def test_grpo_trainer_uses_logitless_with_trl_numbers(tmp_path, counter, cfg):
    theirs, seen_theirs = _train(tmp_path, False, **cfg)
    assert counter == []
    ours, seen_ours = _train(tmp_path, True, **cfg)
    # policy (with entropy, the sampling temperature) and reference (no entropy) both went through logitless
    policy = [c for c in counter if c["entropy"]]
    ref = [c for c in counter if not c["entropy"]]
    assert len(policy) >= 3 and len(ref) >= 1
    assert all(c["temperature"] == pytest.approx(0.9) for c in counter)
    assert seen_ours == seen_theirs and len(seen_ours) >= 8  # same sampled completions
    assert len(ours) == len(theirs) == 3
    for o, t in zip(ours, theirs):
        for key in COMPARED:
            assert key in t and key in o, f"GRPOTrainer did not log {key!r}"
            assert o[key] == pytest.approx(t[key], rel=1e-5, abs=1e-5), key
        for key in COMPARED_ON_GENERATION:
            assert (key in o) == (key in t)
            if key in t:
                assert o[key] == pytest.approx(t[key], rel=1e-5, abs=1e-5), key
    assert sum("reward" in t for t in theirs) == 2  # two generation rounds (steps 1 and 3)
    assert all(math.isfinite(o["entropy"]) and o["entropy"] > 0 for o in ours)
    assert any(abs(o["kl"]) > 0 for o in ours)  # the policy moved away from the reference


def test_grpo_bf16_model_with_fp32_head(tmp_path, counter):
    """GRPOConfig(cast_lm_head_to_fp32=True) on a bf16 model: TRL casts the heads to fp32 and
    projects fp32 hidden states; patch_grpo does the same (mixed dtypes would be refused)."""
    kw = {"steps": 2, "prepare": lambda m: m.to(torch.bfloat16), "cast_lm_head_to_fp32": True}
    theirs, seen_theirs = _train(tmp_path, False, **kw)
    ours, seen_ours = _train(tmp_path, True, **kw)
    assert len([c for c in counter if c["entropy"]]) >= 2 and len([c for c in counter if not c["entropy"]]) >= 1
    assert seen_ours == seen_theirs
    for o, t in zip(ours, theirs):
        for key in COMPARED:
            assert o[key] == pytest.approx(t[key], rel=1e-4, abs=1e-4), key


def test_grpo_lora(tmp_path, counter):
    """PEFT LoRA: no reference model; the reference log-probs come from the policy with its
    adapters disabled, through the base model's (patched) head."""
    theirs, seen_theirs = _train(tmp_path, False, steps=2, peft=True)
    ours, seen_ours = _train(tmp_path, True, steps=2, peft=True)
    assert len(counter) >= 4 and all(c["entropy"] for c in counter)  # policy and adapter-free reference passes
    assert seen_ours == seen_theirs
    for o, t in zip(ours, theirs):
        for key in COMPARED:
            assert o[key] == pytest.approx(t[key], rel=1e-5, abs=1e-5), key
    assert any(abs(o["kl"]) > 0 for o in ours)


def test_grpo_on_a_plainly_patched_model_warns_and_patch_grpo_fixes_it(tmp_path, counter):
    """lt.patch(model) alone is bypassed by GRPOTrainer's fused head: warned, naming patch_grpo;
    with patch_grpo on top, logitless serves the log-probs (same numbers as TRL's) and nothing warns."""
    theirs, seen_theirs = _train(tmp_path, False, steps=2)
    with pytest.warns(PatchBypassedWarning, match=r"patch_grpo\(trainer\)"):
        plain, seen_plain = _train(tmp_path, False, steps=2, prepare=lt.patch)
    assert counter == [] and seen_plain == seen_theirs  # TRL's own head ran: logitless computed nothing
    assert [[p[k] for k in COMPARED] for p in plain] == [[t[k] for k in COMPARED] for t in theirs]
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        ours, seen_ours = _train(tmp_path, True, steps=2, prepare=lt.patch)
    assert [w for w in seen if issubclass(w.category, PatchBypassedWarning)] == []
    assert len(counter) >= 2 and seen_ours == seen_theirs
    for o, t in zip(ours, theirs):
        for key in COMPARED:
            assert o[key] == pytest.approx(t[key], rel=1e-5, abs=1e-5), key


def test_grpo_truncated_sampling_log_probs(tmp_path, counter):
    """A trainer sampling with top-k / top-p: the policy's log-probs come from the
    truncated distribution (the reference model's stay untruncated); finite losses."""
    ours, seen = _train(tmp_path, True, steps=2, top_k=7, top_p=0.9)
    policy = [c for c in counter if c["entropy"]]
    ref = [c for c in counter if not c["entropy"]]
    assert policy and ref
    assert all(c.get("top_k") == 7 and c.get("top_p") == pytest.approx(0.9) for c in policy)
    assert all("top_k" not in c and "top_p" not in c for c in ref)
    assert all(math.isfinite(o["loss"]) and math.isfinite(o["entropy"]) for o in ours)


def test_grpo_sampling_options_and_determinism():
    from types import SimpleNamespace

    args = SimpleNamespace(top_k=0, top_p=0.95, min_p=None, generation_kwargs={"top_k": 20, "min_p": 0.0},
                           full_determinism=True)
    trainer = SimpleNamespace(args=args, top_k=0, top_p=0.95, min_p=None)
    assert lt_trl.grpo_sampling_options(trainer) == {"top_k": 20, "top_p": 0.95}
    args.generation_kwargs = None
    assert lt_trl.grpo_sampling_options(trainer) == {"top_p": 0.95}
    trainer.top_p = 1.0
    assert lt_trl.grpo_sampling_options(trainer) == {}


def test_grpo_truncation_off_and_batch_invariant(tmp_path, counter, monkeypatch):
    real = lt_trl.patch_grpo
    monkeypatch.setattr(lt_trl, "patch_grpo", lambda tr: real(tr, truncated_log_probs=False, batch_invariant=True))
    ours, _ = _train(tmp_path, True, steps=1, top_k=7)
    assert counter and all("top_k" not in c and c.get("batch_invariant") is True for c in counter)
