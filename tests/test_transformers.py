"""logitless.transformers.patch: the loss and gradients of transformers' own models, without logits.

Tiny random models (2 layers, hidden 64, vocab 1000, fp32) of every supported family,
built from configs offline, compared against the same model unpatched.
"""

from __future__ import annotations

import contextlib
import copy
import subprocess
import sys

import pytest
import torch
import transformers  # noqa: E402  (in the test extra: a missing install fails, never skips)

import logitless.transformers as lt  # noqa: E402
from logitless.transformers import loss as lt_loss  # noqa: E402
from logitless.transformers import source_check  # noqa: E402

from .conftest import DEVICE  # noqa: E402

V, H = 1000, 64
COMMON = dict(vocab_size=V, hidden_size=H, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=2)

#: class name -> (config class, config kwargs). Options that matter are set so they bite:
#: a small soft-cap, non-power-of-two scales, a bias on Phi's head, untied and tied heads.
FAMILIES = {
    "LlamaForCausalLM": ("LlamaConfig", dict(COMMON, tie_word_embeddings=True)),
    "MistralForCausalLM": ("MistralConfig", dict(COMMON, tie_word_embeddings=False)),
    "Qwen2ForCausalLM": ("Qwen2Config", dict(COMMON, tie_word_embeddings=True)),
    "Qwen3ForCausalLM": ("Qwen3Config", dict(COMMON, head_dim=16, tie_word_embeddings=False)),
    "GemmaForCausalLM": ("GemmaConfig", dict(COMMON, head_dim=16)),
    "Gemma2ForCausalLM": ("Gemma2Config", dict(COMMON, head_dim=16, final_logit_softcapping=0.7,
                                               attn_logit_softcapping=50.0)),
    "Gemma3ForCausalLM": ("Gemma3TextConfig", dict(COMMON, head_dim=16, final_logit_softcapping=0.5)),
    "Phi3ForCausalLM": ("Phi3Config", dict(COMMON, resid_pdrop=0.0, embd_pdrop=0.0)),
    "PhiForCausalLM": ("PhiConfig", dict(COMMON, resid_pdrop=0.0, embd_pdrop=0.0)),
    "Olmo2ForCausalLM": ("Olmo2Config", dict(COMMON)),
    "GPT2LMHeadModel": ("GPT2Config", dict(vocab_size=V, n_embd=H, n_layer=2, n_head=4, n_positions=64,
                                           resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                           bos_token_id=1, eos_token_id=2, pad_token_id=0)),
    "CohereForCausalLM": ("CohereConfig", dict(COMMON, logit_scale=0.3)),
    "GraniteForCausalLM": ("GraniteConfig", dict(COMMON, logits_scaling=3.0, tie_word_embeddings=False)),
}


def tiny(name, seed=0, **overrides):
    cfg_name, kwargs = FAMILIES[name]
    cfg = getattr(transformers, cfg_name)(**{**kwargs, **overrides})
    torch.manual_seed(seed)
    return getattr(transformers, name)(cfg).to(DEVICE).train()


def batch(seed=1, b=2, t=13):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, V, (b, t), generator=g)
    labels = ids.clone()
    labels[0, :4] = -100  # a prompt
    labels[-1, -3:] = -100  # padding
    mask = torch.ones(b, t, dtype=torch.long)
    mask[-1, -3:] = 0
    return ids.to(DEVICE), labels.to(DEVICE), mask.to(DEVICE)


def loss_and_grads(model, **inputs):
    model.zero_grad(set_to_none=True)
    out = model(**inputs)
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return out, grads


def assert_same(out, grads, ref_out, ref_grads, tol=1e-5):
    assert out.logits is None
    assert ref_out.logits is not None
    torch.testing.assert_close(out.loss, ref_out.loss, rtol=tol, atol=tol)
    assert grads.keys() == ref_grads.keys()
    for n in ref_grads:
        torch.testing.assert_close(grads[n], ref_grads[n], rtol=tol, atol=tol, msg=lambda m: f"{n}: {m}")


# ---------------------------------------------------------------------- every family


