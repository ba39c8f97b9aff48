"""logitless.transformers.patch in the set-ups people train with.

torch.compile (before and after patching, fullgraph where the model allows), class and
Auto* patching (from_config, from_pretrained), copies (TRL's reference models), weight
gathering by forward pre-hooks (DeepSpeed ZeRO-3's mechanism), PEFT LoRA and
modules_to_save on the head, FSDP2 (2 CPU processes over gloo), ``causal_lm_loss`` for
trainers that run the backbone themselves. Tiny fp32 models on the CPU, compared with the
same model unpatched.
"""

from __future__ import annotations

import copy
import os
import sys
import tempfile

import pytest
import torch
import transformers

import logitless.transformers as lt
from logitless.transformers import loss as lt_loss

from .conftest import DEVICE
from .test_transformers import batch, tiny
from .test_transformers_families import assert_same, build
from .test_transformers_families import run as _run


def run(model, inputs, **kw):
    """(output, grads by parameter name); names without torch.compile's ``_orig_mod.`` prefix."""
    out, grads = _run(model, inputs, **kw)
    return out, {n.removeprefix("_orig_mod."): g for n, g in grads.items()}


def _inputs():
    ids, labels, mask = batch()
    return dict(input_ids=ids, attention_mask=mask), labels


class _GraphRecorder:
    """A torch.compile backend that records the traced graphs' targets and runs them as traced."""

    def __init__(self):
        self.graphs = []

    def __call__(self, gm, example_inputs):
        self.graphs.append({str(n.target) for n in gm.graph.nodes})
        return gm.forward


# ---------------------------------------------------------------------- torch.compile


@pytest.mark.parametrize("order", ["patch-then-compile", "compile-then-patch"])
@pytest.mark.parametrize("name", ["LlamaForCausalLM", "Gemma2ForCausalLM", "CohereForCausalLM"])
def test_compile_fullgraph(name, order):
    """One graph (fullgraph=True) holding the fused op and no vocabulary-sized matmul; same loss and grads."""
    torch._dynamo.reset()
    model = tiny(name)
    inputs, labels = _inputs()
    ref_out, ref_grads = run(model, inputs, labels=labels)
    rec = _GraphRecorder()
    if order == "patch-then-compile":
        compiled = torch.compile(lt.patch(model), backend=rec, fullgraph=True)
    else:
        compiled = lt.patch(torch.compile(model, backend=rec, fullgraph=True))
        assert lt.is_patched(model) and lt.is_patched(compiled)
    for _ in range(2):  # the second call reuses the graph
        out, grads = run(compiled, inputs, labels=labels)
        assert_same(out, grads, ref_out, ref_grads)
    assert len(rec.graphs) == 1, f"{len(rec.graphs)} graphs (a graph break or a recompilation)"
    assert any("logitless" in t for t in rec.graphs[0]), "the fused op is not in the compiled graph"
    # generation and eval still run (with logits) through the compiled model
    model.eval()
    torch.testing.assert_close(compiled(**inputs).logits, model(**inputs).logits)


def test_compile_inductor_and_gradient_checkpointing():
    """The default backend (inductor) on a checkpointed model: the same loss and grads."""
    torch._dynamo.reset()
    model = tiny("Qwen3ForCausalLM")
    model.gradient_checkpointing_enable()
    inputs, labels = _inputs()
    ref_out, ref_grads = run(model, inputs, labels=labels)
    ref_n = run(model, inputs, labels=labels, num_items_in_batch=torch.tensor(17))
    compiled = torch.compile(lt.patch(model))
    out, grads = run(compiled, inputs, labels=labels, num_items_in_batch=torch.tensor(17))
    assert_same(out, grads, *ref_n)
    out, grads = run(compiled, inputs, labels=labels)
    assert_same(out, grads, ref_out, ref_grads)


def test_compile_moe_and_vision_language():
    """MoE (router loss) and a VL model compiled (graph breaks allowed: their own code has data-dependent shapes)."""
    for name in ("Qwen3MoeForCausalLM", "Qwen2VLForConditionalGeneration"):
        torch._dynamo.reset()
        model, inputs, labels = build(name)
        if name.startswith("Qwen3Moe"):
            model.config._experts_implementation = "eager"  # (grouped_mm's CPU fallback does not compile)
        ref = run(model, inputs, labels=labels)
        out, grads = run(torch.compile(lt.patch(model), backend="aot_eager"), inputs, labels=labels)
        assert_same(out, grads, *ref)


# ---------------------------------------------------------------------- classes, Auto*, copies


