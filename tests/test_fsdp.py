"""linear_cross_entropy with an FSDP2 (``fully_shard``) LM head: 2 CPU processes over gloo.

Data parallel over 2 ranks, each with half of the batch; the loss and the gathered
gradients must equal a single-process model's on the same halves (mean of the two
losses). Three set-ups:

- ``root``: only the root module is sharded; inside its forward the head weight is a
  plain (unsharded) tensor: works.
- ``head-sharded``: the head is its own FSDP unit; reading ``head.weight`` in the root's
  forward gives the sharded DTensor: one clear TypeError naming the fix.
- ``registered``: the fix: the loss is a method of the head, registered with
  ``register_fsdp_forward_method``, so FSDP unshards the weight around it: works.
"""

from __future__ import annotations

import copy
import sys

import pytest
import torch
import torch.distributed as dist

import logitless
from tests._distributed import spawn

WORLD = 2
V, H = 37, 16

pytestmark = pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed with gloo"
)


class Head(torch.nn.Linear):
    def loss(self, h, labels):
        return logitless.linear_cross_entropy(h, self.weight, labels, shift=True, z_loss=1e-3)


class LM(torch.nn.Module):
    def __init__(self, use_method: bool):
        super().__init__()
        self.emb = torch.nn.Embedding(V, H)
        self.mix = torch.nn.Linear(H, H)
        self.head = Head(H, V, bias=False)
        self.use_method = use_method

    def forward(self, ids, labels):
        h = torch.tanh(self.mix(self.emb(ids)))
        if self.use_method:
            return self.head.loss(h, labels)
        return logitless.linear_cross_entropy(h, self.head.weight, labels, shift=True, z_loss=1e-3)


def _batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, V, (2 * WORLD, 7), generator=g)
    labels = ids.clone()
    labels[0, 3] = -100
    return ids, labels