def test_import_logitless_does_not_import_transformers():
    code = "import sys, logitless; assert 'transformers' not in sys.modules, 'transformers imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_family_matches_unpatched(name):
    """Loss and every parameter's gradient, mean and num_items_in_batch, equal unpatched to 1e-5."""
    assert name in lt.SUPPORTED
    model = tiny(name)
    ids, labels, mask = batch()
    n_items = torch.tensor(int((labels[:, 1:] != -100).sum()) + 5, device=DEVICE)  # e.g. from other micro-batches
    cases = [dict(), dict(num_items_in_batch=n_items)]
    refs = [loss_and_grads(model, input_ids=ids, attention_mask=mask, labels=labels, **c) for c in cases]
    assert lt.patch(model) is model and lt.is_patched(model)
    for c, (ref_out, ref_grads) in zip(cases, refs):
        out, grads = loss_and_grads(model, input_ids=ids, attention_mask=mask, labels=labels, **c)
        assert type(out) is type(ref_out)
        assert_same(out, grads, ref_out, ref_grads)
        assert (out.past_key_values is None) == (ref_out.past_key_values is None)


def test_family_list_contains_the_popular_ones():
    # (that every supported class is tested: tests/test_transformers_families.py)
    for required in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                     "Gemma2ForCausalLM", "Gemma3ForCausalLM", "Phi3ForCausalLM", "GPT2LMHeadModel",
                     "CohereForCausalLM"):
        assert required in lt.SUPPORTED


@pytest.mark.parametrize("name", ["CohereForCausalLM", "GraniteForCausalLM"])
def test_power_of_two_scale_is_exact(name):
    """Cohere's default logit_scale 1/16 (and a Granite scaling of 8): scaling x is exact."""
    extra = dict(logit_scale=0.0625) if name == "CohereForCausalLM" else dict(logits_scaling=8.0)
    model = tiny(name, **extra)
    ids, labels, mask = batch()
    ref_out, ref_grads = loss_and_grads(model, input_ids=ids, attention_mask=mask, labels=labels)
    lt.patch(model, backend="torch")
    out, grads = loss_and_grads(model, input_ids=ids, attention_mask=mask, labels=labels)
    assert_same(out, grads, ref_out, ref_grads)


# ---------------------------------------------------------------------- forward arguments


def test_shift_labels_logits_to_keep_hidden_states_and_tuples():
    model = tiny("Qwen3ForCausalLM")
    ids, labels, mask = batch()
    shift = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=-100)
    shift[1, 2] = -100
    k = 5
    cases = [
        dict(labels=labels, shift_labels=shift),  # the caller's shift_labels win, as in transformers
        dict(labels=labels[:, -k:], logits_to_keep=k),  # labels of the kept positions only
        dict(labels=labels, output_hidden_states=True, use_cache=False),
        dict(labels=labels.masked_fill(labels == -100, 7), ignore_index=7, num_items_in_batch=11),
    ]
    refs = [loss_and_grads(model, input_ids=ids, attention_mask=mask, **c) for c in cases]
    ref_tuple = model(input_ids=ids, labels=labels, return_dict=False)
    lt.patch(model)
    for c, (ref_out, ref_grads) in zip(cases, refs):
        out, grads = loss_and_grads(model, input_ids=ids, attention_mask=mask, **c)
        assert_same(out, grads, ref_out, ref_grads)
        if c.get("output_hidden_states"):
            assert len(out.hidden_states) == len(ref_out.hidden_states)
            for a, b in zip(out.hidden_states, ref_out.hidden_states):
                torch.testing.assert_close(a, b)
    # return_dict=False: transformers' tuple without the logits (None fields are dropped)
    tup = model(ids, labels=labels, return_dict=False)
    assert isinstance(tup, tuple) and len(tup) == len(ref_tuple) - 1
    torch.testing.assert_close(tup[0], ref_tuple[0], rtol=1e-5, atol=1e-5)
    # labels that do not match the kept positions: an error, as transformers gives
    with pytest.raises(ValueError, match="logits_to_keep"):
        model(input_ids=ids, labels=labels, logits_to_keep=k)


