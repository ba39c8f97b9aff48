"""logitless.integrations.llamafactory with LLaMA-Factory 0.9 itself: its ``run_exp`` trains a
tiny random Llama (saved with its own tokenizer; an alpaca SFT set and a pairwise DPO set made
here, nothing downloaded) for 3 steps on the CPU, SFT and DPO (sigmoid loss with a reference
model; and with ``ld_alpha``), once as LLaMA-Factory runs it and once through
``logitless.integrations.llamafactory.main`` (the ``python -m`` command): the same logged loss
(and DPO rewards) at every step, logitless' op called every step and LLaMA-Factory's logits
path not; bad options raise. LLaMA-Factory 0.9.5 imports ``torchaudio`` at import (for audio
inputs); torchaudio has no release for the CPU torch 2.13 this runs on, so where it is absent the
test stands in an empty module (text only). Where LLaMA-Factory is not installed the file skips:
scripts/test_frameworks.sh installs it in its own environment (docs/testing.md).
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import logging
import random
import sys
import types

import pytest

if importlib.util.find_spec("llamafactory") is None:
    pytest.skip("LLaMA-Factory is not installed (scripts/test_frameworks.sh llamafactory installs it)",
                allow_module_level=True)
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
if importlib.util.find_spec("torchaudio") is None:
    sys.modules["torchaudio"] = types.ModuleType("torchaudio")
    sys.modules["torchaudio"].__spec__ = importlib.machinery.ModuleSpec("torchaudio", None)

from llamafactory.train.dpo.trainer import CustomDPOTrainer  # noqa: E402
from llamafactory.train.sft.trainer import CustomSeq2SeqTrainer  # noqa: E402
from llamafactory.train.tuner import run_exp  # noqa: E402

import logitless.integrations.llamafactory as lt_lf  # noqa: E402
import logitless.transformers.loss as lt_loss  # noqa: E402
from logitless.integrations import _announce  # noqa: E402

STEPS = 3


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    """A tiny random Llama with a byte-level BPE tokenizer, an alpaca SFT set, a pairwise DPO set."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    root = tmp_path_factory.mktemp("llamafactory")
    rng = random.Random(0)
    words = "the cat sat on a mat dog ran far away and then slept in sun".split()

    def text(n):
        return " ".join(rng.choice(words) for _ in range(n))

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([text(30) for _ in range(50)], trainers.BpeTrainer(
        vocab_size=120, special_tokens=["<s>", "</s>", "<pad>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                                pad_token="<pad>")
    fast.save_pretrained(root / "model")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=len(fast), hidden_size=40, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, bos_token_id=0, eos_token_id=1,
                                   pad_token_id=2)
    transformers.LlamaForCausalLM(cfg).save_pretrained(root / "model")
    data = root / "data"
    data.mkdir()
    (data / "sft.json").write_text(json.dumps(
        [{"instruction": text(6), "input": "", "output": text(rng.randint(4, 12))} for _ in range(12)]))
    (data / "dpo.json").write_text(json.dumps(
        [{"instruction": text(6), "chosen": text(rng.randint(4, 10)), "rejected": text(rng.randint(4, 10))}
         for _ in range(12)]))
    (data / "dataset_info.json").write_text(json.dumps({
        "toy_sft": {"file_name": "sft.json"},
        "toy_dpo": {"file_name": "dpo.json", "ranking": True,
                    "columns": {"prompt": "instruction", "chosen": "chosen", "rejected": "rejected"}}}))
    return root


def _args(assets, tmp_path, stage: str, **extra) -> dict:
    return dict(model_name_or_path=str(assets / "model"), stage=stage, do_train=True, finetuning_type="full",
                dataset="toy_sft" if stage == "sft" else "toy_dpo", dataset_dir=str(assets / "data"),
                template="default", cutoff_len=64, overwrite_cache=True, output_dir=str(tmp_path / stage),
                per_device_train_batch_size=2, learning_rate=1e-3, max_steps=STEPS, logging_steps=1,
                report_to="none", save_strategy="no", use_cpu=True, seed=0, bf16=False, fp16=False,
                disable_tqdm=True, overwrite_output_dir=True, **extra)


class _Logs(transformers.TrainerCallback):
    def __init__(self):
        self.logs = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.logs.append(dict(logs))


@pytest.fixture
def unpatched(monkeypatch):
    """LLaMA-Factory's classes as they are now, restored after the test (patch is per process)."""
    monkeypatch.setattr(CustomSeq2SeqTrainer, "__init__", CustomSeq2SeqTrainer.__init__)
    monkeypatch.setattr(CustomDPOTrainer, "concatenated_forward", CustomDPOTrainer.concatenated_forward)
    monkeypatch.setattr(_announce, "_announced", set())


@pytest.fixture
def spies(monkeypatch):
    calls = {"lce": 0, "llp": 0}
    lce, llp = lt_loss.linear_cross_entropy, lt_lf.linear_log_probs

    def count_lce(*a, **k):
        calls["lce"] += 1
        return lce(*a, **k)

    def count_llp(*a, **k):
        calls["llp"] += 1
        return llp(*a, **k)

    monkeypatch.setattr(lt_loss, "linear_cross_entropy", count_lce)
    monkeypatch.setattr(lt_lf, "linear_log_probs", count_llp)
    return calls


def _run(args, ours: bool):
    """LLaMA-Factory's run_exp, or the ``python -m logitless.integrations.llamafactory`` entry."""
    logs = _Logs()
    (lt_lf.main if ours else run_exp)(args, callbacks=[logs])
    return logs.logs


@pytest.mark.parametrize("stage,extra", [("sft", {}), ("dpo", {"pref_beta": 0.1}),
                                         ("dpo", {"pref_beta": 0.1, "ld_alpha": 0.5})])
def test_run_exp_with_logitless_equals_llamafactory(stage, extra, assets, tmp_path, unpatched, spies, caplog):
    theirs = _run(_args(assets, tmp_path, stage, **extra), ours=False)
    assert spies == {"lce": 0, "llp": 0}
    with caplog.at_level(logging.INFO, logger="llamafactory.logitless"):
        ours = _run(_args(assets, tmp_path, stage, logitless_backend="torch", **extra), ours=True)
    assert sum("logitless is active (llamafactory)" in r.getMessage() for r in caplog.records) == 1
    if stage == "sft":
        assert spies["lce"] >= STEPS and spies["llp"] == 0
    else:   # policy and reference, chosen and rejected in one call each
        assert spies["llp"] >= 2 * STEPS and spies["lce"] == 0
    assert len(ours) == len(theirs) == STEPS
    keys = ["loss"] + ([] if stage == "sft" else ["rewards/chosen", "rewards/rejected", "logps/chosen",
                                                  "logits/chosen", "logits/rejected"])
    for a, b in zip(ours, theirs):
        for key in keys:
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-5), (key, ours, theirs)


def test_bad_options(unpatched):
    with pytest.raises(ValueError, match="logitless_memory_budget"):
        lt_lf.patch(memory_budget=-1)
    with pytest.raises(ValueError, match="logitless_backend"):
        lt_lf.patch(backend="cuda")
    with pytest.raises(ValueError, match="unknown option"):
        lt_lf.patch(z_loss=1e-4)
