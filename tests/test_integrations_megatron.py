"""logitless.integrations.megatron against the real megatron-core (0.19.2) on the CPU.

Two model classes:

- a tiny ``GPTModel`` whose decoder (and MTP block) is a per-token stand-in (Megatron's
  attention needs CUDA);
- a tiny ``HybridModel`` built by Megatron from a hybrid layer pattern (``"--"``, with MTP
  ``"--/-/-"``: MLP layers, two MTP depths): Megatron's ``HybridStack``, ``MLPLayer`` and
  ``MultiTokenPredictionBlock``, with one substitution: their Transformer-Engine norm is
  Megatron's torch norm (``_Norm``; no Transformer Engine on a CPU).

The embedding, the vocabulary-parallel output layer, the loss
(``compute_language_model_loss`` / ``vocab_parallel_cross_entropy``), ``process_mtp_loss``,
Float16Module and parallel_state are Megatron's own code. Each case runs the model as
Megatron runs it, then ``install(model)`` with Megatron's output layer, loss and logit path
made to raise, and compares the per-token loss, the decoder output's gradient and the head's
gradient (HybridModel: every parameter's gradient), and the MTP logging tracker; float64
runs are held to a float64 reference. Ranks are gloo processes (tests/_distributed.py):
TP=1, TP=2 with and without sequence parallel, context parallel 2.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is installed in the newest-releases leg only")

from tests._distributed import DIST_MARKS, spawn  # noqa: E402

pytestmark = DIST_MARKS

H = 16
S = 8
B = 2


class _Decoder(torch.nn.Module):
    """Per-token stand-in for the TransformerBlock; keeps its output for the gradient."""

    def __init__(self, dtype):
        super().__init__()
        self.lin = torch.nn.Linear(H, H, dtype=dtype)

    def forward(self, hidden_states, **_):
        self.out = self.lin(hidden_states)
        if self.out.requires_grad:
            self.out.retain_grad()
        return self.out


class _MTP(torch.nn.Module):
    """Stand-in MTP block: the main hidden states followed by one per-token map per depth."""

    def __init__(self, depths, dtype):
        super().__init__()
        self.maps = torch.nn.ModuleList(torch.nn.Linear(H, H, dtype=dtype) for _ in range(depths))

    def forward(self, hidden_states, **_):
        return torch.cat([hidden_states] + [torch.tanh(m(hidden_states)) for m in self.maps], dim=0)


class _Norm:
    """Megatron's torch norm (``WrappedTorchNorm``) in place of Transformer Engine's (not on a
    CPU), also under sequence parallel (which it refuses only because it does not mark its
    weights for the TP all-reduce of their gradients; the runs compared here share that)."""

    def __new__(cls, config, hidden_size, eps=1e-5, **_):
        import copy

        from megatron.core.transformer.torch_norm import WrappedTorchNorm

        config = copy.copy(config)
        config.sequence_parallel = False
        return WrappedTorchNorm(config, hidden_size, eps)


def _keep_output(module, args, output):
    """Forward hook: the decoder's output, kept with its gradient."""
    module.out = output
    if output.requires_grad:
        output.retain_grad()


def _hybrid_model(case, cfg):
    """Megatron's HybridModel from the pattern "--" (two MLP layers; "--/-/-": and two MTP
    depths of one MLP layer each), its stack and MTP block built by Megatron."""
    from megatron.core import tensor_parallel
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.hybrid import hybrid_block
    from megatron.core.models.hybrid.hybrid_block import HybridStack, HybridStackSubmodules
    from megatron.core.models.hybrid.hybrid_model import HybridModel
    from megatron.core.ssm.mlp_layer import MLPLayer
    from megatron.core.transformer import multi_token_prediction as mtp
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import TransformerLayerSubmodules

    mlp = ModuleSpec(module=MLPLayer, submodules=TransformerLayerSubmodules(
        pre_mlp_layernorm=_Norm, mlp=get_gpt_layer_local_spec().submodules.mlp, mlp_bda=get_bias_dropout_add))
    layer = mtp.MultiTokenPredictionLayerSubmodules(enorm=_Norm, hnorm=_Norm, layer_norm=_Norm, mtp_model_layer=None,
                                                     eh_proj=tensor_parallel.ColumnParallelLinear)
    mtp_spec = ModuleSpec(module=mtp.MultiTokenPredictionBlock, submodules=mtp.MultiTokenPredictionBlockSubmodules(
        layer_specs=[ModuleSpec(module=mtp.MultiTokenPredictionLayer, submodules=layer)]))
    spec = ModuleSpec(module=HybridStack, submodules=HybridStackSubmodules(mlp_layer=mlp, mtp_block_spec=mtp_spec))
    saved, hybrid_block.TENorm = hybrid_block.TENorm, _Norm  # the stack's final norm
    try:
        model = HybridModel(config=cfg, hybrid_stack_spec=spec, vocab_size=case["vocab"], max_sequence_length=64,
                            hybrid_layer_pattern="--/-/-" if case.get("mtp") else "--",
                            share_embeddings_and_output_weights=case.get("tied", False),
                            post_process=case.get("post_process", True))
    finally:
        hybrid_block.TENorm = saved
    model.decoder.register_forward_hook(_keep_output)
    return model


