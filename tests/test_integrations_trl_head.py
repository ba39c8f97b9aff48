"""TRL's own fused-head entry point on logitless: ``add_fused_lm_head(model, temperature,
cast_lm_head_to_fp32, outputs)`` and ``patch_trl()``.

Every field TRL can ask for (log_probs, entropy, log_sum_sq_probs, mean_logits, is_top1)
against float64 (odd sizes, 3-D, one token, empty, all ignored, soft-cap, temperature,
bias, bf16), the same outputs as TRL's own head on a tiny model (mixed dtypes included),
and a real ``train()`` of each trainer that calls ``add_fused_lm_head`` in TRL 1.16,
showing logitless computed its head.
"""

from __future__ import annotations

import math

import pytest
import torch

from logitless.integrations import trl_fields
from tests.conftest import DEVICE

ALL = trl_fields.FIELDS


def _reference(x, w, b, t, temperature=1.0, softcap=None):
    """The five fields in float64 from materialised logits (0 / False at label -100)."""
    z = x.double() @ w.double().T + (0.0 if b is None else b.double())
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    a = z / temperature
    lp = a.log_softmax(-1)
    valid = t != -100
    logp = lp.gather(-1, t.clamp(min=0)[..., None])[..., 0]
    fields = (logp, -(lp.exp() * lp).sum(-1), torch.logsumexp(2 * lp, -1), a.mean(-1))
    fields = tuple(torch.where(valid, f, torch.zeros_like(f)) for f in fields)
    return (*fields, (a.argmax(-1) == t) & valid)