def test_class_and_auto_patching(tmp_path):
    cls = transformers.LlamaForCausalLM
    cfg = transformers.LlamaConfig(**dict(tiny("LlamaForCausalLM").config.to_dict()))
    inputs, labels = _inputs()
    torch.manual_seed(0)
    ref_model = cls(cfg).to(DEVICE)
    ref_model.save_pretrained(tmp_path)
    ref = run(ref_model, inputs, labels=labels)
    own_init = vars(cls)["__init__"]
    try:
        assert lt.patch(cls, memory_budget=2**20) is cls and lt.is_patched(cls)
        for make in (lambda: cls.from_pretrained(tmp_path),
                     lambda: transformers.AutoModelForCausalLM.from_pretrained(tmp_path)):
            model = make().to(DEVICE).train()
            assert lt.is_patched(model) and vars(model)["_logitless_patch"].options == {"memory_budget": 2**20}
            assert_same(*run(model, inputs, labels=labels), *ref)

        class MyLlama(cls):  # subclasses are not patched (their forward may differ)
            pass

        assert not lt.is_patched(MyLlama(cfg))
        lt.unpatch(cls)
        assert not lt.is_patched(cls) and vars(cls)["__init__"] is own_init
        assert not lt.is_patched(cls(cfg))
        assert lt.is_patched(model)  # instances created while patched stay patched: lt.unpatch(model)

        auto = transformers.AutoModelForCausalLM
        lt.patch(auto)
        assert lt.is_patched(auto) and lt.is_patched(transformers.Qwen3MoeForCausalLM)
        model = auto.from_config(cfg).to(DEVICE).train()
        assert lt.is_patched(model) and run(model, inputs, labels=labels)[0].logits is None
        lt.unpatch(auto)
        assert not lt.is_patched(auto.from_config(cfg))
        assert not lt.is_patched(transformers.MixtralForCausalLM)
    finally:
        lt.unpatch(transformers.AutoModelForCausalLM)
        lt.unpatch(cls)


def test_deepcopy_is_an_independent_patched_model():
    """TRL makes reference models with copy.deepcopy: the copy uses its own head and state."""
    model = lt.patch(tiny("LlamaForCausalLM", tie_word_embeddings=False))
    inputs, labels = _inputs()
    twin = copy.deepcopy(model)
    assert lt.is_patched(twin)
    with torch.no_grad():
        twin.lm_head.weight.mul_(1.5)
    out = run(twin, inputs, labels=labels)
    lt.unpatch(twin)
    assert_same(*out, *run(twin, inputs, labels=labels))
    assert abs(model(**inputs, labels=labels).loss.item() - out[0].loss.item()) > 1e-3


def test_new_head_after_patch_resize_token_embeddings():
    """resize_token_embeddings after patching replaces the head module: the new one is used."""
    model = lt.patch(tiny("MistralForCausalLM"))
    model.resize_token_embeddings(1013)
    inputs, labels = _inputs()
    out = run(model, inputs, labels=labels)
    lt.unpatch(model)
    assert "forward" not in vars(model.lm_head)
    ref = run(model, inputs, labels=labels)
    assert ref[0].logits.shape[-1] == 1013
    assert_same(*out, *ref)


# ---------------------------------------------------------------------- weight gathering hooks


def test_head_weight_is_read_after_forward_pre_hooks():
    """DeepSpeed ZeRO-3's mechanism, registered after patch: a forward pre-hook materialises the weight,
    a forward hook frees it and wraps the outputs so that their backward materialises it again."""
    model = tiny("MistralForCausalLM")  # untied head
    inputs, labels = _inputs()
    ref = run(model, inputs, labels=labels)
    lt.patch(model)
    head = model.lm_head
    full = head.weight.detach().clone()
    events = []

    def gather(module, args):
        events.append("gather")
        module.weight.data = full

    class RegatherInBackward(torch.autograd.Function):  # ZeRO-3's PreBackwardFunction on the outputs
        @staticmethod
        def forward(ctx, output):
            return output.view_as(output)

        @staticmethod
        def backward(ctx, grad):
            gather(head, ())
            return grad

    def release(module, args, output):
        events.append("release")
        module.weight.data = torch.empty(0, device=full.device)
        return RegatherInBackward.apply(output)

    head.weight.data = torch.empty(0, device=full.device)  # partitioned: nothing to read outside the forward
    handles = [head.register_forward_pre_hook(gather), head.register_forward_hook(release)]
    try:
        out, grads = run(model, inputs, labels=labels)
    finally:
        for h in handles:
            h.remove()
    assert events == ["gather", "release", "gather"]  # the backward re-gathered before the loss's backward
    assert_same(out, grads, *ref)


# ---------------------------------------------------------------------- PEFT on the head


@pytest.mark.filterwarnings("ignore:Model has `tie_word_embeddings=True`")
@pytest.mark.parametrize("dropout", [0.0, 0.25])
def test_lora_on_the_head(dropout):
    import peft

    base = tiny("MistralForCausalLM")
    inputs, labels = _inputs()
    cfg = peft.LoraConfig(r=4, target_modules=["lm_head", "q_proj"], lora_dropout=dropout, init_lora_weights=False)
    model = peft.get_peft_model(copy.deepcopy(base), cfg).train()
    torch.manual_seed(7)
    ref = run(model, inputs, labels=labels)
    assert any("lm_head.lora_B" in n for n in ref[1])
    lt.patch(model)
    torch.manual_seed(7)  # the same dropout masks: the head's dropout is drawn at the same point
    assert_same(*run(model, inputs, labels=labels), *ref)

    # LoRA added to the head after patching: picked up on the next call
    model = lt.patch(copy.deepcopy(base))
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["lm_head"], init_lora_weights=False))
    model.train()
    out = run(model, inputs, labels=labels)
    lt.unpatch(model)
    assert_same(*out, *run(model, inputs, labels=labels))

    # DoRA: refused with the reason
    model = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(r=4, target_modules=["lm_head"], use_dora=True))
    with pytest.raises(ValueError, match="LoRA variant"):
        lt.patch(model)