def _model(case, dtype):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec, get_gpt_mtp_block_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.manual_seed(1234)
    kw = dict(num_layers=1, hidden_size=H, num_attention_heads=2, use_cpu_initialization=True,
              params_dtype=torch.float32 if dtype == torch.bfloat16 else dtype, hidden_dropout=0.0,
              attention_dropout=0.0, tensor_model_parallel_size=case.get("tp", 1),
              sequence_parallel=False,
              bf16=dtype == torch.bfloat16, init_method_std=0.5)
    if case.get("mup"):
        kw.update(use_mup=True, mup_output_mult=0.37)
    if case.get("mtp"):
        kw.update(mtp_num_layers=2, mtp_loss_scaling_factor=0.3,
                  calculate_per_token_loss=case.get("per_token", False))
    # context parallel: parallel_state's CP group (GPTModel's pg_collection.cp, which the MTP
    # rolls use) is 2 while the config says 1, since Megatron's local attention refuses CP
    kw.update(case.get("config", {}))
    if case.get("hybrid"):
        kw.update(num_layers=2, sequence_parallel=bool(case.get("sp")))
        cfg = TransformerConfig(**kw)
        model = _hybrid_model(case, cfg)
        if dtype == torch.float64:
            model.double()  # (Megatron's torch norm is built in the default dtype)
        _seed_head(model)
        if dtype == torch.bfloat16:
            return model, Float16Module(cfg, model)
        return model, model
    cfg = TransformerConfig(**kw)
    spec = get_gpt_layer_local_spec()
    mtp_spec = get_gpt_mtp_block_spec(cfg, spec, use_transformer_engine=False) if case.get("mtp") else None
    model = GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=case["vocab"], max_sequence_length=64,
                     share_embeddings_and_output_weights=case.get("tied", False), mtp_block_spec=mtp_spec)
    if case.get("sp"):
        # Sequence parallel switched on after construction: Megatron's torch norms (no apex /
        # TE here) refuse it, and the decoder is a stand-in. The embedding reads the config
        # at run time (it scatters the sequence); the output layer as ColumnParallelLinear
        # sets itself up with sequence_parallel=True.
        cfg.sequence_parallel = True
        model.output_layer.sequence_parallel = True
        model.output_layer.allreduce_dgrad = False
    torch.manual_seed(99)
    model.decoder = _Decoder(torch.float32 if dtype == torch.bfloat16 else dtype)
    if case.get("mtp"):
        model.mtp = _MTP(2, torch.float32 if dtype == torch.bfloat16 else dtype)
    _seed_head(model)
    if dtype == torch.bfloat16:
        return model, Float16Module(cfg, model)
    return model, model


def _head_weight(model):
    return model.output_layer.weight if model.output_layer.weight is not None else \
        model.embedding.word_embeddings.weight


def _seed_head(model):
    with torch.no_grad():  # a head with logits of a few units, different on every rank
        w = _head_weight(model)
        g = torch.Generator().manual_seed(7 + torch.distributed.get_rank())
        w.copy_(torch.randn(w.shape, generator=g, dtype=torch.float64).to(w.dtype))


