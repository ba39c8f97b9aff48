"""``logitless.integrations.torchtitan.LogitlessLoss`` against torchtitan's own losses, with
the real torchtitan (0.3.0) on the CPU.

- the op: ``LogitlessLoss(hidden)`` equals ``CrossEntropyLoss(lm_head(hidden))`` (value and
  gradients wrt the hidden states and the head weight; fp32 and bf16, ignored tokens,
  ``global_valid_tokens``, odd vocabulary), each held to the float64 reference as tightly
  as torchtitan's own loss; odd sizes; MTP lists against torchtitan's ``MTPLoss``;
- selection: ``--override.imports logitless.integrations.torchtitan.logitless_loss`` parsed by
  torchtitan's ``ConfigManager`` and applied by ``apply_overrides`` turns the llama3 debug
  config's loss into ``LogitlessLoss``; bad configurations raise;
- the trainer's path: the steps of ``Trainer.__init__`` (config, ``update_from_config``,
  overrides, meta build, the model's ``parallelize_fn``, ``init_weights``, the loss build, the
  lm_head wiring) and the trainer's own ``post_dataloading_process`` and
  ``_forward_backward_body`` on a 2-layer llama3 debug model: one process, and 2 gloo ranks
  with FSDP2 and with TP=2 (vocabulary-parallel head: spmd_types plain shards and
  partial_dtensor DTensors), against torchtitan's ``ChunkedLossWrapper``/``CrossEntropyLoss``
  on the same model (loss, the head's and the final norm's gradients, rank by rank).

Every check runs with ``torch.nn.functional.cross_entropy`` and the head's ``forward``
patched to raise, and asserts that logitless' op ran. FlexAttention has no CPU backward, so
the decoder's embedding and layers are frozen: gradients reach the final norm (through the
loss's bridge into the decoder's backward) and the head.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import tempfile
import types

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("torchtitan", reason="torchtitan is not installed (the newest-releases leg has it)")

from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss  # noqa: E402

import logitless.integrations.torchtitan as lt  # noqa: E402
from tests._distributed import spawn  # noqa: E402

V_ODD = 1001      # not divisible by the TP degree: rows 501 / 500
B, L = 2, 32


@contextlib.contextmanager
def logits_forbidden(head=None):
    """F.cross_entropy and the head's forward raise; yields a list counting logitless calls."""
    calls = []
    real = lt.linear_cross_entropy

    def counting(*a, **k):
        calls.append(1)
        return real(*a, **k)

    def boom(*a, **k):
        raise AssertionError("logits were formed: F.cross_entropy or lm_head.forward ran")

    saved_ce = torch.nn.functional.cross_entropy
    saved_fwd = head.__dict__.get("forward") if head is not None else None
    lt.linear_cross_entropy = counting
    torch.nn.functional.cross_entropy = boom
    if head is not None:
        head.forward = boom
    try:
        yield calls
    finally:
        lt.linear_cross_entropy = real
        torch.nn.functional.cross_entropy = saved_ce
        if head is not None:
            if saved_fwd is None:
                del head.forward
            else:
                head.forward = saved_fwd


