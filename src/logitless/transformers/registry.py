"""The supported transformers model classes: one row per class.

A row says where the class lives (``transformers.models.<module>.modeling_<module>``),
which logit transform its forward applies between the head and the loss (several where
transformers releases differ: the source check says which one the installed forward has), and, for
mixture-of-experts models, the expression of the router auxiliary-loss coefficient. The
source check (``source_check.py``) verifies each class's forward against its row, so a
row is a claim that is checked, never trusted: adding a family is one row plus one test.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Optional, Union

#: Logit transforms: name -> the forward's statements between ``logits = self.lm_head(...)``
#: and ``loss = None`` (normalised with ast.unparse before comparison).
TRANSFORM_CODE: dict[str, tuple[str, ...]] = {
    "none": (),
    "softcap": ("""
if self.config.final_logit_softcapping is not None:
    logits = logits / self.config.final_logit_softcapping
    logits = torch.tanh(logits)
    logits = logits * self.config.final_logit_softcapping
""",),
    "softcap_text": ("""
if (final_logit_softcapping := self.config.get_text_config().final_logit_softcapping) is not None:
    logits = logits / final_logit_softcapping
    logits = torch.tanh(logits)
    logits = logits * final_logit_softcapping
""",),
    # PaliGemma from transformers 5.23 (a Gemma 2 text config's cap; none before, whatever the config says)
    "softcap_text_getattr": (
        "final_logit_softcapping = getattr(self.config.get_text_config(), 'final_logit_softcapping', None)", """
if final_logit_softcapping is not None:
    logits = logits / final_logit_softcapping
    logits = torch.tanh(logits)
    logits = logits * final_logit_softcapping
"""),
    "cohere_scale": ("logits = logits * self.logit_scale",),
    "granite_scale": ("logits = logits / self.config.logits_scaling",),
}


@dataclasses.dataclass(frozen=True)
class Family:
    """One supported class: where it lives, its logit transform, its MoE auxiliary loss."""

    module: str  # transformers.models.<module>.modeling_<module>
    transform: Union[str, tuple[str, ...]] = "none"  # a key of TRANSFORM_CODE, or the keys of the releases' forms
    aux_coef: Optional[str] = None  # MoE: the coefficient expression in `loss += <aux_coef> * aux_loss...`
    kind: str = "causal-lm"  # causal-lm | moe | vision-language (documentation and refusal messages)

    @property
    def transforms(self) -> tuple[str, ...]:
        """The transforms a forward of this class may have (one per transformers release's form)."""
        return (self.transform,) if isinstance(self.transform, str) else self.transform

    def softcap_and_scale(self, model, transform: str) -> tuple[Optional[float], float]:
        """(soft-cap or None, scale s) such that logits = softcap(s * (x @ W.T + b)), for the
        ``transform`` (one of ``transforms``) that the class's forward has (``source_check.forward_transform``)."""
        if transform not in self.transforms:
            raise ValueError(f"{transform!r} is not one of this family's transforms {self.transforms}")
        if transform in ("softcap", "softcap_text"):
            cap = model.config.get_text_config().final_logit_softcapping
            return (None if cap is None else float(cap)), 1.0
        if transform == "softcap_text_getattr":
            cap = getattr(model.config.get_text_config(), "final_logit_softcapping", None)
            return (None if cap is None else float(cap)), 1.0
        if transform == "cohere_scale":
            return None, float(model.logit_scale)
        if transform == "granite_scale":
            return None, 1.0 / float(model.config.logits_scaling)
        return None, 1.0

    def router_aux_coef(self, model) -> Optional[float]:
        """The router auxiliary-loss coefficient (``self.router_aux_loss_coef`` ...) or None."""
        if self.aux_coef is None:
            return None
        return operator.attrgetter(self.aux_coef.removeprefix("self."))(model)


_MOE = dict(aux_coef="self.router_aux_loss_coef", kind="moe")
_VL = dict(kind="vision-language")

#: Supported classes (checked against transformers 5.17 and 5.23): class name -> family.
SUPPORTED: dict[str, Family] = {
    # dense causal LMs
    "LlamaForCausalLM": Family("llama"),
    "MistralForCausalLM": Family("mistral"),
    "Qwen2ForCausalLM": Family("qwen2"),
    "Qwen3ForCausalLM": Family("qwen3"),
    "GemmaForCausalLM": Family("gemma"),
    "Gemma2ForCausalLM": Family("gemma2", "softcap"),
    "Gemma3ForCausalLM": Family("gemma3", "softcap"),
    "Phi3ForCausalLM": Family("phi3"),
    "PhiForCausalLM": Family("phi"),
    "Olmo2ForCausalLM": Family("olmo2"),
    "GPT2LMHeadModel": Family("gpt2"),
    "CohereForCausalLM": Family("cohere", "cohere_scale"),
    "GraniteForCausalLM": Family("granite", "granite_scale"),
    "SmolLM3ForCausalLM": Family("smollm3"),
    "Gemma3nForCausalLM": Family("gemma3n", "softcap"),
    "Gemma4ForCausalLM": Family("gemma4", "softcap"),
    # mixture of experts (the router auxiliary loss is added as transformers does)
    "Qwen2MoeForCausalLM": Family("qwen2_moe", **_MOE),
    "Qwen3MoeForCausalLM": Family("qwen3_moe", **_MOE),
    "MixtralForCausalLM": Family("mixtral", **_MOE),
    "GptOssForCausalLM": Family("gpt_oss", **_MOE),
    "OlmoeForCausalLM": Family("olmoe", **_MOE),
    "GraniteMoeForCausalLM": Family("granitemoe", "granite_scale", **_MOE),
    "DeepseekV3ForCausalLM": Family("deepseek_v3", kind="moe"),  # no auxiliary loss in transformers
    "Llama4ForCausalLM": Family("llama4", kind="moe"),  # no auxiliary loss in transformers
    # vision-language: the language-model loss, every multimodal argument passed through
    "Qwen2VLForConditionalGeneration": Family("qwen2_vl", **_VL),
    "Qwen2_5_VLForConditionalGeneration": Family("qwen2_5_vl", **_VL),
    "Qwen3VLForConditionalGeneration": Family("qwen3_vl", **_VL),
    "Qwen3VLMoeForConditionalGeneration": Family(
        "qwen3_vl_moe", aux_coef="self.config.text_config.router_aux_loss_coef", kind="vision-language"),
    "Gemma3ForConditionalGeneration": Family("gemma3", **_VL),
    "Gemma4ForConditionalGeneration": Family("gemma4", "softcap_text", **_VL),
    "Gemma3nForConditionalGeneration": Family("gemma3n", "softcap_text", **_VL),
    "LlavaForConditionalGeneration": Family("llava", **_VL),
    "MllamaForConditionalGeneration": Family("mllama", **_VL),
    "Mistral3ForConditionalGeneration": Family("mistral3", **_VL),
    "PaliGemmaForConditionalGeneration": Family("paligemma", ("none", "softcap_text_getattr"), **_VL),
}

#: Classes people ask for that are not supported, with what to do instead.
ADVICE: dict[str, str] = {
    "Llama4ForConditionalGeneration": "its forward computes the logits through the language model's own "
    "head; patch its language model (model.language_model, a Llama4ForCausalLM) instead",
    "MllamaForCausalLM": "its forward casts the logits to float32 (`.float()`), a transform the patch does not "
    "know; patch the MllamaForConditionalGeneration that contains it",
}


def module_name(family: Family) -> str:
    return f"transformers.models.{family.module}.modeling_{family.module}"