def _inputs(case, rank_seed):
    from megatron.core.packed_seq_params import PackedSeqParams

    g = torch.Generator().manual_seed(rank_seed)
    s = case.get("s", S)
    b = 1 if case.get("packed") else case.get("b", B)
    ids = torch.randint(0, case["vocab"], (b, s), generator=g)
    labels = torch.randint(0, case["vocab"], (b, s), generator=g)
    pos = torch.arange(s).expand(b, s)
    mask = torch.ones(b, 1, s, s, dtype=torch.bool).tril().logical_not()
    loss_mask = (torch.rand(b, s, generator=g) > 0.2).float()
    upstream = torch.rand(b, s, generator=g, dtype=torch.float64) + 0.5
    kw = {}
    if case.get("packed"):
        cu = torch.tensor([0, 3, s], dtype=torch.int32)
        kw["packed_seq_params"] = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                                  max_seqlen_q=s, max_seqlen_kv=s)
    return ids, pos, mask, labels, loss_mask, upstream, kw


def _run(case, model, wrapped, dtype, processor=None, context=None, positional=False):
    """(per-token loss, decoder output grad, head grad, MTP tracker values, labels, every
    parameter's grad by name) of one step."""
    from megatron.core import parallel_state
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    seed = 5 + parallel_state.get_context_parallel_rank()  # CP: each rank its own chunk
    ids, pos, mask, labels, loss_mask, upstream, kw = _inputs(case, seed)
    if processor is not None:
        kw.update(output_processor=processor, output_processor_context=context)
    # the tracker on the CPU (Megatron allocates it on the current CUDA device)
    MTPLossLoggingHelper.tracker = {k: torch.zeros(2) for k in ("loss_values", "correct_values", "total_values")}
    model.zero_grad(set_to_none=True)
    if positional:  # labels the fifth positional argument (after decoder_input), as both forwards take it
        out = wrapped(ids, pos, mask, None, labels, loss_mask=loss_mask, **kw)
    else:
        out = wrapped(ids, pos, mask, labels=labels, loss_mask=loss_mask, **kw)
    main = out["log_probs"] if isinstance(out, dict) else out
    total = (main.double() * upstream * loss_mask).sum()
    if isinstance(out, dict) and "entropy" in out:
        total = total + (out["entropy"].double() * upstream.flip(-1)).sum()
    total.backward()
    t = MTPLossLoggingHelper.tracker
    tracker = torch.stack([t["loss_values"], t["correct_values"], t["total_values"]])
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return out, model.decoder.out.grad.clone(), _head_weight(model).grad.clone(), tracker, labels, grads


class _Forbidden:
    """Megatron's logit path made to raise, and logitless' entry points counted."""

    def __init__(self, model):
        from megatron.core.models.common.language_module import language_module

        import logitless.integrations.megatron as lm

        self.model, self.lm, self.lang = model, lm, language_module
        self.calls = 0

    def __enter__(self):
        def boom(*a, **k):
            raise AssertionError("Megatron's logit path was called under install")

        self.saved = (self.lm.linear_cross_entropy, self.lm.linear_log_probs,
                      self.lang.tensor_parallel.vocab_parallel_cross_entropy)
        lce, llp = self.saved[:2]

        def count(fn):
            def inner(*a, **k):
                self.calls += 1
                return fn(*a, **k)
            return inner

        self.lm.linear_cross_entropy, self.lm.linear_log_probs = count(lce), count(llp)
        self.lang.tensor_parallel.vocab_parallel_cross_entropy = boom
        self.model.output_layer.forward = boom
        self.model.compute_language_model_loss = boom
        return self

    def __exit__(self, *exc):
        self.lm.linear_cross_entropy, self.lm.linear_log_probs = self.saved[:2]
        self.lang.tensor_parallel.vocab_parallel_cross_entropy = self.saved[2]
        del self.model.output_layer.forward
        del self.model.compute_language_model_loss


def _close(name, got, want, tol):
    got, want = got.double(), want.double()
    err = (got - want).abs().max().item() if got.numel() else 0.0
    scale = max(want.abs().max().item() if want.numel() else 0.0, 1.0)
    assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    assert err <= tol * scale, f"{name}: max error {err:.3g} > {tol:.1g} x {scale:.3g}"


