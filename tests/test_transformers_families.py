"""logitless.transformers.patch on mixture-of-experts and vision-language families.

Tiny random models built from configs offline (fp32, CPU), compared with the same model
unpatched: the loss (router auxiliary loss included, ``output_router_logits=True``, a
coefficient that is not the default) and every parameter's gradient (vision towers
included: the images reach the language model through the patched forward), with labels
containing -100, the mean and ``num_items_in_batch``. A family is one registry row plus
one entry here; ``test_every_supported_class_is_tested`` keeps the two in step.
"""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
import unittest.mock

import pytest
import torch
import transformers

import logitless.transformers as lt
from logitless.transformers import loss as lt_loss

from .conftest import DEVICE
from .test_transformers import FAMILIES as DENSE

V, H = 1000, 64
IMG = V - 1  # the image token id of the vision-language configs
TEXT = dict(vocab_size=V, hidden_size=H, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=2)
ROUTER = dict(output_router_logits=True, router_aux_loss_coef=0.37)
GEMMA_N = dict(head_dim=16, vocab_size_per_layer_input=V, hidden_size_per_layer_input=8, num_kv_shared_layers=0,
               laurel_rank=4, altup_num_inputs=2, intermediate_size=[128, 128],
               layer_types=["sliding_attention", "full_attention"], activation_sparsity_pattern=[0.0, 0.0])

#: MoE (and other causal-LM) classes: class name -> (config class, config kwargs).
MOE = {
    "Qwen2MoeForCausalLM": ("Qwen2MoeConfig", dict(TEXT, moe_intermediate_size=32, shared_expert_intermediate_size=32,
                                                   num_experts=4, num_experts_per_tok=2, **ROUTER)),
    "Qwen3MoeForCausalLM": ("Qwen3MoeConfig", dict(TEXT, head_dim=16, moe_intermediate_size=32, num_experts=4,
                                                   num_experts_per_tok=2, **ROUTER)),
    "MixtralForCausalLM": ("MixtralConfig", dict(TEXT, num_local_experts=4, num_experts_per_tok=2, **ROUTER)),
    "GptOssForCausalLM": ("GptOssConfig", dict(TEXT, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                                               sliding_window=8, **ROUTER)),
    "OlmoeForCausalLM": ("OlmoeConfig", dict(TEXT, num_experts=4, num_experts_per_tok=2, **ROUTER)),
    # (transformers 5.17's GraniteMoe itself fails with output_router_logits=True: its router
    # logits are not collected; the scale is what this row exercises)
    "GraniteMoeForCausalLM": ("GraniteMoeConfig", dict(TEXT, num_local_experts=4, num_experts_per_tok=2,
                                                       logits_scaling=3.0)),
    "DeepseekV3ForCausalLM": ("DeepseekV3Config", dict(
        TEXT, num_key_value_heads=4, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2, n_group=1,
        topk_group=1, first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8,
        qk_nope_head_dim=8, v_head_dim=16)),
    "Llama4ForCausalLM": ("Llama4TextConfig", dict(TEXT, head_dim=16, intermediate_size_mlp=128, num_local_experts=4,
                                                   num_experts_per_tok=1, **ROUTER)),
    "SmolLM3ForCausalLM": ("SmolLM3Config", dict(TEXT)),
    "Gemma3nForCausalLM": ("Gemma3nTextConfig", dict(TEXT, final_logit_softcapping=0.5, **GEMMA_N)),
    "Gemma4ForCausalLM": ("Gemma4TextConfig", dict(TEXT, head_dim=16, final_logit_softcapping=0.5)),
}


def _ids(n_image_tokens, t, seed=3):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, V - 10, (2, t), generator=g)
    ids[:, 2:2 + n_image_tokens] = IMG
    return ids, g