def test_without_labels_or_in_eval_the_original_forward_runs():
    model = tiny("Gemma2ForCausalLM")
    ids, labels, mask = batch()
    ref = model(input_ids=ids, attention_mask=mask, labels=labels)
    lt.patch(model)
    out = model(input_ids=ids, attention_mask=mask)
    assert out.loss is None
    torch.testing.assert_close(out.logits, ref.logits)
    model.eval()
    out = model(input_ids=ids, attention_mask=mask, labels=labels)  # Trainer.evaluate wants logits
    torch.testing.assert_close(out.logits, ref.logits)
    torch.testing.assert_close(out.loss, ref.loss)


@pytest.mark.parametrize("name", ["LlamaForCausalLM", "GPT2LMHeadModel", "Gemma3ForCausalLM"])
def test_generation_unchanged(name):
    model = tiny(name)
    ids, _, _ = batch(b=1, t=6)
    kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    outs = []
    for mode in ("train", "eval"):
        getattr(model, mode)()
        before = model.generate(ids, **kw)
        lt.patch(model)
        after = model.generate(ids, **kw)
        lt.unpatch(model)
        assert torch.equal(before, after)
        outs.append(after)
    assert outs[0].shape[1] == ids.shape[1] + 8


def test_unpatch_restores():
    model = tiny("LlamaForCausalLM")
    ids, labels, _ = batch()
    assert not lt.is_patched(model)
    lt.patch(model)
    lt.patch(model, memory_budget=2**20)  # patching again replaces the options
    assert model(input_ids=ids, labels=labels).logits is None
    assert lt.unpatch(model) is model
    assert not lt.is_patched(model) and "forward" not in vars(model)
    assert model.forward.__func__ is type(model).forward
    out = model(input_ids=ids, labels=labels)
    assert out.logits is not None and out.logits.shape == (2, 13, V)
    assert "forward" not in vars(model.lm_head)
    lt.unpatch(model)  # no-op


# ---------------------------------------------------------------------- refusals


def test_unsupported_models_are_refused():
    cfg = transformers.BloomConfig(vocab_size=V, hidden_size=H, n_layer=1, n_head=4)
    with pytest.raises(ValueError, match=r"BloomForCausalLM is not a supported model class"):
        lt.patch(transformers.BloomForCausalLM(cfg))

    class MyLlama(transformers.LlamaForCausalLM):
        pass

    with pytest.raises(ValueError, match="MyLlama is not a supported"):
        lt.patch(MyLlama(transformers.LlamaConfig(**COMMON)))
    MyLlama.__name__ = "LlamaForCausalLM"  # same name, forward maybe changed: refused by module
    with pytest.raises(ValueError, match="not in transformers.models.llama.modeling_llama"):
        lt.patch(MyLlama(transformers.LlamaConfig(**COMMON)))

    model = tiny("LlamaForCausalLM")
    model.forward = lambda *a, **k: None  # another library's instance patch (liger's style)
    with pytest.raises(ValueError, match="already replaced on this instance"):
        lt.patch(model)

    model = tiny("LlamaForCausalLM")
    model.loss_function = lambda *a, **k: 0
    with pytest.raises(ValueError, match="custom loss_function"):
        lt.patch(model)
    with pytest.raises(ValueError, match="unknown option"):
        lt.patch(tiny("LlamaForCausalLM"), reduction="sum")
    with pytest.raises(ValueError, match="z_loss"):
        lt.patch(tiny("LlamaForCausalLM"), z_loss=-1.0)
    with pytest.raises(ValueError, match="Linear is not a supported"):
        lt.patch(torch.nn.Linear(3, 4))
    with pytest.raises(ValueError, match="not a torch.nn.Module"):
        lt.patch("LlamaForCausalLM")