def _check_case(case):
    import logitless.integrations.megatron as lm

    for dtype in case.get("dtypes", (torch.float32,)):
        tol = 3e-2 if dtype == torch.bfloat16 else 1e-5
        name = f"{case['name']} {dtype}"
        model, wrapped = _model(case, dtype)
        ref_loss, ref_dh, ref_dw, ref_track, _, ref_grads = _run(case, model, wrapped, dtype)
        lm.install(wrapped)
        with _Forbidden(model) as f:
            loss, dh, dw, track, _, grads = _run(case, model, wrapped, dtype, positional=case.get("positional"))
        assert f.calls >= 1 + (2 if case.get("mtp") else 0), f"{name}: logitless was not called"
        assert loss.dtype == ref_loss.dtype == torch.float32, name
        _close(name + " loss", loss, ref_loss, tol)
        _close(name + " dhidden", dh, ref_dh, tol)
        _close(name + " dweight", dw, ref_dw, tol)
        if case.get("hybrid"):  # every parameter: the stack, the MTP block, the embedding, the head
            assert grads.keys() == ref_grads.keys(), name
            for key in grads:
                _close(f"{name} d{key}", grads[key], ref_grads[key], 3 * tol)
        if case.get("mtp"):  # Megatron's MTP logging: loss, acceptance (argmax == label), count per depth
            assert track[1:].sum() > 0, name
            _close(name + " mtp logged loss", track[0], ref_track[0], tol)
            # bf16: Megatron's argmax is of the bf16-rounded logits (ties can differ)
            _close(name + " mtp logged acceptance", track[1], ref_track[1], 0 if dtype != torch.bfloat16 else 1)
            assert torch.equal(track[2], ref_track[2]), name
        else:
            assert not track.any(), name
        # without labels the model gives Megatron's logits, through Megatron's own layer
        ids, pos, mask, *_, kw = _inputs(case, 5)
        with torch.no_grad():
            logits = wrapped(ids, pos, mask, **kw)
        assert logits.shape == (*ids.shape, dw.shape[0]), name


def _float64_case(case):
    """The installed model in float64 against F.cross_entropy / log_softmax on the full
    gathered head in float64 (Megatron's own loss is fp32: vocab_parallel_cross_entropy
    casts the logits)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    import logitless.integrations.megatron as lm

    model, wrapped = _model(case, torch.float64)
    lm.install(wrapped)
    ctx = case.get("context")
    proc = lm.log_probs_processor if ctx is not None else None
    out, dh, dw, _, labels, _ = _run(case, model, wrapped, torch.float64, processor=proc, context=ctx)
    # the reference: the full head and the full sequence of hidden states
    group = parallel_state.get_tensor_model_parallel_group()
    tp = dist.get_world_size(group)
    w = _head_weight(model)
    parts = [torch.empty_like(w) for _ in range(tp)]
    dist.all_gather(parts, w.detach().contiguous(), group=group)
    full_w = torch.cat(parts).requires_grad_(True)
    h = model.decoder.out.detach()
    if case.get("sp"):
        hs = [torch.empty_like(h) for _ in range(tp)]
        dist.all_gather(hs, h.contiguous(), group=group)
        h = torch.cat(hs)
    h = h.requires_grad_(True)
    ids, pos, mask, labels, loss_mask, upstream, _ = _inputs(case, 5)
    scale = 0.37 if case.get("mup") else 1.0
    z = (h @ full_w.T).transpose(0, 1) * scale  # (b, s, V)
    if ctx is None:
        ref = torch.nn.functional.cross_entropy(z.reshape(-1, z.shape[-1]), labels.reshape(-1),
                                                reduction="none").view(labels.shape)
        got = out
        total = (ref * upstream * loss_mask).sum()
    else:
        logp = torch.log_softmax(z / ctx["temperature"], -1)
        ref = logp.gather(-1, labels[..., None])[..., 0]
        got = out["log_probs"]
        total = (ref * upstream * loss_mask).sum()
        if ctx.get("entropy"):
            ent = -(logp.exp() * logp).sum(-1)
            _close("float64 entropy", out["entropy"], ent, 1e-10)
            total = total + (ent * upstream.flip(-1)).sum()
        else:
            assert set(out) == {"log_probs"}
    total.backward()
    rank = dist.get_rank(group)
    rows = w.shape[0]
    ref_dh = h.grad
    if case.get("sp"):
        ref_dh = ref_dh.chunk(tp)[rank]
    _close(f"{case['name']} float64 loss", got, ref, 1e-10)
    _close(f"{case['name']} float64 dhidden", dh, ref_dh, 1e-10)
    _close(f"{case['name']} float64 dweight", dw, full_w.grad[rank * rows:(rank + 1) * rows], 1e-10)


def _log_probs_case(case):
    """log_probs_processor against log_softmax of Megatron's own logits (fp32; bf16 under
    Float16Module, to bf16's noise)."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

    import logitless.integrations.megatron as lm

    ctx = case["context"]
    for dtype in case.get("dtypes", (torch.float32,)):
        tol = 3e-2 if dtype == torch.bfloat16 else 1e-5
        model, wrapped = _model(case, dtype)
        ids, pos, mask, labels, loss_mask, upstream, kw = _inputs(case, 5)
        model.zero_grad(set_to_none=True)
        logits = wrapped(ids, pos, mask, **kw)  # Megatron's vocab-parallel logits (b, s, V/tp)
        full = gather_from_tensor_model_parallel_region(logits, group=parallel_state.get_tensor_model_parallel_group())
        logp = torch.log_softmax(full.double() / ctx["temperature"], -1)
        ref = logp.gather(-1, labels[..., None])[..., 0]
        ent = -(logp.exp() * logp).sum(-1)
        ((ref * upstream * loss_mask).sum() + (ent * upstream.flip(-1)).sum()).backward()
        ref_dh, ref_dw = model.decoder.out.grad.clone(), model.output_layer.weight.grad.clone()
        if case.get("hybrid"):  # HybridModel's forward takes a processor once installed (GPTModel's always)
            lm.install(wrapped)
        with _Forbidden(model) as f:
            out, dh, dw, _, _, _ = _run(case, model, wrapped, dtype, processor=lm.log_probs_processor, context=ctx)
        assert f.calls == 1
        assert set(out) == {"log_probs", "entropy"}
        assert out["log_probs"].dtype == out["entropy"].dtype == torch.float32
        _close(f"log_probs {dtype}", out["log_probs"], ref, tol)
        _close(f"entropy {dtype}", out["entropy"], ent, tol)
        _close(f"log_probs dhidden {dtype}", dh, ref_dh, tol)
        _close(f"log_probs dweight {dtype}", dw, ref_dw, tol)


