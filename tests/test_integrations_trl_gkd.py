"""logitless.integrations.trl.patch_gkd: TRL's distillation trainers (GKDTrainer,
DistillationTrainer) with the student/teacher loss from logitless.linear_jsd, same
per-step losses as TRL's own; gkd_loss against TRL's generalized_jsd_loss."""

from __future__ import annotations

import sys

import pytest
import torch

pytest.importorskip("trl", reason="trl (and its deps) not importable")
datasets = pytest.importorskip("datasets", reason="datasets not importable")
tokenizers = pytest.importorskip("tokenizers", reason="tokenizers not importable")

import transformers  # noqa: E402
from trl.experimental.gkd import GKDConfig, GKDTrainer  # noqa: E402

import logitless.integrations.trl as lt_trl  # noqa: E402
from logitless.ops.linear_jsd import api as jsd_api  # noqa: E402

from .helpers import one_gpu  # noqa: E402

WORDS = [f"w{i}" for i in range(90)]
VOCAB = 93


def tiny_llama(seed, hidden, layers=2, vocab=VOCAB, **kw):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                                   num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=64, pad_token_id=0, eos_token_id=2, bos_token_id=2,
                                   initializer_range=0.2, **kw)  # peaked distributions: losses far from 0
    return transformers.LlamaForCausalLM(cfg).float()


def _tokenizer(padding_side="right"):
    vocab = {"<pad>": 0, "<unk>": 1, "<eos>": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    out = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>",
                                               eos_token="<eos>", padding_side=padding_side)
    out.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    return out


def _text(g, n):
    return " ".join(WORDS[i] for i in torch.randint(0, len(WORDS), (n,), generator=g).tolist())


def _chat_dataset():
    g = torch.Generator().manual_seed(0)
    rows = [{"messages": [{"role": "user", "content": _text(g, 3 + i % 4)},
                          {"role": "assistant", "content": _text(g, 2 + i % 3)}]} for i in range(12)]
    return datasets.Dataset.from_list(rows)


@pytest.fixture
def counter(monkeypatch):
    calls = []
    real = jsd_api.linear_jsd

    def counted(*a, **k):
        calls.append(k)
        return real(*a, **k)

    monkeypatch.setattr(jsd_api, "linear_jsd", counted)
    return calls


# ---------------------------------------------------------------------------------------------
# gkd_loss == TRL's generalized_jsd_loss on the logits
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_gkd_loss_matches_trl_generalized_jsd_loss(beta, temperature):
    g = torch.Generator().manual_seed(int(beta * 10) + int(temperature * 100))
    b, t, hs, ht, v = 2, 5, 24, 40, 37  # different hidden sizes, V prime
    xs = torch.randn(b, t, hs, generator=g, dtype=torch.float64, requires_grad=True)
    ws = (torch.randn(v, hs, generator=g, dtype=torch.float64) * 0.3).requires_grad_()
    xt = torch.randn(b, t, ht, generator=g, dtype=torch.float64)
    wt = torch.randn(v, ht, generator=g, dtype=torch.float64) * 0.3
    labels = torch.randint(0, v, (b, t), generator=g)
    labels[0, :2] = -100
    labels[1, -1] = -100
    cases = [dict(reduction="batchmean"), dict(reduction="sum"), dict(reduction="mean"),
             dict(reduction="batchmean", num_items_in_batch=torch.tensor(11))]
    for kw in cases:
        for lab in (labels, None):
            ref = GKDTrainer.generalized_jsd_loss(xs @ ws.T, xt @ wt.T, labels=lab, beta=beta,
                                                  temperature=temperature, **kw)
            ours = lt_trl.gkd_loss(xs, ws, xt, wt, lab, beta=beta, temperature=temperature, **kw)
            assert ours.dtype == torch.float64
            torch.testing.assert_close(ours, ref, rtol=1e-10, atol=1e-12)
            gref = torch.autograd.grad(ref, (xs, ws))
            gours = torch.autograd.grad(ours, (xs, ws))
            for a, r in zip(gours, gref):
                torch.testing.assert_close(a, r, rtol=1e-8, atol=1e-11)


