"""Per-token log-probs (and entropy) of given tokens under a Hugging Face causal LM,
from its last hidden states and LM-head weight, without logits.

Works with any ``PreTrainedModel`` whose decoder is reachable as ``model.get_decoder()``
(or ``model.base_model``) and whose head is ``model.get_output_embeddings()`` (an
``nn.Linear``); Gemma 2's ``final_logit_softcapping`` is applied. Models that scale
their logits otherwise (``logit_scale``, ``logits_scaling``, ``lm_head_multiplier``,
``output_multiplier``) are refused with a ValueError rather than given wrong numbers.
"""

from __future__ import annotations

from typing import Optional

from torch import Tensor, nn

from logitless.ops.linear_log_probs import linear_log_probs
from logitless.transformers.patch import run_backbone

_SCALES = ("logit_scale", "logits_scaling", "lm_head_multiplier", "output_multiplier")


def text_config(model):
    config = model.config
    get = getattr(config, "get_text_config", None)
    return get() if get is not None else config


def head_options(model) -> dict:
    """softcap of the model's final logits; ValueError for other logit scalings."""
    cfg = text_config(model)
    for name in _SCALES:
        value = getattr(cfg, name, None)
        if value is not None and value != 1.0:
            raise ValueError(f"the model scales its logits ({name}={value}); hf_log_probs supports only "
                             "final_logit_softcapping")
    return {"softcap": getattr(cfg, "final_logit_softcapping", None)}


def backbone(model) -> nn.Module:
    """The decoder that returns ``last_hidden_state``: model.get_decoder() or model.base_model."""
    get = getattr(model, "get_decoder", None)
    dec = get() if get is not None else None
    if dec is None or dec is model:
        dec = getattr(model, "base_model", None)
    if dec is None or dec is model:
        raise ValueError(f"cannot find the backbone of {type(model).__name__} (no get_decoder() or base_model)")
    return dec


def lm_head(model) -> nn.Linear:
    head = model.get_output_embeddings()
    if head is None or not hasattr(head, "weight") or head.weight.dim() != 2:
        raise ValueError(f"{type(model).__name__}.get_output_embeddings() is not a linear LM head")
    return head


def hf_log_probs(model, input_ids: Tensor, attention_mask: Optional[Tensor] = None, *, temperature: float = 1.0,
                 entropy: bool = False, logits_to_keep: Optional[int] = None, ignore_index: int = -100):
    """log softmax(logits / T)[next token] per position of an HF causal LM, without logits.

    Runs the backbone (``model.get_decoder()``) to the last hidden states h (B, L, H),
    then ``logitless.linear_log_probs(h[:, :-1], head.weight, input_ids[:, 1:],
    head.bias, temperature=T, softcap=final_logit_softcapping)``: position i scores token
    i + 1. Equals ``log_softmax(model(input_ids).logits[:, :-1] / T).gather(-1,
    input_ids[:, 1:, None])`` (and its entropy) to fp32 rounding, with gradients to the
    whole model; no (tokens x vocab) tensor is ever stored.

    Args:
        model: an HF causal LM (``...ForCausalLM``).
        input_ids: (B, L) token ids (prompt + completion).
        attention_mask: optional (B, L), passed to the backbone. Padded positions are
            scored like any other (mask them in your loss).
        temperature: finite float > 0.
        entropy: also return the entropy of softmax(logits / T) per position.
        logits_to_keep: score only the last k tokens (TRL's convention): outputs
            (B, k) for tokens input_ids[:, -k:]. Default: all L - 1 tokens.
        ignore_index: token ids equal to it score 0 (no gradient).

    Returns:
        logp (B, L - 1) or (B, k) fp32, or ``(logp, entropy)``.
    """
    opts = head_options(model)
    out = run_backbone(model, backbone(model), input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
    hidden, tokens = hidden[:, :-1], input_ids[:, 1:]
    if logits_to_keep is not None:
        if isinstance(logits_to_keep, bool) or not isinstance(logits_to_keep, int) or logits_to_keep < 1:
            raise ValueError(f"logits_to_keep must be None or an int >= 1, got {logits_to_keep!r}")
        hidden, tokens = hidden[:, -logits_to_keep:], tokens[:, -logits_to_keep:]
    head = lm_head(model)
    hidden = hidden.to(head.weight.device)
    return linear_log_probs(hidden, head.weight, tokens.to(head.weight.device), head.bias, temperature=temperature,
                            entropy=entropy, ignore_index=ignore_index, **opts)