def test_head_transform_source_check_rejects_unknown_transforms(monkeypatch):
    """A supported name whose forward transforms the logits differently is refused."""
    from transformers.models.granite.modeling_granite import GraniteForCausalLM

    monkeypatch.setitem(lt.SUPPORTED, "GraniteForCausalLM", lt.SUPPORTED["LlamaForCausalLM"].__class__("granite"))
    source_check.check_forward_source.cache_clear()
    try:
        reason = source_check.check_forward_source(GraniteForCausalLM)
        assert reason and "transforms the logits" in reason
        with pytest.raises(ValueError, match="transforms the logits"):
            lt.patch(tiny("GraniteForCausalLM"))
    finally:
        source_check.check_forward_source.cache_clear()


@pytest.mark.filterwarnings("ignore:Model has `tie_word_embeddings=True`")
def test_peft_lora(tmp_path):
    import peft
    base = tiny("LlamaForCausalLM")
    ids, labels, mask = batch()
    for target in ("peft", "inner"):
        model = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"],
                                                                           lora_dropout=0.0, init_lora_weights=False))
        model.train()
        ref_out, ref_grads = loss_and_grads(model, input_ids=ids, attention_mask=mask, labels=labels)
        assert ref_grads and all("lora_" in n for n in ref_grads)  # the head is frozen
        lt.patch(model if target == "peft" else model.get_base_model())
        assert lt.is_patched(model)
        out, grads = loss_and_grads(model, input_ids=ids, attention_mask=mask, labels=labels)
        assert_same(out, grads, ref_out, ref_grads)
        lt.unpatch(model)
        assert not lt.is_patched(model)
    # (LoRA on the head itself: tests/test_transformers_integration.py)


def test_gradient_checkpointing():
    model = tiny("MistralForCausalLM")
    model.gradient_checkpointing_enable()
    ids, labels, mask = batch()
    ref_out, ref_grads = loss_and_grads(model, input_ids=ids, attention_mask=mask, labels=labels)
    lt.patch(model)
    out, grads = loss_and_grads(model, input_ids=ids, attention_mask=mask, labels=labels)
    assert_same(out, grads, ref_out, ref_grads)


@pytest.mark.parametrize("backward_in_autocast", [False, True], ids=["backward-outside", "backward-inside"])
def test_autocast_fp32_master_weights(backward_in_autocast):
    """Under autocast the head is used as F.linear would: bf16 GEMMs, fp32 loss and fp32 grads.

    Needs autocast support inside linear_cross_entropy (F.linear semantics). The backward
    is called outside the autocast region (as Trainer/accelerate do) or inside it (also
    common in user loops; torch's own ops support both).
    """
    from torch.utils._python_dispatch import TorchDispatchMode

    class VocabGemmDtypes(TorchDispatchMode):  # dtypes of x and W that reach the fused op
        def __init__(self):
            super().__init__()
            self.dtypes = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.namespace == "logitless" and func.name().endswith("lce_forward"):
                self.dtypes.update({args[0].dtype, args[1].dtype})  # x, weight
            return func(*args, **(kwargs or {}))

    dev = DEVICE.type

    def run(model, spy=None):
        model.zero_grad(set_to_none=True)
        with contextlib.ExitStack() as stack:
            if spy is not None:
                stack.enter_context(spy)
            with torch.autocast(dev, dtype=torch.bfloat16):
                out = model(input_ids=ids, attention_mask=mask, labels=labels)
                if backward_in_autocast:
                    out.loss.backward()
            if not backward_in_autocast:
                out.loss.backward()
        return out, {n: p.grad.clone() for n, p in model.named_parameters()}

    model = tiny("LlamaForCausalLM")
    ids, labels, mask = batch()
    ref_out, ref_grads = run(model)
    lt.patch(model)
    spy = VocabGemmDtypes()
    out, grads = run(model, spy)
    assert out.loss.dtype == torch.float32 and out.logits is None
    torch.testing.assert_close(out.loss, ref_out.loss.float(), rtol=2e-2, atol=2e-2)
    for n in grads:
        assert grads[n].dtype == torch.float32
        rel = (grads[n] - ref_grads[n]).norm() / ref_grads[n].norm()
        assert rel < 5e-2, f"{n}: relative gradient difference {rel:.3g}"
    # The op's GEMM operands are the autocast dtype, as F.linear's would be (the products
    # of bf16 values are then accumulated in fp32 by every backend).
    assert spy.dtypes == {torch.bfloat16}, f"the fused op got {spy.dtypes}, not bf16 as F.linear would"