def test_gkd_loss_float32_one_token_and_all_ignored():
    g = torch.Generator().manual_seed(5)
    xs, ws = torch.randn(1, 1, 16, generator=g), torch.randn(11, 16, generator=g)
    xt, wt = torch.randn(1, 1, 20, generator=g), torch.randn(11, 20, generator=g)
    lab = torch.tensor([[4]])
    ref = GKDTrainer.generalized_jsd_loss(xs @ ws.T, xt @ wt.T, labels=lab, beta=0.3)
    torch.testing.assert_close(lt_trl.gkd_loss(xs, ws, xt, wt, lab, beta=0.3), ref, rtol=1e-5, atol=1e-6)
    none = torch.full_like(lab, -100)  # TRL: 0 / clamp(0, min=1) = 0
    assert lt_trl.gkd_loss(xs, ws, xt, wt, none).item() == 0.0
    empty = lt_trl.gkd_loss(xs[:0], ws, xt[:0], wt, lab[:0])
    assert empty.item() == 0.0 == GKDTrainer.generalized_jsd_loss(xs[:0] @ ws.T, xt[:0] @ wt.T, lab[:0]).item()


@pytest.mark.parametrize("beta", [0.0, 0.6])
def test_gkd_loss_triton_backend(beta):
    """The Triton kernels (CUDA, or the CPU interpreter: tiny) behind gkd_loss, softcaps on."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(9)
    xs = torch.randn(1, 3, 24, generator=g).to(dev).requires_grad_()
    ws, xt, wt = (torch.randn(s, generator=g).to(dev) for s in ((37, 24), (1, 3, 40), (37, 40)))
    lab = torch.tensor([[-100, 5, 36]], device=dev)
    caps = dict(student_softcap=5.0, teacher_softcap=7.0)
    ours = lt_trl.gkd_loss(xs, ws, xt, wt, lab, beta=beta, temperature=0.7, backend="triton", **caps)
    cap = lambda z, s: s * torch.tanh(z / s)  # noqa: E731
    xd = xs.detach().double().requires_grad_()
    ref = GKDTrainer.generalized_jsd_loss(cap(xd @ ws.double().T, 5.0), cap(xt.double() @ wt.double().T, 7.0),
                                          labels=lab, beta=beta, temperature=0.7)
    torch.testing.assert_close(ours.double(), ref, rtol=2e-5, atol=1e-6)
    (g_ours,), (g_ref,) = torch.autograd.grad(ours, (xs,)), torch.autograd.grad(ref, (xd,))
    torch.testing.assert_close(g_ours.double(), g_ref, rtol=1e-4, atol=1e-6)


def test_gkd_loss_refuses_what_it_cannot_do():
    xs, ws, xt, wt = torch.randn(2, 3, 8), torch.randn(7, 8), torch.randn(2, 3, 12), torch.randn(7, 12)
    with pytest.raises(ValueError, match="reduction"):
        lt_trl.gkd_loss(xs, ws, xt, wt, reduction="none")
    with pytest.raises(ValueError, match="vocabularies"):
        lt_trl.gkd_loss(xs, ws, xt, torch.randn(8, 12))
    with pytest.raises(ValueError, match="beta"):
        lt_trl.gkd_loss(xs, ws, xt, wt, beta=1.5)
    with pytest.raises(ValueError, match="temperature"):
        lt_trl.gkd_loss(xs, ws, xt, wt, temperature=0.0)


# ---------------------------------------------------------------------------------------------
# GKDTrainer.train(): TRL's loss vs patched
# ---------------------------------------------------------------------------------------------

def _gkd_trainer(tmp_path, name, peft=False, teacher_kw=None, cuda=False, bf16=False, **cfg):
    extra = {}
    if peft:
        peft_mod = pytest.importorskip("peft", reason="peft not importable")
        extra["peft_config"] = peft_mod.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                                   target_modules=["q_proj", "v_proj"], init_lora_weights="gaussian")
    cfg = {"lmbda": 0.0, **cfg}
    args = GKDConfig(output_dir=str(tmp_path / name), max_steps=3, per_device_train_batch_size=4,
                     learning_rate=1e-2, logging_steps=1, save_strategy="no", report_to="none", use_cpu=not cuda,
                     bf16=bf16, fp16=False, seed=7, max_length=32, max_new_tokens=4, dataloader_num_workers=0,
                     **cfg)
    one_gpu(args)
    return GKDTrainer(model=tiny_llama(3, 32), teacher_model=tiny_llama(4, 48, layers=1, **(teacher_kw or {})),
                      args=args, train_dataset=_chat_dataset(), processing_class=_tokenizer(), **extra)


def _gkd_steps(tmp_path, patched, **cfg):  # cfg: GKDConfig fields, peft=, cuda=
    """The trainer's log of each of the 3 steps (loss, grad_norm, ...)."""
    trainer = _gkd_trainer(tmp_path, "ours" if patched else "theirs", **cfg)
    if patched:
        lt_trl.patch_gkd(trainer)
    trainer.train()
    return [h for h in trainer.state.log_history if "loss" in h]