def test_modules_to_save_head():
    import peft

    base = tiny("MistralForCausalLM")
    inputs, labels = _inputs()
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=["lm_head"]))
    model.train()
    with torch.no_grad():  # the trainable copy differs from the original head
        model.base_model.model.lm_head.modules_to_save["default"].weight.mul_(1.25)
    ref = run(model, inputs, labels=labels)
    assert any("modules_to_save" in n and "lm_head" in n for n in ref[1])
    lt.patch(model)
    assert_same(*run(model, inputs, labels=labels), *ref)


# ---------------------------------------------------------------------- causal_lm_loss


@pytest.mark.parametrize("patched", [False, True])
def test_causal_lm_loss_from_hidden_states(patched, monkeypatch):
    """The loss (and per-token log-probs at a temperature) from the backbone's output, for trainers."""
    model = tiny("Gemma2ForCausalLM")  # soft-capped
    inputs, labels = _inputs()
    ref = model(**inputs, labels=labels)
    calls = []
    real = lt_loss.linear_cross_entropy
    monkeypatch.setattr(lt_loss, "linear_cross_entropy", lambda *a, **k: calls.append(k) or real(*a, **k))
    if patched:
        lt.patch(model)
    hidden = model.model(**inputs).last_hidden_state
    loss = lt.causal_lm_loss(model, hidden, labels)
    torch.testing.assert_close(loss, ref.loss, rtol=1e-5, atol=1e-5)
    t = 0.7
    per_token = lt.causal_lm_loss(model, hidden, labels, temperature=t, reduction="none")
    logits = ref.logits / t  # transformers' soft-capped logits at temperature t
    target = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=-100)
    expected = torch.nn.functional.cross_entropy(logits.transpose(1, 2), target, reduction="none")
    torch.testing.assert_close(per_token, expected, rtol=1e-5, atol=1e-5)
    assert [k["reduction"] for k in calls] == ["mean", "none"]
    with pytest.raises(ValueError, match="temperature"):
        lt.causal_lm_loss(model, hidden, labels, temperature=0.0)


# ---------------------------------------------------------------------- FSDP2

WORLD = 2


def _fsdp_worker(rank: int, store_path: str, order: str):
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.FileStore(store_path, WORLD), rank=rank, world_size=WORLD)
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        model = tiny("MistralForCausalLM").cpu()
        ref = copy.deepcopy(model)
        mesh = init_device_mesh("cpu", (WORLD,))
        if order == "patch-then-shard":
            lt.patch(model)
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model.lm_head, mesh=mesh)  # the head its own unit: its weight is gathered in its forward
        fully_shard(model, mesh=mesh)
        if order == "shard-then-patch":
            assert type(model).__name__ == "FSDPMistralForCausalLM"
            lt.patch(model)
        ids, labels, mask = (t.cpu() for t in batch(b=4))
        mine = slice(rank * 2, rank * 2 + 2)
        n_items = torch.tensor(int((labels[:, 1:] != -100).sum()))  # the global count, as Trainer passes
        out = model(input_ids=ids[mine], attention_mask=mask[mine], labels=labels[mine], num_items_in_batch=n_items)
        assert out.logits is None
        out.loss.backward()
        total = out.loss.detach().clone()
        dist.all_reduce(total)
        ref_loss = sum(ref(input_ids=ids[r * 2:r * 2 + 2], attention_mask=mask[r * 2:r * 2 + 2],
                           labels=labels[r * 2:r * 2 + 2], num_items_in_batch=n_items).loss for r in range(WORLD))
        ref_loss.backward()
        torch.testing.assert_close(total, ref_loss.detach(), rtol=1e-5, atol=1e-6)
        for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
            grad = p.grad.full_tensor() * WORLD  # FSDP averages the gradients over the ranks
            torch.testing.assert_close(grad, q.grad, rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")
    finally:
        dist.barrier()
        dist.destroy_process_group()


@pytest.mark.skipif(sys.platform == "win32", reason="gloo on Windows is not set up here")
@pytest.mark.parametrize("order", ["patch-then-shard", "shard-then-patch"])
def test_fsdp2_sharded_layers_and_head(order):
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("needs torch.distributed with gloo")
    from torch.distributed import fsdp

    if not hasattr(fsdp, "fully_shard"):
        pytest.skip("FSDP2 (fully_shard) needs torch >= 2.6")
    with tempfile.TemporaryDirectory(prefix="logitless-fsdp-") as tmp:  # a file, not a racy free port
        torch.multiprocessing.spawn(_fsdp_worker, args=(os.path.join(tmp, "store"), order), nprocs=WORLD, join=True)