def _worker(rank: int, world: int, device, setup: str):
    """One rank (gloo on the CPU: ``spawn`` sets up and tears down the group)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

    torch.manual_seed(0)
    model = LM(use_method=setup == "registered")
    ref = copy.deepcopy(model)
    mesh = init_device_mesh("cpu", (WORLD,))
    if setup != "root":
        fully_shard(model.head, mesh=mesh)
    if setup == "registered":
        register_fsdp_forward_method(model.head, "loss")
    fully_shard(model, mesh=mesh)

    ids, labels = _batch()
    half = ids.shape[0] // WORLD
    mine = slice(rank * half, (rank + 1) * half)
    if setup == "head-sharded":
        try:
            model(ids[mine], labels[mine])
        except TypeError as e:
            assert "DTensor" in str(e) and "register_fsdp_forward_method" in str(e), str(e)
        else:
            raise AssertionError("a sharded DTensor weight did not raise")
        # The weight outside any forward is the sharded DTensor too: same error.
        h = torch.randn(2, 3, H)
        try:
            logitless.linear_cross_entropy(h, model.head.weight, labels[:2, :3])
        except TypeError as e:
            assert "DTensor" in str(e)
        else:
            raise AssertionError("a sharded DTensor weight did not raise")
        return

    loss = model(ids[mine], labels[mine])
    loss.backward()
    mean_loss = loss.detach().clone()
    dist.all_reduce(mean_loss)
    mean_loss /= WORLD

    ref_losses = [ref(ids[r * half:(r + 1) * half], labels[r * half:(r + 1) * half]) for r in range(WORLD)]
    ref_loss = sum(ref_losses) / WORLD
    ref_loss.backward()
    torch.testing.assert_close(mean_loss, ref_loss.detach(), rtol=1e-5, atol=1e-6)
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        torch.testing.assert_close(grad, q.grad, rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")


@pytest.mark.skipif(sys.platform == "win32", reason="gloo on Windows is not set up here")
@pytest.mark.parametrize("setup", ["root", "head-sharded", "registered"])
def test_fsdp2_head(setup):
    pytest.importorskip("torch.distributed.fsdp", reason="FSDP2 (fully_shard) needs torch >= 2.6")
    from torch.distributed import fsdp

    if not hasattr(fsdp, "fully_shard") or not hasattr(fsdp, "register_fsdp_forward_method"):
        pytest.skip("FSDP2 (fully_shard, register_fsdp_forward_method) needs torch >= 2.6")
    spawn(_worker, WORLD, setup, backend="gloo")


# ---- logitless.transformers.patch under FSDP2: each layout of the head ----------------------
#
# The patched head computes the loss inside its own forward and the backward runs in the
# model's autograd pass, so FSDP2's hooks see an ordinary forward and backward: no inner
# backward, no setting changed. Checked against the unpatched model in each layout of the head
# (its own unit under the model's root, a group with the final norm, its own root, the root's
# group) and reshard_after_forward: the loss, every gradient (never None), and as many
# all-gathers of the head as the unpatched model does.


def _patch_worker(rank: int, world: int, device, layouts):
    import contextlib

    import transformers  # noqa: F401  (the test skips without it)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group as pg
    from torch.distributed.tensor import DTensor

    import logitless.transformers as lt
    from tests.test_transformers import batch, tiny

    mesh = init_device_mesh("cpu", (world,))

    @contextlib.contextmanager
    def head_gathers(weight):
        counts = [0]
        real = pg.foreach_all_gather

        def counting(fsdp_params, *a, **k):
            counts[0] += any(p.sharded_param is weight for p in fsdp_params)
            return real(fsdp_params, *a, **k)

        pg.foreach_all_gather = counting
        try:
            yield counts
        finally:
            pg.foreach_all_gather = real

    ids, labels, mask = batch(b=4)
    mine = slice(rank * 2, rank * 2 + 2)
    for layout, reshard in layouts:
        runs = {}
        for patched in (False, True):
            model = tiny("MistralForCausalLM")
            kw = dict(mesh=mesh, reshard_after_forward=reshard)
            if layout == "own-root":   # only the head sharded: it is an FSDP root
                fully_shard(model.lm_head, **kw)
            else:
                for layer in model.model.layers:
                    fully_shard(layer, **kw)
                if layout == "own-unit":
                    fully_shard(model.lm_head, **kw)
                elif layout == "group":
                    fully_shard([model.model.norm, model.lm_head], **kw)
                fully_shard(model, mesh=mesh)
            for m in model.modules():   # gloo has no PREMUL_SUM: a plain SUM in both runs
                if isinstance(m, FSDPModule):
                    m.set_force_sum_reduction_for_comms(True)
            if patched:
                lt.patch(model)
            sharded = model.lm_head.weight
            with head_gathers(sharded) as gathers:
                out = model(input_ids=ids[mine], attention_mask=mask[mine], labels=labels[mine])
                out.loss.backward()
            assert (out.logits is None) == patched
            grads = {}
            for name, p in model.named_parameters():
                assert p.grad is not None, f"{layout} {reshard} patched={patched}: {name} has no gradient"
                grads[name] = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            runs[patched] = [(out.loss.detach(), grads, gathers[0])]
        for ours, ref in zip(runs[True], runs[False]):
            where = f"rank {rank} {layout} reshard_after_forward={reshard}"
            torch.testing.assert_close(ours[0], ref[0], rtol=1e-5, atol=1e-6, msg=lambda m: f"{where}: {m}")
            assert ours[1].keys() == ref[1].keys(), where
            for name in ref[1]:
                torch.testing.assert_close(ours[1][name], ref[1][name], rtol=1e-4, atol=1e-6,
                                           msg=lambda m: f"{where} d{name}: {m}")
            assert ours[2] == ref[2], f"{where}: the head all-gathered {ours[2]} times, unpatched {ref[2]}"


@pytest.mark.skipif(sys.platform == "win32", reason="gloo on Windows is not set up here")
def test_fsdp2_patched_model_head_layouts():
    pytest.importorskip("transformers")
    from torch.distributed import fsdp

    if not hasattr(fsdp, "fully_shard"):
        pytest.skip("FSDP2 (fully_shard) needs torch >= 2.6")
    layouts = [("own-unit", False), ("own-unit", True), ("group", True), ("own-root", True), ("root", True)]
    spawn(_patch_worker, WORLD, layouts, backend="gloo")