def _train_gkd(tmp_path, patched, **cfg):
    return [h["loss"] for h in _gkd_steps(tmp_path, patched, **cfg)]


def test_gkd_evaluate_same_loss(tmp_path, counter):
    theirs = _gkd_trainer(tmp_path, "theirs").evaluate(eval_dataset=_chat_dataset())["eval_loss"]
    trainer = _gkd_trainer(tmp_path, "ours")
    lt_trl.patch_gkd(trainer)
    ours = trainer.evaluate(eval_dataset=_chat_dataset())["eval_loss"]  # compute_loss(return_outputs=True)
    assert len(counter) >= 1 and ours == pytest.approx(theirs, rel=1e-5, abs=1e-7) and ours > 0.01


@pytest.mark.parametrize("cfg", [
    {"beta": 0.5, "gradient_accumulation_steps": 2},  # off-policy (dataset completions), generalized JSD
    {"beta": 0.0, "lmbda": 1.0},           # on-policy: student generations (TRL's), forward KL
    {"beta": 1.0, "seq_kd": True},         # teacher generations (sequence-level KD), reverse KL
    {"beta": 0.3, "peft": True},           # LoRA student
], ids=["jsd_offpolicy", "fkl_onpolicy", "rkl_seqkd", "lora"])
def test_gkd_trainer_same_losses_as_trl(tmp_path, cfg, counter):
    theirs = _train_gkd(tmp_path, False, **cfg)
    assert counter == []
    ours = _train_gkd(tmp_path, True, **cfg)
    assert len(counter) >= 3 and all(c["reduction"] == "none" for c in counter)
    assert len(ours) == len(theirs) == 3
    for o, t in zip(ours, theirs):
        assert o == pytest.approx(t, rel=1e-5, abs=1e-7)
    assert len(set(ours)) > 1 and all(o > 0.01 for o in ours)


def test_gkd_trainer_bf16_autocast(tmp_path, counter):
    """accelerate's bf16 autocast: TRL's loss on bf16 logits, ours on bf16 GEMMs with fp32
    statistics; close, not equal. The first step (the same weights) within rel 2e-3 of TRL's;
    every step, both within bf16's rounding (rel 2**-8) of the fp32 run's loss. Later steps
    follow two different bf16 gradients, so ours and TRL's part by a CPU-dependent amount of
    that order (rel 2.2e-3 at step 3 on an AMD EPYC, under 2e-3 on another machine)."""
    exact = _train_gkd(tmp_path / "fp32", False)
    theirs = _train_gkd(tmp_path, False, bf16=True)
    ours = _train_gkd(tmp_path, True, bf16=True)
    assert len(counter) >= 3 and len(ours) == len(theirs) == len(exact) == 3
    assert ours[0] == pytest.approx(theirs[0], rel=2e-3) and ours != theirs
    for o, t, e in zip(ours, theirs, exact):
        assert o == pytest.approx(e, rel=2 ** -8) and t == pytest.approx(e, rel=2 ** -8)