# ---------------------------------------------------------------------- training


def _adamw_curve(model, steps, data):
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for step in range(steps):
        ids, labels, mask = data[step % len(data)]
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def test_training_curve_matches_unpatched():
    """30 AdamW steps in fp32: the loss curve of the patched model equals transformers' to 1e-4."""
    data = [batch(seed=s, b=4, t=16) for s in range(6)]
    ref = _adamw_curve(tiny("Qwen2ForCausalLM", seed=3), 30, data)
    ours = _adamw_curve(lt.patch(tiny("Qwen2ForCausalLM", seed=3)), 30, data)
    assert ref[-1] < ref[0] - 0.5  # it learns something
    for i, (a, b) in enumerate(zip(ours, ref)):
        assert abs(a - b) <= 1e-4, f"step {i}: {a} vs {b}"


class _Rows(torch.utils.data.Dataset):
    def __init__(self, n=8, t=12):
        g = torch.Generator().manual_seed(5)
        self.rows = []
        for i in range(n):
            ids = torch.randint(3, V, (t,), generator=g)
            keep = 4 + (i * 5) % (t - 4)  # different real lengths: num_items_in_batch matters
            labels = ids.clone()
            labels[keep:] = -100
            mask = (torch.arange(t) < keep).long()
            self.rows.append(dict(input_ids=ids, labels=labels, attention_mask=mask))

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


def _trainer_params(tmp_path, patched, batch_size, accumulation, monkeypatch, bf16=False):
    calls = []
    real = lt_loss.linear_cross_entropy
    monkeypatch.setattr(lt_loss, "linear_cross_entropy", lambda *a, **k: calls.append(k) or real(*a, **k))
    model = tiny("LlamaForCausalLM", seed=2)
    if patched:
        lt.patch(model)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=batch_size, gradient_accumulation_steps=accumulation,
        max_steps=2, learning_rate=0.5, optim="sgd", lr_scheduler_type="constant", weight_decay=0.0,
        report_to=[], save_strategy="no", use_cpu=DEVICE.type == "cpu", seed=0, logging_steps=1,
        disable_tqdm=True, dataloader_num_workers=0, bf16=bf16,
    )
    trainer = transformers.Trainer(model=model, args=args, train_dataset=_Rows())
    trainer.train()
    assert bool(calls) == patched
    assert all(p.dtype == torch.float32 for p in model.parameters())  # fp32 master weights, also with bf16=True
    if patched:
        assert all(k["reduction"] == "sum" for k in calls)  # Trainer passed num_items_in_batch
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_trainer_gradient_accumulation(tmp_path, monkeypatch):
    """HF Trainer, SGD: patched 2 x 2 == unpatched 2 x 2 == patched 4 x 1 (num_items_in_batch)."""
    ref = _trainer_params(tmp_path, False, 2, 2, monkeypatch)
    ours = _trainer_params(tmp_path, True, 2, 2, monkeypatch)
    ours_4x1 = _trainer_params(tmp_path, True, 4, 1, monkeypatch)
    start = {n: p.detach() for n, p in tiny("LlamaForCausalLM", seed=2).named_parameters()}
    assert any((ref[n] - start[n]).abs().max() > 1e-3 for n in ref)  # training moved the weights
    for n in ref:
        torch.testing.assert_close(ours[n], ref[n], rtol=1e-5, atol=1e-5, msg=lambda m: f"{n}: {m}")
        torch.testing.assert_close(ours_4x1[n], ref[n], rtol=1e-5, atol=1e-5, msg=lambda m: f"{n} 4x1: {m}")


# ---------------------------------------------------------------------- benchmark harness


