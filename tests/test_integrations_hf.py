"""logitless.integrations.hf_log_probs against the HF model's own logits."""

from __future__ import annotations

import pytest
import torch

from logitless.integrations import hf_log_probs

transformers = pytest.importorskip("transformers")


def tiny_llama(seed=0, vocab=97, **kw):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, **kw)
    return transformers.LlamaForCausalLM(cfg).float()


def _ref(model, ids, mask, t, keep=None):
    logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
    tok = ids[:, 1:]
    if keep is not None:
        logits, tok = logits[:, -keep:], tok[:, -keep:]
    lp = torch.log_softmax(logits / t, -1)
    return lp.gather(-1, tok[..., None])[..., 0], -(lp.exp() * lp).sum(-1)


@pytest.mark.parametrize("keep", [None, 4])
def test_matches_model_logits_with_gradients(keep):
    model = tiny_llama()
    ids = torch.randint(0, 97, (2, 9))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0  # left padding
    lp, ent = hf_log_probs(model, ids, mask, temperature=0.7, entropy=True, logits_to_keep=keep)
    rlp, rent = _ref(model, ids, mask, 0.7, keep)
    assert lp.shape == rlp.shape == ((2, 8) if keep is None else (2, 4))
    torch.testing.assert_close(lp, rlp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent, rent, rtol=1e-5, atol=1e-5)
    g1, g2 = torch.randn_like(lp), torch.randn_like(ent)
    params = [p for p in model.parameters() if p.requires_grad]
    ours = torch.autograd.grad((lp * g1).sum() + (ent * g2).sum(), params, allow_unused=True)
    theirs = torch.autograd.grad((rlp * g1).sum() + (rent * g2).sum(), params, allow_unused=True)
    for a, b in zip(ours, theirs):
        if b is None:
            continue
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_softcap_and_refused_scaling():
    model = tiny_llama(seed=1)
    model.config.final_logit_softcapping = 2.0  # read from the config, as Gemma 2
    ids = torch.randint(0, 97, (1, 6))
    lp = hf_log_probs(model, ids)
    z = model(input_ids=ids).logits[:, :-1].float()
    z = 2.0 * torch.tanh(z / 2.0)
    ref = torch.log_softmax(z, -1).gather(-1, ids[:, 1:, None])[..., 0]
    torch.testing.assert_close(lp, ref, rtol=1e-5, atol=1e-5)
    model.config.final_logit_softcapping = None
    model.config.logits_scaling = 4.0
    with pytest.raises(ValueError, match="logits_scaling"):
        hf_log_probs(model, ids)
    with pytest.raises(ValueError, match="logits_to_keep"):
        model.config.logits_scaling = None
        hf_log_probs(model, ids, logits_to_keep=0)