def _install_errors():
    from megatron.core.models.gpt.gpt_model import GPTModel

    import logitless.integrations.megatron as lm

    case = dict(name="errors", vocab=37)
    with pytest.raises(TypeError, match="GPTModel"):
        lm.install(torch.nn.Linear(2, 2))
    model, _ = _model(case, torch.float32)
    model.config.defer_embedding_wgrad_compute = True  # (its config needs pipeline parallelism)
    with pytest.raises(ValueError, match="defer_embedding_wgrad_compute"):
        lm.install(model)
    model, _ = _model(case, torch.float32)
    class Other(type(model)):
        def compute_language_model_loss(self, labels, logits):
            return super().compute_language_model_loss(labels, logits) * 2

    model.__class__ = Other
    with pytest.raises(ValueError, match="compute_language_model_loss"):
        lm.install(model)
    class Scaled(GPTModel):
        def _scale_logits(self, logits):
            return logits * 2

    model.__class__ = Scaled
    with pytest.raises(ValueError, match="_scale_logits"):
        lm.install(model)
    model, _ = _model(case, torch.float32)
    model.parallel_output = False
    with pytest.raises(ValueError, match="parallel_output"):
        lm.install(model)
    model, _ = _model(case, torch.float32)
    with pytest.raises(ValueError, match="unknown keys"):
        ids, pos, mask, labels, *_ = _inputs(case, 5)
        model(ids, pos, mask, labels=labels, output_processor=lm.log_probs_processor,
              output_processor_context={"temp": 2.0})
    # no tokens: the processor's loss is (b, 0) like Megatron's, and its gradient zero
    h = torch.zeros(0, 2, H, requires_grad=True)
    labels = torch.zeros(2, 0, dtype=torch.long)
    got = lm.output_processor(hidden_states=h, output_layer=model.output_layer, labels=labels, config=model.config)
    logits, _ = model.output_layer(h)
    assert got.shape == model.compute_language_model_loss(labels, logits).shape == (2, 0)
    got.sum().backward()
    assert h.grad.shape == h.shape
    # the list of pipeline chunks: install marks the post-process chunk, returns the list
    chunks = [model]
    assert lm.install(chunks) is chunks and model._logitless_megatron
    assert isinstance(model, GPTModel) and lm.install(model) is model  # idempotent
    # a pipeline stage without the output layer is left as it is
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    first = GPTModel(config=model.config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=37,
                     max_sequence_length=64, post_process=False)
    assert lm.install([first, model])[0] is first and type(first) is GPTModel
    with _Forbidden(model) as f:
        ids, pos, mask, labels, *_ = _inputs(case, 5)
        assert model(ids, pos, mask, labels=labels).shape == labels.shape and f.calls == 1
    # log_probs_processor hands the sampler's truncation to linear_log_probs
    seen = {}
    real = lm.linear_log_probs
    lm.linear_log_probs = lambda *a, **k: seen.update(k) or real(*a, **k)
    try:
        out = model(ids, pos, mask, labels=labels, output_processor=lm.log_probs_processor,
                    output_processor_context=dict(temperature=2.0, top_k=5, top_p=0.9, min_p=0.05))
    finally:
        lm.linear_log_probs = real
    assert set(out) == {"log_probs"} and out["log_probs"].shape == labels.shape
    assert (seen["top_k"], seen["top_p"], seen["min_p"], seen["temperature"]) == (5, 0.9, 0.05, 2.0)