def test_train_bench_harness_cpu(tmp_path):
    """python -m logitless_bench --suite train on the CPU: tiny model, 3 steps, files written."""
    import json

    from logitless_bench import cli

    rc = cli.main(["--suite", "train", "--cpu", "--steps", "3", "--modes", "autocast", "--no-big",
                   "--out", str(tmp_path)])
    assert rc == 0
    data = json.loads((tmp_path / "latest-train-cpu.json").read_text())
    runs = {r["name"]: r for r in data["runs"]}
    assert set(runs) == {"hf-autocast", "logitless-autocast", "hf-seed2-autocast"}
    assert all(len(r["losses"]) == 3 and not r.get("error") for r in runs.values())
    hf, ours = runs["hf-autocast"]["losses"], runs["logitless-autocast"]["losses"]
    assert abs(hf[0] - ours[0]) < 2e-2  # same model, same data, bf16 autocast
    assert (tmp_path / "latest-train-cpu.md").read_text().count("NOT the benchmark") == 1
    assert (tmp_path / "latest-train-cpu.png").exists()


def test_trainer_bf16_autocast(tmp_path, monkeypatch):
    """Trainer(bf16=True): accelerate wraps the patched forward in autocast; fp32 weights follow HF's."""
    ref = _trainer_params(tmp_path, False, 2, 2, monkeypatch, bf16=True)
    ours = _trainer_params(tmp_path, True, 2, 2, monkeypatch, bf16=True)
    start = {n: p.detach() for n, p in tiny("LlamaForCausalLM", seed=2).named_parameters()}
    for n in ref:
        moved = (ref[n] - start[n]).norm()
        assert (ours[n] - ref[n]).norm() <= 0.05 * moved + 1e-6, n


def test_train_bench_batch_probe_stops_at_out_of_memory(tmp_path):
    """The larger-batch probe (GPU-only in the suite) on the CPU, an OOM simulated at 3 sequences."""
    import argparse

    from logitless_bench import train

    class Stream(train.MarkovStream):
        def batches(self, n, batch, seq, seed):
            if batch >= 3:
                raise torch.OutOfMemoryError("simulated")
            return super().batches(n, batch, seq, seed)

    args = argparse.Namespace(seed=0, lr=1e-3, batch=1)
    cfg = dict(train.CPU_MODEL, num_hidden_layers=1)
    for method in ("hf", "logitless"):
        res = train.big_batch_probe(method, "autocast", Stream(cfg["vocab_size"], 16, 0), cfg, args,
                                    torch.device("cpu"), None, [1, 2, 3, 4], 8, checkpointing=True)
        assert "error" not in res, res
        assert [t["fits"] for t in res["tried"]] == [True, True, False]
        assert res["max_tokens"] == 16 and res["limit_reached"]
    data = {"meta": {"gpu": False, "device": "cpu", "torch": "", "cuda": None, "triton": None, "peers": {},
                     "date": "2026", "command": "x"},
            "settings": {"model_name": "t", "model": cfg, "batch": 1, "seq": 8, "lr": 1e-3, "warmup_steps": 1,
                         "steps": 1, "active": 16, "modes": ["autocast"], "methods": ["hf", "logitless"],
                         "big_mode": "autocast"},
            "runs": [], "big": [res], "notes": []}
    text = train.markdown(train.summarize(data))
    assert "| logitless | on | 16 |" in text


def test_train_bench_moe_harness_cpu(tmp_path):
    """--model qwen3-moe (router auxiliary loss on): both methods train, the patch is in use, files written."""
    import json

    from logitless_bench import cli

    rc = cli.main(["--suite", "train", "--cpu", "--model", "qwen3-moe", "--steps", "2", "--modes", "autocast",
                   "--methods", "hf,logitless", "--no-big", "--no-spread", "--out", str(tmp_path)])
    assert rc == 0
    data = json.loads((tmp_path / "latest-train-qwen3-moe-cpu.json").read_text())
    runs = {r["name"]: r for r in data["runs"]}
    assert set(runs) == {"hf-autocast", "logitless-autocast"}
    assert runs["logitless-autocast"]["logits_none"] is True and runs["hf-autocast"]["logits_none"] is False
    assert abs(runs["hf-autocast"]["losses"][0] - runs["logitless-autocast"]["losses"][0]) < 2e-2
    assert data["settings"]["model_class"] == "Qwen3MoeForCausalLM"


