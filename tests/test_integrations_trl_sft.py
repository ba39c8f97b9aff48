"""logitless.integrations.trl.patch_sft: a real TRL SFTTrainer run whose loss and token
accuracy come from logitless.linear_cross_entropy, with the same per-step losses and
metrics as TRL's own fused head."""

from __future__ import annotations

import warnings

import pytest
import torch

pytest.importorskip("trl", reason="trl (and its deps) not importable")
datasets = pytest.importorskip("datasets", reason="datasets not importable")
tokenizers = pytest.importorskip("tokenizers", reason="tokenizers not importable")

import transformers  # noqa: E402
from trl import SFTConfig, SFTTrainer  # noqa: E402

import logitless.integrations.trl as lt_trl  # noqa: E402
from logitless.ops.linear_cross_entropy import api as lce_api  # noqa: E402

from .test_integrations_hf import tiny_llama  # noqa: E402

WORDS = [f"w{i}" for i in range(90)]


def _tokenizer():
    vocab = {"<pad>": 0, "<unk>": 1, "<eos>": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
    model = tokenizers.models.WordLevel(vocab, unk_token="<unk>")
    tok = tokenizers.Tokenizer(model)
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>",
                                                eos_token="<eos>")


def _dataset(kind):
    g = torch.Generator().manual_seed(0)

    def text(n):
        return " ".join(WORDS[i] for i in torch.randint(0, len(WORDS), (n,), generator=g).tolist())

    if kind == "completion":
        rows = [{"prompt": text(3 + i % 4), "completion": " " + text(2 + i % 3)} for i in range(12)]
    else:
        rows = [{"text": text(4 + i % 7)} for i in range(12)]
    return datasets.Dataset.from_list(rows)


def _train(tmp_path, kind, patched, entropy=True, peft=False, **cfg):
    extra = {}
    if peft:
        peft_mod = pytest.importorskip("peft", reason="peft not importable")
        extra["peft_config"] = peft_mod.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                                   target_modules=["q_proj", "v_proj"], init_lora_weights="gaussian")
    args = SFTConfig(output_dir=str(tmp_path / ("ours" if patched else "theirs")), max_steps=3,
                     per_device_train_batch_size=4, learning_rate=1e-2, logging_steps=1, save_strategy="no",
                     report_to="none", use_cpu=True, bf16=False, fp16=False, seed=7, max_length=32,
                     dataloader_num_workers=0, **cfg)
    trainer = SFTTrainer(model=tiny_llama(seed=3, vocab=93), args=args, train_dataset=_dataset(kind),
                         processing_class=_tokenizer(), **extra)
    if patched:
        lt_trl.patch_sft(trainer, entropy=entropy)
    trainer.train()
    return [h for h in trainer.state.log_history if "loss" in h]


@pytest.fixture
def counter(monkeypatch):
    calls = []
    real = lce_api.linear_cross_entropy

    def counted(*a, **k):
        calls.append(k)
        return real(*a, **k)

    monkeypatch.setattr(lce_api, "linear_cross_entropy", counted)
    return calls


@pytest.mark.parametrize("kind,cfg", [
    ("completion", {}),                                   # completion-only loss (prompt/completion dataset)
    ("text", {"packing": True, "packing_strategy": "bfd"}),  # padding-free packing
    ("text", {"loss_type": "dft"}),
    ("text", {"peft": True}),                               # LoRA adapters: the base model's head is patched
], ids=["completion_only", "padding_free_packing", "dft", "lora"])
def test_sft_trainer_uses_logitless_with_trl_losses(tmp_path, kind, cfg, counter):
    theirs = _train(tmp_path, kind, False, **cfg)
    assert counter == []
    ours = _train(tmp_path, kind, True, **cfg)
    assert len(counter) >= 3 and all(c["return_stats"] and c["reduction"] == "none" for c in counter)
    assert len(ours) == len(theirs) == 3
    for o, t in zip(ours, theirs):
        assert o["loss"] == pytest.approx(t["loss"], rel=1e-5, abs=1e-5)
        assert o["mean_token_accuracy"] == pytest.approx(t["mean_token_accuracy"], abs=1e-6)
        assert o["entropy"] == pytest.approx(t["entropy"], rel=1e-5, abs=1e-5)
    assert len({o["loss"] for o in ours}) > 1  # the model trained


def test_sft_without_entropy_warns_once_and_logs_nan(tmp_path, counter, monkeypatch):
    monkeypatch.setattr(lt_trl, "_warned", False)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        ours = _train(tmp_path, "completion", True, entropy=False)
    mine = [w for w in seen if "entropy not computed" in str(w.message)]
    assert len(mine) == 1 and len(counter) >= 3
    assert all(o["entropy"] != o["entropy"] for o in ours)  # NaN, not a made-up number
    assert all(0.0 <= o["mean_token_accuracy"] <= 1.0 and o["loss"] > 0 for o in ours)


def test_is_top1_refuses_temperature():
    with pytest.raises(ValueError, match="temperature"):
        lt_trl.add_logitless_lm_head(tiny_llama(), temperature=0.7, is_top1=True)