def _qwen_images(grid=(1, 4, 4), merge=2, patch=4, temporal=2, t=13):
    n_patch = grid[0] * grid[1] * grid[2]
    ids, g = _ids(n_patch // merge ** 2, t)
    pixels = torch.randn(2 * n_patch, 3 * temporal * patch * patch, generator=g)
    return dict(pixel_values=pixels, image_grid_thw=torch.tensor([list(grid)] * 2),
                mm_token_type_ids=(ids == IMG).long()), ids


def _square_images(n_image_tokens, t=24, size=16):
    ids, g = _ids(n_image_tokens, t)
    return dict(pixel_values=torch.randn(2, 3, size, size, generator=g)), ids


QWEN_TEXT = dict(TEXT, rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=[4, 2, 2]))
QWEN_VISION = dict(hidden_size=32, intermediate_size=64, num_heads=2, patch_size=4, spatial_merge_size=2,
                   temporal_patch_size=2, out_hidden_size=H)
QWEN_IDS = dict(image_token_id=IMG, video_token_id=V - 2, vision_start_token_id=V - 3)
SIGLIP = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=16,
              patch_size=4)


def _qwen3_vl(moe):
    text = dict(QWEN_TEXT, head_dim=16)
    text["rope_parameters"] = dict(text["rope_parameters"], mrope_interleaved=True)
    if moe:
        text.update(moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.37,
                    decoder_sparse_step=1)
    cls = transformers.Qwen3VLMoeConfig if moe else transformers.Qwen3VLConfig
    cfg = cls(text_config=text, vision_config=dict(QWEN_VISION, depth=2, num_position_embeddings=16,
                                                   deepstack_visual_indexes=[0]), **QWEN_IDS)
    inputs, ids = _qwen_images()
    if moe:
        inputs["output_router_logits"] = True
    return cfg, inputs, ids


def _mllama():
    cfg = transformers.MllamaConfig(
        text_config=dict(TEXT, cross_attention_layers=[1]), image_token_index=IMG,
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_global_layers=1,
                           attention_heads=2, image_size=16, patch_size=4, max_num_tiles=1, vision_output_dim=64,
                           intermediate_layers_indices=[0], supported_aspect_ratios=[[1, 1]]))
    ids, g = _ids(1, 13)
    return cfg, dict(pixel_values=torch.randn(2, 1, 1, 3, 16, 16, generator=g),
                     aspect_ratio_ids=torch.ones(2, 1, dtype=torch.long),
                     aspect_ratio_mask=torch.ones(2, 1, 1, dtype=torch.long),
                     cross_attention_mask=torch.ones(2, 13, 1, 1, dtype=torch.long)), ids


def _mistral3():
    cfg = transformers.Mistral3Config(
        text_config=dict(TEXT, model_type="mistral", head_dim=16), image_token_index=IMG, spatial_merge_size=2,
        vision_feature_layer=-1, vision_config=dict(SIGLIP, head_dim=16, model_type="pixtral"))
    inputs, ids = _square_images(4, t=13)
    inputs["image_sizes"] = torch.tensor([[16, 16]] * 2)
    return cfg, inputs, ids


def _gemma3n():
    """Gemma-3n with text and audio inputs (the audio tower is transformers' own; its vision
    tower is a timm model: not given images here, see _towers). Multimodal ids live at the
    top of the text vocabulary as in the real model: vision [V-256, V-128), audio [V-128, V)."""
    cfg = transformers.Gemma3nConfig(
        text_config=dict(TEXT, final_logit_softcapping=0.5, **GEMMA_N),
        vision_config=dict(hidden_size=32, vocab_offset=V - 256),
        audio_config=dict(hidden_size=32, vocab_offset=V - 128, conf_num_hidden_layers=1, conf_num_attention_heads=2,
                          sscp_conv_channel_size=[8, 4], input_feat_size=16),
        audio_soft_tokens_per_image=4, image_token_id=V - 255, boi_token_id=V - 254, eoi_token_id=V - 253,
        audio_token_id=IMG, boa_token_id=V - 126, eoa_token_id=V - 125)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, V - 256, (2, 13), generator=g)
    ids[:, 3:7] = IMG  # 4 audio soft tokens
    inputs = dict(input_features=torch.randn(2, 16, 16, generator=g),
                  input_features_mask=torch.ones(2, 16, dtype=torch.bool))
    return cfg, inputs, ids