def test_patch_gkd_refuses_unsupported(tmp_path):
    with pytest.raises(ValueError, match="logit"):  # Cohere-style logit scaling of the teacher
        lt_trl.patch_gkd(_gkd_trainer(tmp_path, "scaled", teacher_kw={"logits_scaling": 2.0}))
    trainer = _gkd_trainer(tmp_path, "plain")
    trainer.teacher_model = tiny_llama(4, 48, layers=1, vocab=VOCAB + 2)  # TRL checks only at construction
    with pytest.raises(ValueError, match="vocabularies"):
        lt_trl.patch_gkd(trainer)
    with pytest.raises(ValueError, match="GKDTrainer or DistillationTrainer"):
        lt_trl.patch_gkd(object())

    class Custom(GKDTrainer):
        def compute_loss(self, *a, **k):
            return super().compute_loss(*a, **k)

    trainer.__class__ = Custom
    with pytest.raises(ValueError, match="overrides"):
        lt_trl.patch_gkd(trainer)


# ---------------------------------------------------------------------------------------------
# DistillationTrainer.train() (TRL's maintained, always on-policy trainer): TRL's loss vs patched
# ---------------------------------------------------------------------------------------------

def _prompt_dataset():
    g = torch.Generator().manual_seed(1)
    return datasets.Dataset.from_list([{"prompt": _text(g, 2 + i % 4)} for i in range(12)])


def _train_distillation(tmp_path, patched, entropy=True, cuda=False, **cfg):
    from trl import DistillationConfig, DistillationTrainer
    args = DistillationConfig(output_dir=str(tmp_path / ("ours" if patched else "theirs")), max_steps=3,
                              per_device_train_batch_size=4, learning_rate=1e-2, logging_steps=1,
                              save_strategy="no", report_to="none", use_cpu=not cuda, bf16=False, fp16=False,
                              seed=7, max_completion_length=5, dataloader_num_workers=0, **cfg)
    one_gpu(args)
    student = tiny_llama(3, 32)
    with torch.no_grad():  # EOS often: completions of different lengths, so the completion mask matters
        student.lm_head.weight[2] *= 6
    trainer = DistillationTrainer(model=student, teacher_model=tiny_llama(4, 48, layers=1), args=args,
                                  train_dataset=_prompt_dataset(), processing_class=_tokenizer("left"))
    if patched:
        lt_trl.patch_gkd(trainer, entropy=entropy)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert any(h["completions/min_length"] < h["completions/max_length"] for h in logs)  # the mask has zeros
    return logs


@pytest.mark.parametrize("cfg", [{"beta": 1.0}, {"beta": 0.4, "temperature": 0.7}, {"beta": 0.0}],
                         ids=["rkl", "jsd_t07", "fkl"])
def test_distillation_trainer_same_losses_as_trl(tmp_path, cfg, counter):
    theirs = _train_distillation(tmp_path, False, **cfg)
    assert counter == []
    ours = _train_distillation(tmp_path, True, **cfg)
    assert len(counter) >= 3 and all(c["reduction"] == "none" for c in counter)
    assert len(ours) == len(theirs) == 3
    for o, t in zip(ours, theirs):
        assert o["loss"] == pytest.approx(t["loss"], rel=1e-5, abs=1e-7)
        assert o["entropy"] == pytest.approx(t["entropy"], rel=1e-5, abs=1e-6)
    assert len({o["loss"] for o in ours}) > 1 and all(o["loss"] > 0.01 for o in ours)


def test_distillation_without_entropy_drops_the_metric(tmp_path, counter):
    ours = _train_distillation(tmp_path, True, entropy=False)
    assert len(counter) >= 3 and len(ours) == 3
    assert all(o.get("entropy") is None and o["loss"] > 0 for o in ours)


# ---------------------------------------------------------------------------------------------
# CUDA (Triton kernels): the same comparisons in fp32 (TF32 off, torch's default)
# ---------------------------------------------------------------------------------------------

cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (Triton backend)")