def _edited(fn, old: str, new: str, folder):
    """``fn`` with ``old`` replaced by ``new`` in its source, from a module file in ``folder``
    (a megatron-core whose code differs from the one install was written against)."""
    import importlib.util
    import inspect
    import os
    import textwrap

    src = textwrap.dedent(inspect.getsource(fn))
    assert old in src, (fn, old)
    path = os.path.join(folder, f"edited_{fn.__name__}_{abs(hash(new))}.py")
    with open(path, "w") as f:
        f.write("from __future__ import annotations\n" + src.replace(old, new))
    spec = importlib.util.spec_from_file_location(os.path.basename(path)[:-3], path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, fn.__name__)


@contextlib.contextmanager
def _replaced(owner, name, value):
    saved = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, saved)


def _hybrid_errors():
    """HybridModel's install: refusals (the version guard against edited Megatron code, an
    overridden forward, the options of GPTModel's), pipeline chunks, labels by position,
    Megatron's own paths left as they are."""
    import tempfile

    from megatron.core.inference.utils import InferenceMode
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.models.hybrid.hybrid_model import HybridModel
    from megatron.core.transformer import multi_token_prediction as mtp

    import logitless.integrations.megatron as lm

    case = dict(name="hybrid errors", vocab=37, hybrid=True, mtp=True)
    ids, pos, mask, labels, loss_mask, _, _ = _inputs(case, 5)
    with tempfile.TemporaryDirectory() as tmp:
        # Megatron code other than the one install was written against: refused, naming the releases;
        # a comment or a reformatting is not a change
        edits = [(HybridModel, "forward", "if not self.post_process:", "if not (self.post_process or False):"),
                 (mtp, "process_mtp_loss", "mtp_loss_scale = config.mtp_loss_scaling_factor / config.mtp_num_layers",
                  "mtp_loss_scale = 2 * config.mtp_loss_scaling_factor / config.mtp_num_layers")]
        for owner, name, old, new in edits:
            model, _ = _model(case, torch.float32)
            with _replaced(owner, name, _edited(getattr(owner, name), old, new, tmp)):
                with pytest.raises(RuntimeError, match=r"written against its code in megatron-core 0\.19\.0 - 0\.19\.2;"
                                                       r" this megatron-core \(.+\) has other code"):
                    lm.install(model)
            assert type(model) is HybridModel
            commented = _edited(getattr(owner, name), old, f"{old}  # the same code", tmp)
            with _replaced(owner, name, commented):
                assert lm.install(model) is model and type(model) is not HybridModel
        # process_mtp_loss is read only for a model with MTP depths
        model, _ = _model(dict(case, mtp=False), torch.float32)
        with _replaced(mtp, "process_mtp_loss", _edited(mtp.process_mtp_loss, *edits[1][2:], tmp)):
            lm.install(model)

    class Custom(HybridModel):
        def forward(self, *args, **kwargs):
            return super().forward(*args, **kwargs)

    model, _ = _model(case, torch.float32)
    model.__class__ = Custom
    with pytest.raises(ValueError, match="overrides HybridModel.forward"):
        lm.install(model)
    model, _ = _model(case, torch.float32)
    model.config.defer_embedding_wgrad_compute = True
    with pytest.raises(ValueError, match="defer_embedding_wgrad_compute"):
        lm.install(model)
    model, _ = _model(case, torch.float32)
    model.config.fine_grained_activation_offloading = True
    with pytest.raises(ValueError, match="fine_grained_activation_offloading"):
        lm.install(model)
    with pytest.raises(TypeError, match="GPTModel or HybridModel"):
        lm.install(torch.nn.Linear(2, 2))
    # pipeline chunks: the stage without the output layer is left as it is
    model, _ = _model(case, torch.float32)
    first = _hybrid_model(dict(case, post_process=False), model.config)
    chunks = [first, model]
    assert lm.install(chunks) is chunks and type(first) is HybridModel and isinstance(model, HybridModel)
    assert lm.install(model) is model  # idempotent
    with _Forbidden(model) as f:
        out = model(ids, pos, mask, None, labels, loss_mask=loss_mask)  # labels by position
    assert out.shape == labels.shape and f.calls == 3
    with torch.no_grad():  # without labels: Megatron's logits, through its output layer
        assert model(ids, pos, mask).shape == (*ids.shape, 37)
    # under Megatron's inference engine: Megatron's own path; a processor is refused
    InferenceMode.set_active()
    try:
        with pytest.raises(ValueError, match="inference engine"):
            model(ids, pos, mask, labels=labels, output_processor=lm.log_probs_processor)
    finally:
        InferenceMode._is_active = False
    # a GPTModel with MTP: the same guard on process_mtp_loss
    gpt, _ = _model(dict(vocab=37, mtp=True), torch.float32)
    with tempfile.TemporaryDirectory() as tmp:
        with _replaced(mtp, "process_mtp_loss", _edited(mtp.process_mtp_loss, *edits[1][2:], tmp)):
            with pytest.raises(RuntimeError, match="process_mtp_loss"):
                lm.install(gpt)
    assert type(gpt) is GPTModel