def _inputs(lead, h, v, dtype, seed, bias=True, ignore=0.3, device="cpu"):
    """Inputs on ``device`` (the Triton route: DEVICE, the GPU or the CPU interpreter)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, h, generator=g).to(dtype).to(device).requires_grad_()
    w = (torch.randn(v, h, generator=g) * h**-0.5 * 3).to(dtype).to(device).requires_grad_()
    b = (torch.randn(v, generator=g) * 0.5).to(dtype).to(device).requires_grad_() if bias else None
    t = torch.randint(0, v, lead, generator=g)
    t[torch.rand(lead, generator=g) < ignore] = -100
    return x, w, b, t.to(device)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", [
    dict(lead=(29,), h=40, v=1031),  # V prime (5 column tiles of 256 with the small budget), H % 16 != 0
    dict(lead=(3, 7), h=24, v=101, temperature=0.7, softcap=4.0),  # 3-D, temperature, soft-cap
    dict(lead=(1,), h=12, v=13, bias=False, ignore=0.0),  # one token
    dict(lead=(5,), h=12, v=13, ignore=1.0),  # all ignored
    dict(lead=(0,), h=12, v=13),  # empty
], ids=["odd", "3d-temp-softcap", "one-token", "all-ignored", "empty"])
@pytest.mark.parametrize("budget", [None, 1 << 12])  # one tile / every column kept; many tiles / recomputed
@pytest.mark.parametrize("backend", ["torch", "triton"])  # _AllFields; the kernels' FIELDS (interpreter)
def test_every_field_against_float64(dtype, case, budget, backend):
    if backend == "triton" and dtype == torch.float64:
        pytest.skip("the Triton kernels take 16/32-bit floats")
    case = dict(case)
    kw = {k: case.pop(k) for k in ("temperature", "softcap") if k in case}
    x, w, b, t = _inputs(case["lead"], case["h"], case["v"], dtype, seed=1, bias=case.get("bias", True),
                         ignore=case.get("ignore", 0.3), device=DEVICE if backend == "triton" else "cpu")
    got = trl_fields.head_fields(x, w, t, b, outputs=ALL, memory_budget=budget, backend=backend, **kw)
    ref = _reference(x, w, b, t, **kw)
    tol = 1e-12 if dtype == torch.float64 else 2e-5  # statistics are fp32 from the inputs' values
    for name, g, r in zip(ALL[:4], got[:4], ref[:4]):
        assert g.shape == t.shape, name
        if g.numel():
            err = (g.double() - r).abs().max().item()
            assert err <= tol * max(1.0, r.abs().max().item()), (name, err)
    assert got[4].dtype == torch.bool and torch.equal(got[4], ref[4])
    if x.numel() == 0:
        return
    g = torch.Generator().manual_seed(2)
    g_lp, g_h = (torch.randn(t.shape, generator=g, dtype=torch.float64).to(t.device) for _ in range(2))
    params = [p for p in (x, w, b) if p is not None]
    ours = torch.autograd.grad((got[0].double() * g_lp).sum() + (got[1].double() * g_h).sum(), params)
    refs = torch.autograd.grad((ref[0] * g_lp).sum() + (ref[1] * g_h).sum(), params)
    for o, r in zip(ours, refs):
        assert o.dtype == dtype
        bound = 1e-10 if dtype == torch.float64 else (2e-5 if dtype == torch.float32 else 2e-2)
        assert (o.double() - r).abs().max().item() <= bound * max(1.0, r.abs().max().item())


def test_fields_not_asked_are_none_and_the_log_probs_path_is_linear_log_probs(monkeypatch):
    x, w, b, t = _inputs((6,), 16, 31, torch.float32, seed=3)
    calls = []
    real = trl_fields._linear_log_probs
    monkeypatch.setattr(trl_fields, "_linear_log_probs", lambda *a, **k: calls.append(k) or real(*a, **k))
    lp, ent, sq, mean, top1 = trl_fields.head_fields(x, w, t, b, outputs=("log_probs", "entropy"))
    assert calls and sq is None and mean is None and top1 is None and ent is not None
    ref = _reference(x, w, b, t)
    torch.testing.assert_close(lp.double(), ref[0], rtol=0, atol=2e-5)
    out = trl_fields.head_fields(x, w, t, b, outputs=("mean_logits",))
    assert len(calls) == 1  # the one-pass path of all fields: no linear_log_probs call
    assert out[1] is None and out[2] is None and out[4] is None and out[0] is not None
    with pytest.raises(ValueError, match="unknown fused LM head output"):
        trl_fields.head_fields(x, w, t, b, outputs=("log_prob",))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_is_top1_ties_take_the_first_index_across_tiles(backend):
    """Equal maximal logits in different column tiles (256 wide on the torch route, 32 on
    the interpreter's plans) and vocabulary splits (one split; the plan's splits): the
    first index is the argmax (torch's rule), so a label at a later tied column is not top-1."""
    g = torch.Generator().manual_seed(4)
    dtype = torch.float64 if backend == "torch" else torch.float32
    dev = DEVICE if backend == "triton" else "cpu"
    w = torch.randn(700, 8, generator=g, dtype=dtype).clamp(-3, 3)
    w[[10, 300, 650]] = 4.0
    x = torch.rand(3, 8, generator=g, dtype=dtype) + 0.1
    x, w, t = x.to(dev), w.to(dev), torch.tensor([10, 300, 650], device=dev)
    for budget, splits in ((None, None), (1 << 12, None), (None, 1), (None, 2)):
        with _splits(splits):
            top1 = trl_fields.head_fields(x, w, t, outputs=("is_top1",), memory_budget=budget, backend=backend)[4]
        assert top1.tolist() == [True, False, False]


def _splits(splits):
    """The Triton plans with ``splits`` vocabulary splits (None: the planner's)."""
    import contextlib
    import dataclasses

    from tests.planning_seams import reshaped

    if splits is None:
        return contextlib.nullcontext()
    return reshaped(lambda p: dataclasses.replace(p, vocab_splits=splits))


@pytest.mark.parametrize("splits", [None, 1, 3])
@pytest.mark.parametrize("entropy", [True, False])
def test_triton_route_every_field(splits, entropy):
    """The kernels' FIELDS route (interpreter): V prime, H odd, a non-default ignore_index
    (a real class id), temperature and soft-cap, labels at the argmax for half the tokens
    (is_top1 True there), vocabulary splits forced; gradients of log_probs (and entropy)
    against float64; _AllFields not called."""
    x, w, b, t = _inputs((2, 19), 37, 211, torch.float32, seed=5, ignore=0.0, device=DEVICE)
    kw = dict(temperature=0.8, softcap=6.0)
    z = torch.nn.functional.linear(x.double(), w.double(), b.double())
    top = (6.0 * torch.tanh(z / 6.0)).argmax(-1)
    t = torch.where(torch.arange(19, device=t.device) % 2 == 0, top, t)
    t[0, 3] = t[1, 4] = 7  # ignore_index=7 below: 0 / False there
    ref = _reference(x, w, b, torch.where(t == 7, -100, t), **kw)
    outputs = ALL if entropy else ("log_probs", "log_sum_sq_probs", "mean_logits", "is_top1")
    real = trl_fields._AllFields.apply
    trl_fields._AllFields.apply = None  # (the torch route would fail here)
    try:
        with _splits(splits):
            got = trl_fields.head_fields(x, w, t, b, outputs=outputs, ignore_index=7, backend="triton", **kw)
    finally:
        trl_fields._AllFields.apply = real
    assert (got[1] is None) != entropy
    for name, g_, r in zip(ALL[:4], got[:4], ref[:4]):
        if g_ is not None:
            err = (g_.double() - r).abs().max().item()
            assert err <= 2e-5 * max(1.0, r.abs().max().item()), (name, err)
    assert torch.equal(got[4], ref[4]) and got[4].sum() >= 15
    if splits is None:  # without a gradient to come (nothing kept for a backward): the same fields
        with torch.no_grad():
            again = trl_fields.head_fields(x, w, t, b, outputs=outputs, ignore_index=7, backend="triton", **kw)
        for g_, a_ in zip(got, again):
            assert (g_ is None and a_ is None) or torch.equal(g_, a_)
    g = torch.Generator().manual_seed(6)
    g_lp, g_h = (torch.randn(t.shape, generator=g, dtype=torch.float64).to(t.device) for _ in range(2))
    loss = (got[0].double() * g_lp).sum() + ((got[1].double() * g_h).sum() if entropy else 0.0)
    ref_loss = (ref[0] * g_lp).sum() + ((ref[1] * g_h).sum() if entropy else 0.0)
    for o, r in zip(torch.autograd.grad(loss, (x, w, b)), torch.autograd.grad(ref_loss, (x, w, b))):
        assert (o.double() - r).abs().max().item() <= 2e-5 * max(1.0, r.abs().max().item())


# ------------------------------------------------------------------------------------------
# The model head against TRL's own add_fused_lm_head
# ------------------------------------------------------------------------------------------

trl = pytest.importorskip("trl", reason="trl (and its deps) not importable")
import transformers  # noqa: E402
from trl.trainer import utils as trl_utils  # noqa: E402

import logitless.integrations.trl as lt_trl  # noqa: E402

from .test_integrations_hf import tiny_llama  # noqa: E402


def _batch(v=93, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, v, (3, 9), generator=g)
    labels = ids.clone()
    labels[0, :4] = -100
    labels[2, 6:] = -100
    return ids, labels


@pytest.mark.parametrize("outputs", [("log_probs",), ("log_probs", "entropy"), ALL,
                                     ("log_probs", "entropy", "is_top1"), ("log_probs", "mean_logits")])
@pytest.mark.parametrize("temperature", [1.0, 0.8])
def test_same_outputs_as_trls_head(outputs, temperature):
    ids, labels = _batch()
    theirs, ours = tiny_llama(seed=3, vocab=93), tiny_llama(seed=3, vocab=93)
    trl_utils.add_fused_lm_head(theirs, temperature=temperature, outputs=outputs)
    lt_trl.add_fused_lm_head(ours, temperature=temperature, outputs=outputs)
    t_out = theirs(input_ids=ids, labels=labels, fused_lm_head=True)
    o_out = ours(input_ids=ids, labels=labels, fused_lm_head=True)
    assert type(o_out) is type(t_out)
    for name in ALL + ("label_mask",):
        a, b = getattr(o_out, name), getattr(t_out, name)
        assert (a is None) == (b is None), name
        if a is None:
            continue
        if a.dtype == torch.bool:
            assert torch.equal(a, b), name
        else:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=name)
    torch.testing.assert_close(o_out.loss, t_out.loss, rtol=1e-5, atol=1e-6)
    t_out.loss.backward()
    o_out.loss.backward()
    for (n, p), q in zip(ours.named_parameters(), theirs.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=n)
    # generation and plain calls are the model's own forward
    torch.testing.assert_close(ours(input_ids=ids).logits, theirs(input_ids=ids).logits)