def _data(seed, b, l_, h, v, dtype):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, l_, h, generator=g, dtype=torch.float64)
    w = torch.randn(v, h, generator=g, dtype=torch.float64) * h ** -0.5 * 2
    t = torch.randint(0, v, (b, l_), generator=g)
    t[0, : max(1, l_ // 4)] = -100
    return x.to(dtype), w.to(dtype), t


def _titan_ce(head, x, t, gvt):
    return CrossEntropyLoss(CrossEntropyLoss.Config())(head(x), t, gvt)[0]


def _grads(fn, x, head):
    x = x.detach().clone().requires_grad_(True)
    head.zero_grad(set_to_none=True)
    loss = fn(x)
    loss.backward()
    return loss.detach(), x.grad, head.weight.grad.clone()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_titan_cross_entropy(dtype):
    x, w, t = _data(0, B, L, 48, V_ODD, torch.float64)
    gvt = (t != -100).sum() + 7          # other ranks' tokens count too
    head = torch.nn.Linear(48, V_ODD, bias=False)
    results = {}
    for name, dt in (("ref", torch.float64), ("titan", dtype), ("ours", dtype)):
        head.to(dt).weight.data.copy_(w)
        if name == "ours":
            loss_fn = lt.LogitlessLoss.Config(global_vocab_size=V_ODD).build()
            loss_fn.set_lm_head(head)
            with logits_forbidden(head) as calls:
                results[name] = _grads(lambda xx: loss_fn(xx, t, gvt)[0], x.to(dt), head)
            assert calls, "logitless' linear_cross_entropy did not run"
        else:
            results[name] = _grads(lambda xx: _titan_ce(head, xx, t, gvt), x.to(dt), head)
    ref = results["ref"]
    assert results["ours"][0].dtype == torch.float32
    for i, what in enumerate(("loss", "d hidden", "d weight")):
        err_ours = (results["ours"][i].double() - ref[i]).abs().max().item()
        err_titan = (results["titan"][i].double() - ref[i]).abs().max().item()
        scale = ref[i].abs().max().item()
        tol = (1e-6 if dtype == torch.float32 else 1e-3) * scale
        assert err_ours <= err_titan + tol, f"{what}: ours {err_ours:.3g} vs torchtitan's {err_titan:.3g}"
        # and it is torchtitan's loss (not just as accurate): close to its numbers
        close = (results["ours"][i].double() - results["titan"][i].double()).abs().max().item()
        assert close <= (2e-5 if dtype == torch.float32 else 2e-2) * scale + 1e-7, what


def test_odd_sizes():
    head = torch.nn.Linear(16, 7, bias=False)
    loss_fn = lt.LogitlessLoss.Config().build()
    loss_fn.set_lm_head(head)
    # one token
    x = torch.randn(1, 1, 16)
    t = torch.tensor([[3]])
    ref = _grads(lambda xx: _titan_ce(head, xx, t, None), x, head)
    with logits_forbidden(head) as calls:
        ours = _grads(lambda xx: loss_fn(xx, t)[0], x, head)
    assert calls
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # every local token ignored: 0 (sum or over a global count from other ranks), zero gradients
    t = torch.full((2, 3), -100)
    x = torch.randn(2, 3, 16)
    for gvt in (None, torch.tensor(5)):
        with logits_forbidden(head):
            loss, dx, dw = _grads(lambda xx: loss_fn(xx, t, gvt)[0], x, head)
        assert loss.item() == 0.0 and not dx.any() and not dw.any()
    # validation (no grad): forward only, same value
    with torch.no_grad(), logits_forbidden(head):
        t = torch.tensor([[1, 2, -100]])
        x = torch.randn(1, 3, 16)
        val = loss_fn(x, t, torch.tensor(2))[0]
    torch.testing.assert_close(val, _titan_ce(head, x, t, torch.tensor(2)), rtol=1e-5, atol=1e-6)


def test_mtp_matches_mtp_loss():
    from torchtitan.models.deepseek_v3.mtp import MTPLoss

    x, w, t = _data(1, B, L, 24, 97, torch.float32)
    hs = [x] + [torch.randn(B, L, 24, generator=torch.Generator().manual_seed(d)) for d in (1, 2)]
    positions = torch.cat([torch.arange(20), torch.arange(L - 20)]).expand(B, L)   # two documents
    gvt = (t != -100).sum()
    head = torch.nn.Linear(24, 97, bias=False)
    head.weight.data.copy_(w)
    ref_fn = MTPLoss(MTPLoss.Config(mtp_scale=0.25))
    ours_fn = lt.LogitlessLoss.Config(mtp_scale=0.25).build()
    ours_fn.set_lm_head(head)

    def run(fn):
        leaves = [h.clone().requires_grad_(True) for h in hs]
        head.zero_grad(set_to_none=True)
        loss = fn(leaves)
        loss.backward()
        return [loss.detach()] + [h.grad for h in leaves] + [head.weight.grad.clone()]

    ref = run(lambda leaves: ref_fn([head(h) for h in leaves], t, gvt, positions=positions)[0])
    with logits_forbidden(head) as calls:
        ours = run(lambda leaves: ours_fn(leaves, t, gvt, positions=positions)[0])
    assert len(calls) == 3   # one fused call per depth
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=2e-5, atol=1e-6)
    with pytest.raises(ValueError, match="positions"):
        ours_fn(hs, t, gvt)
    with pytest.raises(ValueError, match="at least one MTP depth"):
        ours_fn(hs[:1], t, gvt, positions=positions)


def test_bad_input_and_configuration():
    with pytest.raises(ValueError, match="memory_budget"):
        lt.LogitlessLoss.Config(memory_budget=-1).build()
    with pytest.raises(ValueError, match="backend"):
        lt.LogitlessLoss.Config(backend="cuda").build()
    with pytest.raises(ValueError, match="mtp_scale"):
        lt.LogitlessLoss.Config(mtp_scale=-0.1).build()
    loss_fn = lt.LogitlessLoss.Config(global_vocab_size=8).build()
    with pytest.raises(RuntimeError, match="set_lm_head"):
        loss_fn(torch.randn(1, 2, 4), torch.zeros(1, 2, dtype=torch.long))
    with pytest.raises(TypeError, match="2-D"):
        loss_fn.set_lm_head(torch.nn.LayerNorm(4))
    head = torch.nn.Linear(4, 7, bias=False)
    loss_fn.set_lm_head(head)
    with pytest.raises(ValueError, match="global_vocab_size=8"):
        loss_fn(torch.randn(1, 2, 4), torch.zeros(1, 2, dtype=torch.long))
    loss_fn = lt.LogitlessLoss.Config().build()
    loss_fn.set_lm_head(head)
    with pytest.raises(ValueError, match="batch, seq, hidden"):
        loss_fn(torch.randn(2, 4), torch.zeros(2, dtype=torch.long))
    with pytest.raises(TypeError, match="integer token ids"):
        loss_fn(torch.randn(1, 2, 4), torch.zeros(1, 2))
    with pytest.raises(ValueError, match=r"\(1, 2\) but labels \(1, 3\)"):
        loss_fn(torch.randn(1, 2, 4), torch.zeros(1, 3, dtype=torch.long))


def test_override_selects_the_loss():
    """The user's line, through torchtitan's own CLI parser and override machinery."""
    from torchtitan.components.loss import MSELoss
    from torchtitan.config import ConfigManager
    from torchtitan.config.override import apply_overrides

    target = "logitless.integrations.torchtitan.logitless_loss"
    config = ConfigManager().parse_args(["--module", "llama3", "--config", "llama3_debugmodel",
                                         "--override.imports", f'{target}={{"memory_budget": 1048576}}'])
    assert isinstance(config.loss, ChunkedLossWrapper.Config)
    lines = apply_overrides(config.override, config)
    assert len(lines) == 1 and "LogitlessLoss" in lines[0]
    assert type(config.loss) is lt.LogitlessLoss.Config
    assert config.loss.global_vocab_size == 2048 and config.loss.memory_budget == 1 << 20
    built = config.loss.build(compile_config=config.compile)
    assert isinstance(built, ChunkedLossWrapper)   # what the trainer wires (set_lm_head, _skip_lm_head)
    with pytest.raises(ValueError, match="MSELoss"):
        lt.logitless_loss(MSELoss.Config())
    with pytest.raises(ValueError, match="ChunkedLossWrapper around MSELoss"):
        lt.logitless_loss(ChunkedLossWrapper.Config(loss_fn=MSELoss.Config()))
    with pytest.raises(ValueError, match="unknown option"):
        lt.logitless_loss(CrossEntropyLoss.Config(), chunk=3)
    from torchtitan.models.deepseek_v3.mtp import MTPLoss
    with pytest.raises(ValueError, match="MTPDecoder refuses"):
        lt.logitless_loss(MTPLoss.Config())


# ---- FSDP2 layouts of the head ---------------------------------------------------------

class _Body(torch.nn.Module):
    """What the decoder is to the loss: tokens -> the final norm's output."""

    def __init__(self, v, h):
        super().__init__()
        self.emb = torch.nn.Embedding(v, h)
        self.layer = torch.nn.Linear(h, h)
        self.norm = torch.nn.RMSNorm(h)

    def forward(self, ids):
        return self.norm(torch.tanh(self.layer(self.emb(ids))))


class _LM(torch.nn.Module):
    def __init__(self, v, h):
        super().__init__()
        self.body = _Body(v, h)
        self.lm_head = torch.nn.Linear(h, v, bias=False)

    def forward(self, ids):   # torchtitan's model with _skip_lm_head
        return self.body(ids)


def _shard(model, layout, reshard, mesh):
    """torchtitan's layouts of the head, its unit's ``reshard_after_forward`` = ``reshard``:
    "own-root" (``fully_shard(head)`` apart from the body's root), "group"
    (``fully_shard([norm, head])`` under the model's root, as torchtitan's
    ``apply_fsdp_to_decoder``), "under-root" (the head in the root's own group; ``None``:
    FSDP's default for a root, which keeps its parameters unsharded after the forward)."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    def shard(modules, raf):
        fully_shard(modules, mesh=mesh, **({} if raf is None else {"reshard_after_forward": raf}))

    shard(model.body.layer, reshard)
    if layout == "own-root":
        shard(model.lm_head, reshard)
        shard(model.body, None)
    elif layout == "group":
        shard([model.body.norm, model.lm_head], reshard)
        shard(model, None)   # as torchtitan's root
    else:
        shard(model, reshard)
    for m in model.modules():   # gloo has no PREMUL_SUM: a plain SUM in both runs, same math
        if isinstance(m, FSDPModule):
            m.set_force_sum_reduction_for_comms(True)


@contextlib.contextmanager
def _counting_head_gathers(weight):
    """Counts FSDP2's all-gathers of the parameter group holding ``weight`` (the sharded head)."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group as pg

    counts = {"call": 0, "step": 0}
    real = pg.foreach_all_gather

    def counting(fsdp_params, *a, **k):
        if any(p.sharded_param is weight for p in fsdp_params):
            counts["call"] += 1
            counts["step"] += 1
        return real(fsdp_params, *a, **k)

    pg.foreach_all_gather = counting
    try:
        yield counts
    finally:
        pg.foreach_all_gather = real


def _fsdp_layout_worker(rank, world, device, layouts):
    import copy

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    mesh = init_device_mesh("cpu", (world,))
    v, h = 37, 16
    for layout, reshard in layouts:
        torch.manual_seed(0)
        base = _LM(v, h)
        runs = {}
        for name in ("chunked", "ours"):
            model = copy.deepcopy(base)
            _shard(model, layout, reshard, mesh)
            if name == "ours":
                loss_fn = lt.LogitlessLoss.Config(global_vocab_size=v).build()
            else:
                loss_fn = ChunkedLossWrapper.Config(num_chunks=2, loss_fn=CrossEntropyLoss.Config()).build()
            loss_fn.set_lm_head(model.lm_head)
            sharded_head = model.lm_head.weight
            steps = []
            for step in range(2):   # the second step starts from the FSDP state the first left
                g = torch.Generator().manual_seed(10 * rank + step)
                ids = torch.randint(0, v, (B, 8), generator=g)
                labels = torch.randint(0, v, (B, 8), generator=g)
                labels[0, :2] = -100
                gvt = (labels != -100).sum()
                dist.all_reduce(gvt)
                model.zero_grad(set_to_none=True)
                with _counting_head_gathers(sharded_head) as gathers, \
                        (logits_forbidden(model.lm_head) if name == "ours" else contextlib.nullcontext()) as calls:
                    hidden = model(ids)
                    before = gathers["call"]
                    loss, _ = loss_fn(hidden, labels, gvt)
                    per_call = gathers["call"] - before
                    loss.backward()
                assert name == "chunked" or calls, "logitless did not run"
                grads = {}
                for pname, p in model.named_parameters():
                    assert p.grad is not None, f"{layout} {reshard} {name}: {pname} has no gradient"
                    grads[pname] = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
                # the head's registered parameter is the sharded one again (what an optimizer and
                # clip_grad_norm_ read) wherever FSDP shards it
                if layout != "under-root":
                    assert isinstance(model.lm_head.weight, DTensor), f"{layout} {reshard} {name}: left unsharded"
                steps.append((loss.detach(), grads, per_call, gathers["step"]))
            runs[name] = steps
        for step, (ours, ref) in enumerate(zip(runs["ours"], runs["chunked"])):
            where = f"rank {rank} {layout} reshard_after_forward={reshard} step {step}"
            torch.testing.assert_close(ours[0], ref[0], rtol=1e-5, atol=1e-6, msg=lambda m: f"{where} loss: {m}")
            for pname in ref[1]:
                torch.testing.assert_close(ours[1][pname], ref[1][pname], rtol=1e-4, atol=1e-6,
                                           msg=lambda m: f"{where} d{pname}: {m}")
            assert ours[2] <= 1, f"{where}: the head was all-gathered {ours[2]} times in one loss call"
            assert ours[2] <= ref[2] and ours[3] <= ref[3], (where, ours[2:], ref[2:])
            # sharded when the call starts: one gather in the call; unsharded (the norm's group kept it
            # after the norm's forward) or under the root: none
            expect = 1 if layout == "own-root" or (layout == "group" and reshard) else 0
            assert ours[2] == expect, f"{where}: {ours[2]} gathers in the call, expected {expect}"


@pytest.mark.skipif(sys.platform == "win32" or not dist.is_gloo_available(), reason="needs gloo")
def test_fsdp2_head_layouts():
    """A real ``fully_shard`` on 2 gloo ranks in each of torchtitan's layouts of the head (its own
    FSDP root, a group with the final norm, under the root) and both ``reshard_after_forward``:
    the loss and every parameter's gradient equal ``ChunkedLossWrapper``'s, two steps in a row,
    the head's gradient is never None and the head is left sharded; the head is all-gathered
    at most once per loss call, and never more often than by ``ChunkedLossWrapper``."""
    layouts = [("own-root", False), ("own-root", True), ("group", False), ("group", True), ("under-root", None)]
    spawn(_fsdp_layout_worker, 2, layouts, backend="gloo")


def _fsdp_resharded_root_worker(rank, world, device):
    from torch.distributed.device_mesh import init_device_mesh

    model = _LM(37, 16)
    _shard(model, "under-root", True, init_device_mesh("cpu", (world,)))
    loss_fn = lt.LogitlessLoss.Config().build()
    loss_fn.set_lm_head(model.lm_head)
    ids = torch.randint(0, 37, (B, 8))
    with pytest.raises(TypeError, match="FSDP2's sharded parameter, outside the forward"):
        loss_fn(model(ids), ids)


@pytest.mark.skipif(sys.platform == "win32" or not dist.is_gloo_available(), reason="needs gloo")
def test_fsdp2_head_resharded_by_its_parent_is_refused():
    """The head in a root's group whose ``reshard_after_forward=True`` reshards it after the
    forward: its weight is then FSDP's shard (a DTensor over the data-parallel mesh), not the
    head; refused (once taken for a vocabulary-parallel head it gave a wrong loss).
    ``ChunkedLossWrapper`` fails there too (``lm_head(h)`` mixes a Tensor and a DTensor)."""
    spawn(_fsdp_resharded_root_worker, 2, backend="gloo")


# ---- the trainer's own path -------------------------------------------------------------

def _trainer_config(*, dp=1, tp=1, backend="spmd_types", vocab=V_ODD, logitless=True, param_dtype="float32"):
    from torchtitan.models.llama3 import model_registry
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    config = llama3_debugmodel()
    spec = model_registry("debugmodel", attn_backend="flex")
    m = spec.model
    m.layers = m.layers[:2]
    m.vocab_size = vocab
    m.tok_embeddings.num_embeddings = vocab
    m.lm_head.out_features = vocab
    config.model_spec = spec
    config.loss = ChunkedLossWrapper.Config(num_chunks=4, loss_fn=CrossEntropyLoss.Config(global_vocab_size=vocab))
    config.parallelism = dataclasses.replace(config.parallelism, data_parallel_shard_degree=dp,
                                             tensor_parallel_degree=tp, spmd_backend=backend)
    config.training = dataclasses.replace(config.training, local_batch_size=B, seq_len=L,
                                          mixed_precision_param=param_dtype)
    if logitless:
        config.override.imports = ["logitless.integrations.torchtitan.logitless_loss"]
    return config


_PARALLEL_DIMS: dict = {}


def _trainer(config, world, parallel_dims=None):
    """What ``Trainer.__init__`` builds, in its order, without a tokenizer, dataloader,
    optimizer or checkpointer (none runs on a CPU-only machine: torchtitan picks "cuda")."""
    import torchtitan.distributed.parallel_dims as pd
    from torchtitan.config import TORCH_DTYPE_MAP
    from torchtitan.config.override import apply_overrides
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.tools import utils

    pd.device_type = "cpu"   # torchtitan's device detection falls back to "cuda" without a GPU
    # eager FlexAttention (the compiled one costs a minute of Inductor per process on 2 cores)
    from torch.nn.attention.flex_attention import flex_attention
    from torchtitan.models.common.attention import FlexAttention
    FlexAttention._compiled_flex_attn = flex_attention
    key = (config.parallelism.data_parallel_shard_degree, config.parallelism.tensor_parallel_degree,
           config.parallelism.spmd_backend)
    if parallel_dims is None:   # one set of meshes per process and layout (FSDP2 checks mesh identity)
        parallel_dims = _PARALLEL_DIMS.setdefault(key, ParallelDims.from_config(config.parallelism, world))
    dist_utils.set_spmd_backend(config.parallelism.spmd_backend)
    spec = config.model_spec
    model_config = spec.model
    model_config.update_from_config(config=config)
    if config.override.imports:
        apply_overrides(config.override, config)
    with torch.device("meta"), utils.set_default_dtype(TORCH_DTYPE_MAP[config.training.dtype]):
        model = model_config.build()
    loss_fn = config.loss.build(compile_config=config.compile)
    with tempfile.TemporaryDirectory() as tmp:
        model = spec.parallelize_fn(model, parallel_dims=parallel_dims, training=config.training,
                                    parallelism=config.parallelism, compile_config=config.compile,
                                    ac_config=None, dump_folder=tmp)
    from torch.distributed.fsdp import FSDPModule
    for m in model.modules():   # gloo has no PREMUL_SUM (torchtitan's divide factor 1.0): a plain SUM, same math
        if isinstance(m, FSDPModule):
            m.set_force_sum_reduction_for_comms(True)
    model.to_empty(device="cpu")
    torch.manual_seed(1234)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()
    for name, p in model.named_parameters():     # FlexAttention has no CPU backward
        if not name.startswith(("norm.", "lm_head.")):
            p.requires_grad_(False)
    # the trainer's wiring (Trainer.__init__, non-PP branch), verbatim in substance
    if isinstance(loss_fn, ChunkedLossWrapper):
        assert model.lm_head is not None
        loss_fn.set_lm_head(model.lm_head)
        model._skip_lm_head = True
    return types.SimpleNamespace(
        config=config, model_config=model_config, model_parts=[model], parallel_dims=parallel_dims,
        loss_fn=loss_fn, ntokens_seen=0,
        train_context=dist_utils.get_spmd_context(parallel_dims=parallel_dims, spmd_typechecking=False))


def _step(trainer, tokens, labels, gvt):
    """The trainer's own ``post_dataloading_process`` and ``_forward_backward_body``."""
    from torchtitan.trainer import Trainer

    model = trainer.model_parts[0]
    model.zero_grad(set_to_none=True)
    positions = torch.arange(tokens.shape[1]).expand(tokens.shape[0], -1).contiguous()
    inputs, labels, extra = Trainer.post_dataloading_process(
        trainer, {"input": tokens, "positions": positions}, labels)
    loss = Trainer._forward_backward_body(trainer, inputs, labels, gvt, extra)
    grads = {}
    for name in ("norm.weight", "lm_head.weight"):
        g = model.get_parameter(name).grad
        grads[name] = (g.to_local() if hasattr(g, "to_local") else g).detach().clone()
    loss = loss.detach()
    return (loss.full_tensor() if hasattr(loss, "full_tensor") else loss), grads


def _batch(rank, vocab):
    g = torch.Generator().manual_seed(100 + rank)
    tokens = torch.randint(0, vocab, (B, L), generator=g)
    labels = torch.randint(0, vocab, (B, L), generator=g)
    labels[:, :3] = -100
    return tokens, labels


def _compare(rank, world, dp, tp, backend, param_dtype, vocab=V_ODD):
    ref_trainer = _trainer(_trainer_config(dp=dp, tp=tp, backend=backend, logitless=False, vocab=vocab,
                                           param_dtype=param_dtype), world)
    ours_trainer = _trainer(_trainer_config(dp=dp, tp=tp, backend=backend, param_dtype=param_dtype, vocab=vocab),
                            world,
                            ref_trainer.parallel_dims)
    assert isinstance(ours_trainer.loss_fn, lt.LogitlessLoss)
    assert not isinstance(ref_trainer.loss_fn, lt.LogitlessLoss)
    # the same weights in both (their init draws need not agree across layouts)
    with torch.no_grad():
        for (_, p), (_, q) in zip(ref_trainer.model_parts[0].named_parameters(),
                                  ours_trainer.model_parts[0].named_parameters()):
            q.copy_(p)
    data_rank = rank // tp if dp > 1 else 0   # TP ranks share a batch; DP ranks differ
    tokens, labels = _batch(data_rank, vocab)
    local = (labels != -100).sum()
    gvt = local.clone()
    if dp > 1:
        dist.all_reduce(gvt)
    ref_loss, ref_grads = _step(ref_trainer, tokens, labels, gvt)
    head = ours_trainer.model_parts[0].lm_head
    with logits_forbidden(head) as calls:
        loss, grads = _step(ours_trainer, tokens, labels, gvt)
    assert calls, f"rank {rank}: logitless did not run"
    tol = dict(rtol=1e-4, atol=1e-6) if param_dtype == "float32" else dict(rtol=2e-2, atol=2e-4)
    torch.testing.assert_close(loss, ref_loss.to(loss.dtype), **tol)
    for name in ref_grads:
        assert grads[name].shape == ref_grads[name].shape, name
        torch.testing.assert_close(grads[name].float(), ref_grads[name].float(), **tol,
                                   msg=lambda m: f"rank {rank} {name} ({backend}): {m}")
    return head


def _worker(rank, world, device, cases):
    from logitless.distributed import layout

    for case in cases:
        # one TP group serves two different heads here (one per case): logitless caches the ranks'
        # row counts per (group, local rows), so the second head would need its own group
        # (docs/tensor_parallel.md); a training process has one head per group
        layout._ROW_COUNTS.clear()
        _compare(rank, world, *case)


def test_trainer_path_one_process():
    spawn(_worker, 1, [(1, 1, "spmd_types", "float32")], backend="gloo")


@pytest.mark.skipif(sys.platform == "win32" or not dist.is_gloo_available(), reason="needs gloo")
def test_trainer_path_fsdp2():
    spawn(_worker, 2, [(2, 1, "spmd_types", "float32"), (2, 1, "spmd_types", "bfloat16")], backend="gloo")


@pytest.mark.skipif(sys.platform == "win32" or not dist.is_gloo_available(), reason="needs gloo")
def test_trainer_path_tp2():
    # spmd_types: torchtitan's own loss-parallel CE expects its ceil split of the vocabulary, which its
    # sharding of an odd vocabulary does not give (it raises), so that reference runs at V = 1000
    spawn(_worker, 2, [(1, 2, "partial_dtensor", "float32"), (1, 2, "spmd_types", "float32", 1000)],
          backend="gloo")
