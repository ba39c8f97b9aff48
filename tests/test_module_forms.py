"""The module forms (``LinearCrossEntropyLoss``, ...) take exactly their function's keywords
(``ops.common.module_form``: read from the signature, so they cannot drift), with the
same defaults, and pass them through (``batch_invariant`` included)."""

from __future__ import annotations

import inspect

import pytest
import torch

import logitless

#: module form -> (its function, the function's keyword-only tensor inputs that forward takes)
FORMS = {
    "LinearCrossEntropyLoss": ("linear_cross_entropy", ()),
    "CrossEntropyLoss": ("cross_entropy", ()),
    "LinearJSDLoss": ("linear_jsd", ("student_bias", "teacher_bias")),
    "JSDLoss": ("jsd", ()),
    "LinearLogProbs": ("linear_log_probs", ()),
    "LogProbs": ("log_probs", ()),
    "LinearTopKKLLoss": ("linear_topk_kl", ("bias",)),
}


@pytest.mark.parametrize("form", sorted(FORMS))
def test_module_form_takes_exactly_the_functions_keywords(form):
    module, (fn_name, inputs) = getattr(logitless, form), FORMS[form]
    fn = inspect.signature(getattr(logitless, fn_name)).parameters
    expected = {k: p.default for k, p in fn.items() if p.kind is p.KEYWORD_ONLY and k not in inputs}
    got = {k: p.default for k, p in inspect.signature(module).parameters.items()}
    assert got == expected
    module()  # every default is accepted
    for name in inputs:
        with pytest.raises(TypeError, match=name):
            module(**{name: None})
    with pytest.raises(TypeError, match="not_a_keyword"):
        module(not_a_keyword=1)


def test_batch_invariant_goes_through_linear_cross_entropy_loss(monkeypatch):
    """``LinearCrossEntropyLoss(batch_invariant=True)`` calls the function with it (the
    keyword was once dropped by the module form) and gives the function's result."""
    from logitless.ops.linear_cross_entropy import api

    seen = []
    real = api.linear_cross_entropy

    def spy(*args, **kwargs):
        seen.append(kwargs.get("batch_invariant"))
        return real(*args, **kwargs)

    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(6, 8, generator=g), torch.randn(11, 8, generator=g)
    t = torch.randint(0, 11, (6,), generator=g)
    module = logitless.LinearCrossEntropyLoss(batch_invariant=True, backend="torch", reduction="none")
    monkeypatch.setattr(api, "linear_cross_entropy", spy)
    got = module(x, w, t)
    assert seen == [True]
    assert torch.equal(got, real(x, w, t, batch_invariant=True, backend="torch", reduction="none"))
    assert "batch_invariant=True" in repr(module)


@pytest.mark.parametrize("form", ["LinearCrossEntropyLoss", "CrossEntropyLoss"])
def test_module_form_keeps_nn_module_buffers(form):
    """A module form's buffer keywords are registered buffers, and ``nn.Module.buffers()``
    still works on it (a class attribute named ``buffers`` once shadowed the method)."""
    cw = torch.rand(5) + 0.5
    module = getattr(logitless, form)(class_weight=cw)
    assert [b is cw for b in module.buffers()] == [True]
    assert dict(module.named_buffers()) == {"class_weight": cw}
    assert list(getattr(logitless, form)().buffers()) == []


def test_cross_entropy_loss_weight_alias():
    cw = torch.rand(5) + 0.5
    assert torch.equal(logitless.CrossEntropyLoss(weight=cw).class_weight, cw)
    with pytest.raises(ValueError, match="not both"):
        logitless.CrossEntropyLoss(weight=cw, class_weight=cw)