@pytest.mark.parametrize("fp32_head", [False, True])
def test_mixed_dtypes_as_trl(fp32_head):
    """A bf16 backbone with an fp32 head weight outside autocast: TRL computes in the hidden
    states' dtype (the weight cast to bf16), or all in fp32 with cast_lm_head_to_fp32; ours
    accepts the same call, with the same semantics (fp32 statistics of those values)."""
    ids, labels = _batch(seed=1)
    models = []
    for _ in range(2):
        m = tiny_llama(seed=3, vocab=93).to(torch.bfloat16)
        m.lm_head.float()
        models.append(m)
    theirs, ours = models
    trl_utils.add_fused_lm_head(theirs, cast_lm_head_to_fp32=fp32_head, outputs=ALL)
    lt_trl.add_fused_lm_head(ours, cast_lm_head_to_fp32=fp32_head, outputs=ALL)
    t_out = theirs(input_ids=ids, labels=labels, fused_lm_head=True)
    o_out = ours(input_ids=ids, labels=labels, fused_lm_head=True)
    # TRL rounds its bf16 logits to bf16 before the fp32 statistics, ours does not: bf16-level agreement
    tol = 1e-5 if fp32_head else 3e-2
    for name in ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits"):
        torch.testing.assert_close(getattr(o_out, name).float(), getattr(t_out, name).float(), rtol=tol, atol=tol)
    o_out.loss.backward()
    assert ours.lm_head.weight.grad.dtype == torch.float32  # the fp32 weight gets its gradient in fp32
    assert torch.isfinite(ours.lm_head.weight.grad).all()