@contextlib.contextmanager
def _towers(name):
    """Gemma-3n's vision tower is a timm model; where timm is missing (CI: timm needs
    torchvision) a placeholder module stands in for it. Nothing here passes images, so the
    tower is never called; on a machine with timm (the GPU machine) the real one is built."""
    if name != "Gemma3nForConditionalGeneration" or importlib.util.find_spec("timm") is not None:
        yield
        return
    from transformers.models.gemma3n import modeling_gemma3n as mg

    real = mg.AutoModel.from_config

    class NoImages(torch.nn.Module):
        def forward(self, *args, **kwargs):
            raise AssertionError("the placeholder vision tower was called")

    def from_config(config, **kwargs):
        return NoImages() if type(config).__name__ == "Gemma3nVisionConfig" else real(config, **kwargs)

    with unittest.mock.patch.object(mg.AutoModel, "from_config", side_effect=from_config):
        yield


#: Vision-language classes: class name -> () -> (config, multimodal inputs, input_ids).
VISION_LANGUAGE = {
    "Gemma3nForConditionalGeneration": _gemma3n,
    "Qwen2VLForConditionalGeneration": lambda: (transformers.Qwen2VLConfig(
        text_config=QWEN_TEXT, vision_config=dict(depth=1, embed_dim=32, hidden_size=H, num_heads=2, patch_size=4,
                                                  spatial_merge_size=2, temporal_patch_size=2), **QWEN_IDS),
        *_qwen_images()),
    "Qwen2_5_VLForConditionalGeneration": lambda: (transformers.Qwen2_5_VLConfig(
        text_config=QWEN_TEXT, vision_config=dict(QWEN_VISION, depth=2, window_size=8, fullatt_block_indexes=[1]),
        **QWEN_IDS), *_qwen_images()),
    "Qwen3VLForConditionalGeneration": lambda: _qwen3_vl(False),
    "Qwen3VLMoeForConditionalGeneration": lambda: _qwen3_vl(True),
    "Gemma3ForConditionalGeneration": lambda: (transformers.Gemma3Config(
        text_config=dict(TEXT, head_dim=16), vision_config=SIGLIP, mm_tokens_per_image=4, image_token_index=IMG,
        boi_token_index=V - 2, eoi_token_index=V - 3), *_square_images(4)),
    # (text-only inputs: the tiny Gemma 4 vision tower is not set up here; the class's forward is checked)
    "Gemma4ForConditionalGeneration": lambda: (transformers.Gemma4Config(
        text_config=dict(TEXT, head_dim=16, final_logit_softcapping=0.5), image_token_id=IMG,
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                           head_dim=16, patch_size=4)), {}, _ids(0, 13)[0]),
    "LlavaForConditionalGeneration": lambda: (transformers.LlavaConfig(
        text_config=dict(TEXT, model_type="llama"), image_token_index=IMG, vision_feature_layer=-1,
        vision_feature_select_strategy="default", vision_config=dict(SIGLIP, model_type="clip_vision_model",
                                                                     projection_dim=32)), *_square_images(16)),
    "PaliGemmaForConditionalGeneration": lambda: (transformers.PaliGemmaConfig(
        text_config=dict(TEXT, model_type="gemma", head_dim=16), vision_config=dict(SIGLIP, projection_dim=H),
        image_token_index=IMG, projection_dim=H, hidden_size=H), *_square_images(16)),
    "Mistral3ForConditionalGeneration": _mistral3,
    "MllamaForConditionalGeneration": _mllama,
}