SINGLE = [
    dict(name="plain", vocab=37, dtypes=(torch.float32, torch.bfloat16)),
    dict(name="tied+mup", vocab=37, tied=True, mup=True, dtypes=(torch.float32, torch.bfloat16)),
    dict(name="one token", vocab=37, s=1, b=1),
    dict(name="mtp packed", vocab=37, mtp=True, packed=True, dtypes=(torch.float32, torch.bfloat16)),
    dict(name="mtp per-token tied", vocab=37, mtp=True, per_token=True, tied=True),
]
TP2 = [
    dict(name="tp2", vocab=38, tp=2, dtypes=(torch.float32, torch.bfloat16)),
    dict(name="tp2 sp", vocab=38, tp=2, sp=True, dtypes=(torch.float32, torch.bfloat16)),
    dict(name="tp2 sp tied mup mtp", vocab=38, tp=2, sp=True, tied=True, mup=True, mtp=True),
]
LOG_PROBS = dict(name="log_probs", vocab=38, context=dict(temperature=0.7, entropy=True),
                 dtypes=(torch.float32, torch.bfloat16))


def _worker(rank, world, device, layout, cases):
    from megatron.core import parallel_state

    # Megatron allocates a few buffers (MTP's CP roll) on the current CUDA device: here the CPU
    torch.cuda.current_device = lambda: "cpu"
    # and forks the CUDA RNG around the sequence-parallel embedding's dropout (0 here)
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
    get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
    parallel_state.initialize_model_parallel(**layout)
    try:
        for case in cases:
            if case.get("float64"):
                _float64_case(case)
            elif case.get("context") is not None:
                _log_probs_case(case)
            elif case.get("errors"):
                _hybrid_errors() if case.get("hybrid") else _install_errors()
            else:
                _check_case(case)
    finally:
        parallel_state.destroy_model_parallel()


def test_single_rank_head():
    """TP=1 (two data-parallel ranks): fp32/bf16 (Float16Module), tied, MuP, one token,
    MTP with packed THD sequences and per-token loss; float64; log-probs; install errors."""
    cases = SINGLE + [dict(name="f64", vocab=37, float64=True, mup=True),
                      dict(name="f64 log_probs", vocab=37, float64=True, context=dict(temperature=0.7)),
                      dict(LOG_PROBS, vocab=37), dict(name="errors", errors=True)]
    spawn(_worker, 2, dict(tensor_model_parallel_size=1), cases, backend="gloo")


