"""logitless.integrations.nemo_automodel with NeMo Automodel 0.7 itself: a recipe YAML's one-line
``loss_fn: _target_: ...`` goes through NeMo Automodel's YAML loader and its recipes' typed config
(``RecipeConfig.loss_fn``: ``build_loss_config`` -> ``LossFromFactoryConfig``) to our loss, which
its recipes take for a ``LinearCrossEntropy``; its ``calculate_loss`` (the recipe's call, with
``prepare_lm_weight``) then gives the loss and every gradient of ``MaskedCrossEntropy`` on fp32
logits of a tiny random Llama run as the recipe runs it (``logits_to_keep=1``,
``output_hidden_states=True``), for each reduction, soft-capping, ignored labels, per-token weights
and ``num_label_tokens``; logitless' op runs; bad options raise. Where NeMo Automodel is not
installed the file skips: scripts/test_frameworks.sh installs it (docs/testing.md).
"""

from __future__ import annotations

import importlib.util
import logging

import pytest
import torch

if importlib.util.find_spec("nemo_automodel") is None:
    pytest.skip("NeMo Automodel is not installed (scripts/test_frameworks.sh nemo installs it)",
                allow_module_level=True)
transformers = pytest.importorskip("transformers")

from nemo_automodel.components.config.loader import load_yaml_config  # noqa: E402
from nemo_automodel.components.loss import LossFromFactoryConfig  # noqa: E402
from nemo_automodel.components.loss.linear_ce_base import LinearCrossEntropy  # noqa: E402
from nemo_automodel.components.loss.masked_ce import MaskedCrossEntropy  # noqa: E402
from nemo_automodel.components.loss.utils import calculate_loss, prepare_lm_weight  # noqa: E402
from nemo_automodel.components.training.model_output_utils import get_final_hidden_states  # noqa: E402
from nemo_automodel.recipes._typed_config import RecipeConfig  # noqa: E402

import logitless.integrations.nemo_automodel as lt_nemo  # noqa: E402
from logitless.integrations import _announce  # noqa: E402

V, H = 101, 40
TARGET = "logitless.integrations.nemo_automodel.LogitlessLinearCrossEntropy"


def _recipe_loss(tmp_path, extra: str = ""):
    """What a recipe does with its YAML: load it, type it, build its loss_fn."""
    path = tmp_path / "recipe.yaml"
    path.write_text(f"step_scheduler:\n  global_batch_size: 2\nloss_fn:\n  _target_: {TARGET}\n{extra}")
    cfg = RecipeConfig(load_yaml_config(str(path)))
    assert isinstance(cfg.loss_fn, LossFromFactoryConfig)
    return cfg.loss_fn.build()


@pytest.fixture
def spy(monkeypatch):
    calls = []
    original = lt_nemo.linear_cross_entropy

    def counted(*args, **kwargs):
        calls.append(kwargs)
        return original(*args, **kwargs)

    monkeypatch.setattr(lt_nemo, "linear_cross_entropy", counted)
    return calls


def _model():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2)
    model = transformers.LlamaForCausalLM(cfg).float()
    return model


def _batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, V, (2, 11), generator=g)
    labels = torch.roll(ids, -1, 1)
    labels[:, -1] = -100
    labels[0, :3] = -100
    return ids, labels


def _step(model, loss_fn, ids, labels, softcap=None, sum_none=False, **loss_kwargs):
    """One loss and backward the way NeMo Automodel's train_ft recipe computes them (the
    reference: its logits path, with fp32 logits soft-capped by hand where ``softcap``)."""
    model.zero_grad()
    if isinstance(loss_fn, LinearCrossEntropy):
        out = model(input_ids=ids, logits_to_keep=1, output_hidden_states=True)
        weight = prepare_lm_weight(loss_fn, model)
        logits = out.logits
    else:
        out = model(input_ids=ids)
        weight = None
        logits = out.logits if softcap is None else softcap * torch.tanh(out.logits.float() / softcap)
    loss = calculate_loss(loss_fn, logits=logits, labels=labels, model=model,
                          hidden_states=get_final_hidden_states(out), lm_weight=weight, **loss_kwargs)
    (loss.sum() if sum_none else loss).backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("case", ["sum", "mean", "none", "num_label_tokens", "loss_weights", "softcap"])
def test_recipe_yaml_loss_equals_masked_cross_entropy(case, tmp_path, spy):
    reduction = case if case in ("sum", "mean", "none") else "sum"
    extra = f"  reduction: {reduction}\n" + ("  logit_softcapping: 3.0\n" if case == "softcap" else "")
    ours_fn = _recipe_loss(tmp_path, extra)
    assert type(ours_fn) is lt_nemo.LogitlessLinearCrossEntropy and ours_fn.reduction == reduction
    ids, labels = _batch()
    kwargs = {}
    if case == "num_label_tokens":
        kwargs["num_label_tokens"] = int((labels != -100).sum())
    if case == "loss_weights":
        kwargs["loss_weights"] = torch.rand(labels.shape, generator=torch.Generator().manual_seed(2))
    softcap = 3.0 if case == "softcap" else None
    if reduction == "none":   # per-token losses (flat in MaskedCrossEntropy); the gradient of their sum
        ours, ref = (_step(_model(), fn, ids, labels, sum_none=True)
                     for fn in (ours_fn, MaskedCrossEntropy(reduction="none")))
        torch.testing.assert_close(ours[0].reshape(-1), ref[0].reshape(-1), rtol=0, atol=2e-5)
        for name, g in ours[1].items():
            torch.testing.assert_close(g, ref[1][name], rtol=1e-4, atol=1e-6, msg=name)
        return
    loss, grads = _step(_model(), ours_fn, ids, labels, **kwargs)
    ref_loss, ref_grads = _step(_model(), MaskedCrossEntropy(reduction=reduction), ids, labels, softcap, **kwargs)
    assert len(spy) == 1 and spy[0]["reduction"] == ("none" if case == "loss_weights" else reduction)
    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=2e-5)
    for name, g in grads.items():
        torch.testing.assert_close(g, ref_grads[name], rtol=1e-4, atol=1e-6, msg=name)


def test_logs_once_and_refuses_bad_options(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(_announce, "_announced", set())
    with caplog.at_level(logging.INFO, logger="logitless"):
        _recipe_loss(tmp_path)
        _recipe_loss(tmp_path, "  memory_budget: 1048576\n  backend: torch\n")
    assert [r.getMessage() for r in caplog.records if "logitless is active" in r.getMessage()] == [
        "logitless is active (nemo_automodel): the recipe's loss_fn is LogitlessLinearCrossEntropy (no logits)"]
    for extra, match in (("  reduction: avg\n", "reduction must be one of"),
                         ("  memory_budget: -1\n", "memory_budget"),
                         ("  backend: cuda\n", "backend must be one of"),
                         ("  logit_softcapping: -2\n", "logit_softcapping")):
        with pytest.raises(ValueError, match=match):
            _recipe_loss(tmp_path, extra)
    loss = lt_nemo.LogitlessLinearCrossEntropy(reduction="mean")
    x, w, t = torch.randn(2, 3, H), torch.randn(V, H), torch.zeros(2, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="num_label_tokens needs reduction='sum'"):
        loss(x, t, w, num_label_tokens=4)
    with pytest.raises(ValueError, match="loss_weights needs reduction='sum'"):
        loss(x, t, w, loss_weights=torch.ones(2, 3))