def build(name, seed=0):
    """(model, inputs without labels, labels) for a MoE or vision-language class."""
    if name in MOE:
        cfg_name, kwargs = MOE[name]
        cfg = getattr(transformers, cfg_name)(**kwargs)
        g = torch.Generator().manual_seed(1)
        ids = torch.randint(3, V, (2, 13), generator=g)
        inputs = {}
    else:
        cfg, inputs, ids = VISION_LANGUAGE[name]()
    torch.manual_seed(seed)
    with _towers(name):
        model = getattr(transformers, name)(cfg).to(DEVICE).train()
    labels = ids.clone()
    labels[0, :4] = -100  # a prompt
    labels[1, -3:] = -100  # padding
    labels[labels == IMG] = -100  # image positions
    mask = torch.ones_like(ids)
    mask[1, -3:] = 0
    inputs = {k: v.to(DEVICE) if torch.is_tensor(v) else v for k, v in inputs.items()}
    return model, dict(inputs, input_ids=ids.to(DEVICE), attention_mask=mask.to(DEVICE)), labels.to(DEVICE)


def run(model, inputs, **kw):
    model.zero_grad(set_to_none=True)
    out = model(**inputs, **kw)
    out.loss.backward()
    return out, {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_same(out, grads, ref_out, ref_grads, tol=1e-5):
    """Patched (logits None) == unpatched: the loss to ``tol``, each gradient to ``tol`` of its scale."""
    assert out.logits is None and ref_out.logits is not None
    torch.testing.assert_close(out.loss, ref_out.loss, rtol=tol, atol=tol)
    assert grads.keys() == ref_grads.keys()
    for n, r in ref_grads.items():
        err = (grads[n] - r).abs().max().item()
        assert err <= tol * max(1.0, r.abs().max().item()), f"{n}: max |diff| {err:.3g}"


def test_every_supported_class_is_tested():
    assert set(lt.SUPPORTED) == set(DENSE) | set(MOE) | set(VISION_LANGUAGE)
    kinds = {name: family.kind for name, family in lt.SUPPORTED.items()}
    assert all(kinds[n] == "vision-language" for n in VISION_LANGUAGE)
    with_aux = {"Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "MixtralForCausalLM", "GptOssForCausalLM",
                "OlmoeForCausalLM", "GraniteMoeForCausalLM", "Qwen3VLMoeForConditionalGeneration"}
    assert {n for n, f in lt.SUPPORTED.items() if f.aux_coef} == with_aux


@pytest.mark.parametrize("name", list(MOE) + list(VISION_LANGUAGE))
def test_family_matches_unpatched(name, monkeypatch):
    """Loss (aux loss included) and every gradient equal unpatched to 1e-5; the op is really called."""
    model, inputs, labels = build(name)
    n_items = torch.tensor(int((labels[:, 1:] != -100).sum()) + 5, device=DEVICE)
    cases = [dict(labels=labels), dict(labels=labels, num_items_in_batch=n_items)]
    refs = [run(model, inputs, **c) for c in cases]
    aux = getattr(refs[0][0], "aux_loss", None)
    if lt.SUPPORTED[name].aux_coef and (inputs.get("output_router_logits") or model.config.get_text_config()
                                        .to_dict().get("output_router_logits")):
        assert aux is not None and aux.requires_grad  # the router loss is part of what is compared
    calls = []
    real = lt_loss.linear_cross_entropy
    monkeypatch.setattr(lt_loss, "linear_cross_entropy", lambda *a, **k: calls.append(k) or real(*a, **k))
    assert lt.patch(model) is model and lt.is_patched(model)
    for c, (ref_out, ref_grads) in zip(cases, refs):
        out, grads = run(model, inputs, **c)
        assert type(out) is type(ref_out)
        assert_same(out, grads, ref_out, ref_grads)
        if aux is not None:
            torch.testing.assert_close(out.aux_loss, ref_out.aux_loss)
    assert [k["reduction"] for k in calls] == ["mean", "sum"]


def test_paligemma2_softcap_as_the_installed_forward():
    """PaliGemma 2 (a Gemma 2 text config with a soft-cap): transformers 5.23's forward caps the
    logits, 5.17's does not (whatever the config says); the patch computes what the installed one does."""
    from logitless.transformers import source_check

    cfg = transformers.PaliGemmaConfig(
        text_config=dict(TEXT, model_type="gemma2", head_dim=16, final_logit_softcapping=0.5),
        vision_config=dict(SIGLIP, projection_dim=H), image_token_index=IMG, projection_dim=H, hidden_size=H)
    images, ids = _square_images(16)
    torch.manual_seed(0)
    model = transformers.PaliGemmaForConditionalGeneration(cfg).to(DEVICE).train()
    labels = ids.clone()
    labels[0, :4] = -100
    labels[labels == IMG] = -100
    inputs = dict(pixel_values=images["pixel_values"].to(DEVICE), input_ids=ids.to(DEVICE))
    labels = labels.to(DEVICE)
    capped = "final_logit_softcapping" in inspect.getsource(type(model).forward)
    transform = source_check.forward_transform(type(model))
    family = lt.SUPPORTED["PaliGemmaForConditionalGeneration"]
    assert family.softcap_and_scale(model, transform) == ((0.5 if capped else None), 1.0)
    ref = run(model, inputs, labels=labels)
    lt.patch(model)
    assert_same(*run(model, inputs, labels=labels), *ref)


@pytest.mark.parametrize("name", ["Qwen3MoeForCausalLM", "MixtralForCausalLM"])
def test_moe_aux_loss_off_and_per_call(name):
    """output_router_logits off in the config, on per call: as transformers in both cases."""
    model, inputs, labels = build(name)
    model.config.output_router_logits = False
    ref_off = run(model, inputs, labels=labels)
    ref_on = run(model, inputs, labels=labels, output_router_logits=True)
    assert ref_off[0].aux_loss is None and ref_on[0].aux_loss is not None
    assert abs(ref_on[0].loss.item() - ref_off[0].loss.item()) > 1e-3  # the aux term is visible
    lt.patch(model)
    assert_same(*run(model, inputs, labels=labels), *ref_off)
    assert_same(*run(model, inputs, labels=labels, output_router_logits=True), *ref_on)


def test_moe_source_check_needs_the_aux_row(monkeypatch):
    """A MoE forward whose row forgets the auxiliary loss is refused (the loss would silently lose it)."""
    import dataclasses

    from logitless.transformers import source_check

    row = lt.SUPPORTED["MixtralForCausalLM"]
    monkeypatch.setitem(lt.SUPPORTED, "MixtralForCausalLM", dataclasses.replace(row, aux_coef=None))
    source_check.check_forward_source.cache_clear()
    try:
        model, _, _ = build("MixtralForCausalLM")
        with pytest.raises(ValueError, match="aux_loss"):
            lt.patch(model)
        monkeypatch.setitem(lt.SUPPORTED, "MixtralForCausalLM", dataclasses.replace(row, aux_coef="self.other_coef"))
        source_check.check_forward_source.cache_clear()
        with pytest.raises(ValueError, match="other_coef"):
            lt.patch(model)
    finally:
        source_check.check_forward_source.cache_clear()


@pytest.mark.parametrize("name", ["Qwen2VLForConditionalGeneration", "Gemma3ForConditionalGeneration",
                                  "Qwen3MoeForCausalLM"])
def test_generation_and_eval_unchanged(name):
    model, inputs, labels = build(name)
    model.config.output_router_logits = False  # (transformers' own generate fails with it on: a cache/mask shape)
    model.eval()
    ref = model(**inputs, labels=labels)
    kw = dict(max_new_tokens=5, do_sample=False, pad_token_id=0)
    before = model.generate(**inputs, **kw)
    lt.patch(model)
    out = model(**inputs, labels=labels)  # eval: logits for metrics
    torch.testing.assert_close(out.logits, ref.logits)
    torch.testing.assert_close(out.loss, ref.loss)
    assert torch.equal(model.generate(**inputs, **kw), before)


def test_unsupported_class_says_what_to_do():
    cfg = transformers.BloomConfig(vocab_size=V, hidden_size=H, n_layer=1, n_head=4)
    with pytest.raises(ValueError, match="BloomForCausalLM is not a supported model class.*registry row"):
        lt.patch(transformers.BloomForCausalLM(cfg))
    with pytest.raises(ValueError, match="Llama4ForConditionalGeneration is not supported: .*language_model"):
        lt.patch(transformers.Llama4ForConditionalGeneration)