def test_tensor_parallel_head():
    """TP=2, with and without sequence parallel, MTP, tied, MuP; float64; log-probs."""
    cases = TP2 + [dict(name="f64 tp2 sp", vocab=38, tp=2, sp=True, float64=True),
                   dict(LOG_PROBS, tp=2, sp=True)]
    spawn(_worker, 2, dict(tensor_model_parallel_size=2), cases, backend="gloo")


def test_context_parallel_head():
    """CP=2: the per-token loss of each rank's chunk, and MTP's rolls across the CP ranks."""
    cases = [dict(name="cp2", vocab=37, cp=2), dict(name="cp2 mtp", vocab=37, cp=2, mtp=True)]
    spawn(_worker, 2, dict(tensor_model_parallel_size=1, context_parallel_size=2), cases, backend="gloo")


HYBRID = [
    dict(name="hybrid", vocab=37, hybrid=True, dtypes=(torch.float32, torch.bfloat16)),
    dict(name="hybrid tied+mup", vocab=37, hybrid=True, tied=True, mup=True, positional=True),
    dict(name="hybrid one token", vocab=37, hybrid=True, s=1, b=1),
    dict(name="hybrid mtp packed", vocab=37, hybrid=True, mtp=True, packed=True,
         dtypes=(torch.float32, torch.bfloat16)),
    dict(name="hybrid mtp per-token tied", vocab=37, hybrid=True, mtp=True, per_token=True, tied=True),
]


def test_hybrid_model():
    """HybridModel (TP=1, two data-parallel ranks): fp32/bf16 (Float16Module), tied, MuP, one
    token, MTP depths of the hybrid pattern with packed THD sequences and per-token loss,
    labels by position; float64; log-probs; the version guard and the other refusals."""
    cases = HYBRID + [dict(name="hybrid f64", vocab=37, hybrid=True, float64=True, mup=True),
                      dict(name="hybrid f64 log_probs", vocab=37, hybrid=True, float64=True,
                           context=dict(temperature=0.7, entropy=True)),
                      dict(LOG_PROBS, vocab=37, hybrid=True), dict(name="hybrid errors", errors=True, hybrid=True)]
    spawn(_worker, 2, dict(tensor_model_parallel_size=1), cases, backend="gloo")


def test_hybrid_model_tensor_and_context_parallel():
    """HybridModel under TP=2 with sequence parallel (MTP, tied, MuP; float64; log-probs), and CP=2
    with MTP."""
    cases = [dict(name="hybrid tp2 sp", vocab=38, tp=2, sp=True, hybrid=True, dtypes=(torch.float32, torch.bfloat16)),
             dict(name="hybrid tp2 sp tied mup mtp", vocab=38, tp=2, sp=True, tied=True, mup=True, mtp=True,
                  hybrid=True),
             dict(name="hybrid f64 tp2 sp", vocab=38, tp=2, sp=True, float64=True, hybrid=True),
             dict(LOG_PROBS, tp=2, sp=True, hybrid=True)]
    spawn(_worker, 2, dict(tensor_model_parallel_size=2), cases, backend="gloo")
    spawn(_worker, 2, dict(tensor_model_parallel_size=1, context_parallel_size=2),
          [dict(name="hybrid cp2 mtp", vocab=37, cp=2, mtp=True, hybrid=True)], backend="gloo")


def _doc_blocks(first_line: str) -> list:
    """The Python blocks of docs/megatron.md whose first line starts with ``first_line``."""
    import pathlib
    import re

    text = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "megatron.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    return [b for b in blocks if b.startswith(first_line)]


def test_docs_cpu_block_runs_pasted_alone():
    """docs/megatron.md's CPU block, as a user pastes it: a fresh Python process, nothing else."""
    import os
    import subprocess
    import sys

    from tests._distributed import free_port

    blocks = _doc_blocks("# runs on a CPU")
    assert len(blocks) == 1
    env = dict(os.environ, MASTER_PORT=str(free_port()))
    src = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")
    env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    # with INFO logging on, as a training script's logging set-up has it: install says once that logitless is active
    code = "import logging\nlogging.basicConfig(level=logging.INFO)\n" + blocks[0]
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "torch.Size([2, 32]) torch.Size([2, 32]) torch.Size([2, 32])"
    active = [line for line in done.stderr.splitlines() if "logitless is active" in line]
    assert active == ["INFO:logitless:logitless is active (megatron): HybridModel's loss from the output layer's "
                      "weight, no logits (its tail run by logitless)"], done.stderr[-3000:]