@pytest.mark.parametrize("is_top1", [False, True])
def test_patch_sft_grpo_head_accepts_trls_mixed_dtypes(is_top1):
    """add_logitless_lm_head (patch_sft / patch_grpo): a bf16 backbone with an fp32 head
    outside autocast is TRL's call, computed in the hidden states' dtype as TRL (it used to
    raise TypeError)."""
    ids, labels = _batch(seed=1)
    theirs, ours = (tiny_llama(seed=3, vocab=93).to(torch.bfloat16) for _ in range(2))
    for m in (theirs, ours):
        m.lm_head.float()
    trl_utils.add_fused_lm_head(theirs, outputs=("log_probs", "entropy", "is_top1"))
    lt_trl.add_logitless_lm_head(ours, is_top1=is_top1)
    t_out = theirs(input_ids=ids, labels=labels, fused_lm_head=True)
    o_out = ours(input_ids=ids, labels=labels, fused_lm_head=True)
    for name in ("log_probs", "entropy"):
        torch.testing.assert_close(getattr(o_out, name).float(), getattr(t_out, name).float(), rtol=3e-2, atol=3e-2)
    o_out.loss.backward()
    assert ours.lm_head.weight.grad.dtype == torch.float32


def test_refusals_and_shift_labels():
    m = tiny_llama(seed=3, vocab=93)
    with pytest.raises(ValueError, match="unknown fused LM head output"):
        lt_trl.add_fused_lm_head(m, outputs=("log_probs", "logits"))
    ids, labels = _batch(seed=2)
    lt_trl.add_fused_lm_head(m, outputs=ALL)
    shifted = torch.cat([labels[:, 1:], torch.full((3, 1), -100)], dim=1)
    a = m(input_ids=ids, labels=labels, fused_lm_head=True)
    b = m(input_ids=ids, shift_labels=shifted, fused_lm_head=True)
    torch.testing.assert_close(a.log_probs, b.log_probs[:, :-1])
    assert torch.equal(b.is_top1[:, -1], torch.zeros(3, dtype=torch.bool))


