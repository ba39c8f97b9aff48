"""The top-k distillation integrations: verl's ``compute_forward_kl_topk`` from hidden states
(``logitless.integrations.verl``) against verl's own formula on the logits (written out
here: verl is not installed in CI), and the Megatron seam (``integrations.megatron_topk``)
against ``linear_topk_kl`` on Megatron's (s, b, h) layout with a stand-in output layer
(TP = 1; megatron-core in the newest-releases leg only)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from logitless.integrations import verl


def _verl_forward_kl_topk(student_logits, teacher_topk_log_probs, teacher_topk_ids):
    """verl's compute_forward_kl_topk (log_prob_min_clamp None): its loss and teacher mass."""
    lq = F.log_softmax(student_logits.float(), dim=-1).gather(-1, teacher_topk_ids)
    lp = teacher_topk_log_probs.float()
    return (lp.exp() * (lp - lq)).sum(-1), lp.exp().sum(-1)


def _inputs(seed=0, t=9, h=16, v=53, k=6, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, t, h, generator=g, dtype=dtype)
    w = torch.randn(v, h, generator=g, dtype=dtype) * h ** -0.5 * 2
    lp, ids = torch.log_softmax(torch.randn(1, t, v, generator=g, dtype=torch.float64) * 2, -1).topk(k, -1)
    return x.requires_grad_(), w.requires_grad_(), lp, ids


def test_verl_forward_kl_topk_is_verls_loss():
    x, w, lp, ids = _inputs()
    out = verl.compute_forward_kl_topk(x, w, lp, ids, None)
    logits = x @ w.T
    ref, mass = _verl_forward_kl_topk(logits, lp, ids)
    torch.testing.assert_close(out["distillation_losses"], ref.to(out["distillation_losses"].dtype))
    torch.testing.assert_close(out["teacher_mass"].double(), mass.double())
    g = torch.randn(ref.shape, dtype=torch.float64)
    ours = torch.autograd.grad(out["distillation_losses"], (x, w), g)
    theirs = torch.autograd.grad(ref, (x, w), g)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b)


def test_verl_nested_teacher_tensors_and_clamp():
    x, w, lp, ids = _inputs(t=7)
    nested_lp = torch.nested.nested_tensor([lp[0, :3], lp[0, 3:]], layout=torch.jagged)
    nested_ids = torch.nested.nested_tensor([ids[0, :3], ids[0, 3:]], layout=torch.jagged)
    out = verl.compute_forward_kl_topk(x, w, nested_lp, nested_ids, None)
    torch.testing.assert_close(out["distillation_losses"], verl.compute_forward_kl_topk(x, w, lp, ids)[
        "distillation_losses"])
    from types import SimpleNamespace

    config = SimpleNamespace(distillation_loss=SimpleNamespace(log_prob_min_clamp=-10.0))
    with pytest.raises(ValueError, match="log_prob_min_clamp=null"):
        verl.compute_forward_kl_topk(x, w, lp, ids, config)


def test_megatron_topk_processor():
    pytest.importorskip("megatron.core", reason="megatron-core is installed in the newest-releases leg only")
    from logitless.integrations.megatron_topk import topk_kl_processor
    from logitless.ops.linear_topk_kl import linear_topk_kl

    class _Layer:  # Megatron's ColumnParallelLinear as the seam reads it: weight, bias, TP group
        def __init__(self, w):
            self.weight, self.bias, self.skip_bias_add = w, None, False
            self.tp_group, self.sequence_parallel = None, False

    x, w, lp, ids = _inputs(t=5)
    b, s = 2, 5
    hidden = torch.randn(s, b, x.shape[-1], dtype=torch.float64, requires_grad=True)
    lp, ids = lp.expand(b, s, -1), ids.expand(b, s, -1)
    labels = torch.randint(0, w.shape[0], (b, s))
    ctx = dict(teacher_ids=ids, teacher_log_probs=lp, direction="reverse", tail="bucket", hard_label_weight=0.2)
    out = topk_kl_processor(hidden_states=hidden, output_layer=_Layer(w), labels=labels, context=ctx)["loss"]
    ref = linear_topk_kl(hidden.transpose(0, 1), w, ids, lp, labels, direction="reverse", tail="bucket",
                         hard_label_weight=0.2, reduction="none")
    torch.testing.assert_close(out, ref)
    with pytest.raises(ValueError, match="teacher_ids"):
        topk_kl_processor(hidden_states=hidden, output_layer=_Layer(w), labels=labels, context={})
