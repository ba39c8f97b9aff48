"""A patched HF model under DeepSpeed ZeRO-3, on the CPU (``DS_ACCELERATOR=cpu``, gloo).

Under ZeRO-3 every parameter is partitioned: outside its module's forward ``lm_head.weight``
is an empty placeholder (``numel() == 0``; ``ds_shape`` holds the real shape). The patch
reads the weight only inside the head's forward (after ZeRO-3's pre-forward hook gathered
it) and routes the loss's gradient through the head's output (ZeRO-3's pre-backward hook
gathers it again before the loss's backward reads it). Checked here in 1 and 2 processes,
with untied and tied embeddings, patched before ``deepspeed.initialize`` and after it (the
weight already partitioned at patch time): loss, every full gradient
(``safe_get_full_grad``) and the loss after one optimizer step equal the unpatched
ZeRO-3 model's, logits are never built, and logitless' loss ran on every forward.
"""

from __future__ import annotations

import copy
import importlib.util
import os
import sys
import tempfile

import pytest
import torch

_DS = [
    pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed is optional"),
    pytest.mark.skipif(sys.platform == "win32", reason="gloo on Windows is not set up here"),
]


def _worker(rank: int, world: int, store_path: str, tied: bool):
    os.environ["DS_ACCELERATOR"] = "cpu"
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    try:
        import deepspeed
        import transformers

        import logitless.transformers as lt
        import logitless.transformers.loss as lt_loss

        calls = []
        original = lt_loss.linear_cross_entropy

        def spy(x, weight, *args, **kwargs):
            calls.append(tuple(weight.shape))
            return original(x, weight, *args, **kwargs)

        lt_loss.linear_cross_entropy = spy
        torch.manual_seed(0)
        V, H = 97, 32
        cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)
        base = transformers.LlamaForCausalLM(cfg).float()
        ids = torch.randint(0, V, (2 * world, 12))
        labels = ids.clone()
        labels[0, :3] = -100
        mine = slice(2 * rank, 2 * rank + 2)
        ds_cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
                  "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
                  "zero_allow_untested_optimizer": True}

        def run(when):
            model = copy.deepcopy(base).train()
            if when == "before":
                lt.patch(model)
            engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
                                              config=ds_cfg)
            head = engine.module.lm_head
            assert hasattr(head.weight, "ds_id") and head.weight.numel() == 0  # partitioned outside the forward
            assert tuple(head.weight.ds_shape) == (V, H)
            if when == "after":
                lt.patch(engine.module)
            del calls[:]
            out = engine(input_ids=ids[mine], labels=labels[mine])
            assert (out.logits is None) == (when is not None)
            engine.backward(out.loss)
            grads = {n: deepspeed.utils.safe_get_full_grad(p).clone() for n, p in engine.module.named_parameters()}
            engine.step()
            loss2 = engine(input_ids=ids[mine], labels=labels[mine]).loss.detach()
            assert calls == ([(V, H)] * 2 if when is not None else [])  # the full weight, on both forwards
            return out.loss.detach(), grads, loss2

        ref = run(None)
        for when in ("before", "after"):
            loss, grads, loss2 = run(when)
            torch.testing.assert_close(loss, ref[0], rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(loss2, ref[2], rtol=1e-5, atol=1e-6)
            assert grads.keys() == ref[1].keys()
            for name, g in grads.items():
                torch.testing.assert_close(g, ref[1][name], rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")
    finally:
        dist.barrier()
        dist.destroy_process_group()


@_DS[0]
@_DS[1]
@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_zero3_patched_equals_unpatched(world, tied):
    pytest.importorskip("transformers")
    with tempfile.TemporaryDirectory(prefix="logitless-zero3-") as tmp:
        torch.multiprocessing.spawn(_worker, args=(world, os.path.join(tmp, "store"), tied), nprocs=world, join=True)


def test_trl_heads_refuse_a_zero3_weight():
    """logitless' TRL heads read the weight outside the head's forward: a ZeRO-3 parameter
    (one with ``ds_id``) is refused with the fix named, not read as an empty placeholder."""
    from logitless.integrations import trl as lt_trl

    weight = torch.nn.Parameter(torch.empty(0))
    weight.ds_id = 3
    with pytest.raises(ValueError, match="ZeRO-3.*TRL's own head"):
        lt_trl._refuse_zero3(weight, "logitless add_fused_lm_head")
    lt_trl._refuse_zero3(torch.nn.Parameter(torch.ones(2, 2)), "plain")  # no ds_id: nothing to refuse