def test_patch_trl_replaces_every_binding_and_unpatch_restores():
    import importlib

    original = trl_utils.add_fused_lm_head
    lt_trl.patch_trl()
    try:
        for name in lt_trl.TRL_MODULES:
            try:
                module = importlib.import_module(name)
            except Exception:
                continue
            assert module.add_fused_lm_head is lt_trl.add_fused_lm_head, name
        lt_trl.patch_trl()  # idempotent
    finally:
        lt_trl.unpatch_trl()
    assert trl_utils.add_fused_lm_head is original
    import trl.trainer.dpo_trainer as dpo

    assert dpo.add_fused_lm_head is original


# ------------------------------------------------------------------------------------------
# A real train() of each trainer that calls add_fused_lm_head in TRL 1.16
# ------------------------------------------------------------------------------------------

datasets = pytest.importorskip("datasets", reason="datasets not importable")
pytest.importorskip("tokenizers", reason="tokenizers not importable")

from .test_integrations_trl_sft import WORDS, _tokenizer  # noqa: E402


@pytest.fixture
def patched(monkeypatch):
    """patch_trl() for the test, counting the head's calls and the fields they asked for."""
    calls = []
    real = trl_fields.head_fields

    def counted(*a, **k):
        calls.append(tuple(k["outputs"]))
        return real(*a, **k)

    monkeypatch.setattr(trl_fields, "head_fields", counted)
    lt_trl.patch_trl()
    yield calls
    lt_trl.unpatch_trl()


def _text(g, n):
    return " ".join(WORDS[i] for i in torch.randint(0, len(WORDS), (n,), generator=g).tolist())


def _common(tmp_path, steps=2):
    return dict(output_dir=str(tmp_path), max_steps=steps, per_device_train_batch_size=4, learning_rate=1e-2,
                logging_steps=1, save_strategy="no", report_to="none", use_cpu=True, bf16=False, fp16=False,
                seed=7, dataloader_num_workers=0)


def _finite_logs(trainer):
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert logs and all(math.isfinite(h["loss"]) for h in logs)
    return logs


def test_sft_trainer(tmp_path, patched):
    from trl import SFTConfig, SFTTrainer

    g = torch.Generator().manual_seed(0)
    ds = datasets.Dataset.from_list([{"text": _text(g, 4 + i % 7)} for i in range(8)])
    trainer = SFTTrainer(model=tiny_llama(seed=3, vocab=93), train_dataset=ds, processing_class=_tokenizer(),
                         args=SFTConfig(max_length=32, **_common(tmp_path)))
    trainer.train()
    logs = _finite_logs(trainer)
    assert patched and all(set(o) >= {"log_probs", "entropy", "is_top1"} for o in patched)
    assert all(0.0 <= h["mean_token_accuracy"] <= 1.0 for h in logs)


def _prompts(n=8):
    g = torch.Generator().manual_seed(1)
    return datasets.Dataset.from_list([{"prompt": _text(g, 2 + k % 3)} for k in range(n)])


def _reward(prompts, completions, **kw):
    return [float(sum(int(w[1:]) % 7 for w in c.split() if w[1:].isdigit())) for c in completions]


def _saved(tmp_path):
    path = tmp_path / "tiny"
    if not path.exists():
        tiny_llama(seed=3, vocab=93).save_pretrained(path)
    return str(path)