# ---------------------------------------------------------------------- nn.DataParallel


def _data_parallel_copies(model, n):
    """What nn.DataParallel's ``replicate`` does, without GPUs: every module's
    ``_replicate_for_data_parallel()``, children wired to the copies, parameters set as plain
    attributes (torch sets broadcast copies; fresh leaves here, so a gradient shows whose
    weights a forward read)."""
    modules = list(model.modules())
    index = {m: i for i, m in enumerate(modules)}
    copies = [[m._replicate_for_data_parallel() for m in modules] for _ in range(n)]
    leaves = [{} for _ in range(n)]
    for j in range(n):
        for i, m in enumerate(modules):
            r = copies[j][i]
            for key, child in m._modules.items():
                r._modules[key] = None if child is None else copies[j][index[child]]
            for key, p in m._parameters.items():
                if p is None:
                    setattr(r, key, None)
                else:
                    leaf = p.detach().clone().requires_grad_()
                    setattr(r, key, leaf)
                    leaves[j][(i, key)] = leaf
    return [c[0] for c in copies], leaves


def test_data_parallel_copies_run_at_once():
    """nn.DataParallel (HF Trainer with several GPUs in one process) copies the patched model per
    GPU and runs the copies in threads: each copy computes HF's loss on its shard with its own
    weights (not the original's), also concurrently; eval mode gives the model's logits."""
    import threading

    ref = tiny("LlamaForCausalLM", seed=2)
    model = lt.patch(tiny("LlamaForCausalLM", seed=2))
    ids, labels, _ = batch(seed=5, b=4)
    copies, leaves = _data_parallel_copies(model, 2)
    assert all(lt.is_patched(c) for c in copies)
    for _ in range(3):  # several rounds: a shared state would race
        losses = [None, None]
        errors = []
        start = threading.Barrier(2)

        def run(j):
            try:
                start.wait()
                losses[j] = copies[j](input_ids=ids[2 * j:2 * j + 2], labels=labels[2 * j:2 * j + 2]).loss
            except BaseException as exc:  # noqa: BLE001
                errors.append(exc)

        threads = [threading.Thread(target=run, args=(j,)) for j in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        for j in range(2):
            want = ref(input_ids=ids[2 * j:2 * j + 2], labels=labels[2 * j:2 * j + 2]).loss
            torch.testing.assert_close(losses[j], want, rtol=1e-5, atol=1e-6)
    sum(losses).backward()
    head = list(model.modules()).index(model.get_output_embeddings())
    for j in range(2):
        assert leaves[j][(head, "weight")].grad is not None  # the copy's head weight was read
    assert all(p.grad is None for p in model.parameters())  # the original's never
    for c in copies:
        c.eval()
    with torch.no_grad():
        torch.testing.assert_close(copies[1](input_ids=ids).logits, ref.eval()(input_ids=ids).logits)
    lt.unpatch(model)
    assert "_replicate_for_data_parallel" not in vars(model)
    assert "_replicate_for_data_parallel" not in vars(model.get_output_embeddings())


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="nn.DataParallel over GPUs needs at least 2 CUDA GPUs")
def test_data_parallel_two_gpus():
    """torch's own nn.DataParallel on 2 GPUs: the patched loss and gradients equal HF's."""
    ref = tiny("LlamaForCausalLM", seed=2).to("cuda:0")
    model = lt.patch(tiny("LlamaForCausalLM", seed=2).to("cuda:0"))
    ids, labels, _ = batch(seed=5, b=4)
    losses = []
    for m in (ref, model):
        loss = torch.nn.DataParallel(m, device_ids=[0, 1])(input_ids=ids, labels=labels).loss
        assert loss.shape == (2,)  # one loss per GPU, as DataParallel gathers them
        loss.sum().backward()
        losses.append(loss)
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-6)
    for (n, p), q in zip(ref.named_parameters(), model.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-6, msg=lambda m: f"{n}: {m}")