@cuda_only
@pytest.mark.parametrize("cfg", [{"beta": 0.5}, {"beta": 0.0, "lmbda": 1.0}], ids=["jsd", "fkl_onpolicy"])
def test_gkd_trainer_cuda(tmp_path, cfg, counter):
    theirs = _train_gkd(tmp_path, False, cuda=True, **cfg)
    ours = _train_gkd(tmp_path, True, cuda=True, **cfg)
    assert len(counter) >= 3 and len(ours) == len(theirs) == 3
    for o, t in zip(ours, theirs):
        assert o == pytest.approx(t, rel=1e-4, abs=1e-6)


@cuda_only
@pytest.mark.parametrize("cfg", [{"beta": 0.0}, {"beta": 1.0, "seq_kd": True}], ids=["fkl", "rkl_seqkd"])
def test_gkd_trainer_cuda_bf16_fused_kl_forward(tmp_path, cfg, counter):
    """bf16 autocast at a KL limit: every training step's forward takes the fused
    KL-limit kernel (Triton backend, no fp32 logit chunks). The first step's loss and
    gradient norm stay within bf16 GEMM rounding of TRL's on bf16 logits; later steps
    within 1% (two updates at lr 1e-2 amplify the bf16 differences: H100, step 3 of the
    sequence-level run moved 4e-3)."""
    from unittest import mock

    from logitless.ops.linear_jsd import triton_backend
    from logitless.planning.overrides import override

    theirs_log = _gkd_steps(tmp_path, False, cuda=True, bf16=True, **cfg)
    with override(jsd_fused_forward=True), \
            mock.patch.object(triton_backend, "_forward_fused", wraps=triton_backend._forward_fused) as fused:
        ours_log = _gkd_steps(tmp_path, True, cuda=True, bf16=True, **cfg)
    assert len(counter) >= 3 and fused.call_count >= 3
    assert all(c.args[0].dtype == torch.bfloat16 for c in fused.call_args_list)
    assert len(ours_log) == len(theirs_log) == 3
    ours, theirs = [h["loss"] for h in ours_log], [h["loss"] for h in theirs_log]
    assert ours[0] == pytest.approx(theirs[0], rel=2e-3)
    assert float(ours_log[0]["grad_norm"]) == pytest.approx(float(theirs_log[0]["grad_norm"]), rel=5e-3)
    for o, t in zip(ours, theirs):
        assert o == pytest.approx(t, rel=1e-2)
    assert len(set(ours)) > 1 and all(o > 0.01 for o in ours)


@cuda_only
def test_distillation_trainer_cuda(tmp_path, counter):
    theirs = _train_distillation(tmp_path, False, cuda=True, beta=0.4, temperature=0.7)
    ours = _train_distillation(tmp_path, True, cuda=True, beta=0.4, temperature=0.7)
    assert len(counter) >= 3 and len(ours) == len(theirs) == 3
    for o, t in zip(ours, theirs):
        assert o["loss"] == pytest.approx(t["loss"], rel=1e-4, abs=1e-6)
        assert o["entropy"] == pytest.approx(t["entropy"], rel=1e-4, abs=1e-5)


@pytest.mark.parametrize("kind", ["gkd", "distillation"])
def test_patched_student_no_bypass_warning(tmp_path, kind, counter, monkeypatch):
    """lt.patch(student) + patch_gkd: logitless runs the backbone itself, so the bypass
    detector of patch() stays silent (an error here), and the losses are TRL's."""
    import warnings

    import logitless.transformers as lt
    from logitless.transformers.bypass import PatchBypassedWarning

    theirs = (_train_gkd(tmp_path / "a", False) if kind == "gkd"
              else [h["loss"] for h in _train_distillation(tmp_path / "a", False)])
    real = tiny_llama
    monkeypatch.setattr(sys.modules[__name__], "tiny_llama",
                        lambda seed, hidden, **kw: lt.patch(real(seed, hidden, **kw)) if seed == 3
                        else real(seed, hidden, **kw))
    with warnings.catch_warnings():
        warnings.simplefilter("error", PatchBypassedWarning)
        ours = (_train_gkd(tmp_path / "b", True) if kind == "gkd"
                else [h["loss"] for h in _train_distillation(tmp_path / "b", True)])
    assert len(counter) >= 3
    torch.testing.assert_close(torch.tensor(ours), torch.tensor(theirs), rtol=1e-5, atol=1e-7)