def test_grpo_trainer(tmp_path, patched):
    from trl import GRPOConfig, GRPOTrainer

    args = GRPOConfig(num_generations=2, max_completion_length=6, beta=0.1, temperature=0.9,
                      disable_dropout=True, **_common(tmp_path / "out"))
    model = transformers.AutoModelForCausalLM.from_pretrained(_saved(tmp_path))
    trainer = GRPOTrainer(model=model, reward_funcs=_reward, args=args, train_dataset=_prompts(),
                          processing_class=_tokenizer())
    trainer.train()
    logs = _finite_logs(trainer)
    assert len(patched) >= 3 and any("entropy" in o for o in patched)
    assert all(math.isfinite(h["entropy"]) for h in logs)


def test_rloo_trainer(tmp_path, patched):
    from trl import RLOOConfig, RLOOTrainer

    args = RLOOConfig(num_generations=2, max_completion_length=6, beta=0.1, temperature=0.9,
                      disable_dropout=True, **_common(tmp_path / "out"))
    model = transformers.AutoModelForCausalLM.from_pretrained(_saved(tmp_path))
    trainer = RLOOTrainer(model=model, reward_funcs=_reward, args=args, train_dataset=_prompts(),
                          processing_class=_tokenizer())
    trainer.train()
    _finite_logs(trainer)
    assert len(patched) >= 3


def _preference_rows(n=8):
    g = torch.Generator().manual_seed(2)
    return [{"prompt": _text(g, 2 + k % 3), "chosen": " " + _text(g, 2 + k % 2), "rejected": " " + _text(g, 3)}
            for k in range(n)]


def test_dpo_trainer(tmp_path, patched):
    from trl import DPOConfig, DPOTrainer

    ds = datasets.Dataset.from_list(_preference_rows())
    trainer = DPOTrainer(model=tiny_llama(seed=3, vocab=93), ref_model=tiny_llama(seed=3, vocab=93),
                         train_dataset=ds, processing_class=_tokenizer(),
                         args=DPOConfig(max_length=32, **_common(tmp_path)))
    trainer.train()
    logs = _finite_logs(trainer)
    # the policy asks for mean_logits and is_top1 (logits/* and accuracy metrics)
    assert any(set(o) >= {"mean_logits", "is_top1"} for o in patched)
    keys = [k for k in logs[0] if k.startswith("logits/")]
    assert keys and all(math.isfinite(h[k]) for h in logs for k in keys)


def test_kto_trainer(tmp_path, patched):
    from trl import KTOConfig, KTOTrainer

    rows = []
    for k, r in enumerate(_preference_rows()):
        rows.append({"prompt": r["prompt"], "completion": r["chosen" if k % 2 else "rejected"], "label": k % 2 == 1})
    trainer = KTOTrainer(model=tiny_llama(seed=3, vocab=93), ref_model=tiny_llama(seed=3, vocab=93),
                         train_dataset=datasets.Dataset.from_list(rows), processing_class=_tokenizer(),
                         args=KTOConfig(max_length=32, **_common(tmp_path)))
    trainer.train()
    _finite_logs(trainer)
    assert any("mean_logits" in o for o in patched)


def test_patched_model_under_patch_trl_does_not_warn(tmp_path, patched):
    """lt.patch(model) and patch_trl(): the trainer's head is logitless's, so the bypass
    detector (PatchBypassedWarning) stays silent."""
    import warnings

    from trl import SFTConfig, SFTTrainer

    import logitless.transformers as lt
    from logitless.transformers.bypass import PatchBypassedWarning

    g = torch.Generator().manual_seed(0)
    ds = datasets.Dataset.from_list([{"text": _text(g, 4 + i % 7)} for i in range(8)])
    model = tiny_llama(seed=3, vocab=93)
    lt.patch(model)
    trainer = SFTTrainer(model=model, train_dataset=ds, processing_class=_tokenizer(),
                         args=SFTConfig(max_length=32, **_common(tmp_path, steps=1)))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        trainer.train()
    assert [w for w in seen if issubclass(w.category, PatchBypassedWarning)] == []
    assert patched
