"""Megatron Core (>= 0.18; tested on 0.19.2): the LM loss, MTP losses and RL log-probs of
a ``GPTModel`` or ``HybridModel`` computed by logitless from the hidden states and the
vocabulary-parallel output layer's weight, without the (tokens x vocab) logits
(docs/megatron.md).

- ``output_processor``: the callable ``GPTModel.forward(..., output_processor=...)`` calls
  in ``_postprocess``. With labels it returns what Megatron's
  ``compute_language_model_loss`` returns (the per-token loss (b, s), fp32), with the same
  gradients to the hidden states and the head; without labels, Megatron's logits (b, s, V/tp),
  from Megatron's own output layer.
- ``log_probs_processor``: the per-token log-probs of ``labels`` (and the entropy) at a
  temperature, with optional top-k / top-p / min-p, read from ``output_processor_context``
  (a dict: ``temperature``, ``entropy``, ``top_k``, ``top_p``, ``min_p``); returns
  ``{"log_probs": (b, s)}`` plus ``"entropy": (b, s)`` when asked.
- ``install(model)``: the plain ``model(...)`` call with labels then uses
  ``output_processor`` (a model, a wrapper such as DDP / Float16Module, or a list of
  pipeline chunks), and the MTP depths' losses run through logitless too. GPTModel without
  MTP through Megatron's ``output_processor`` seam; GPTModel with MTP and HybridModel (no
  seam) by running the model's own forward up to the hidden states and the rest here,
  after a check of the Megatron code that runs around (``_plan``, ``_DIGESTS``). A
  configuration this module cannot serve raises ``ValueError`` naming the option; Megatron
  code other than the one it was written against, ``RuntimeError`` naming the releases.

Layouts served: the output layer's weight is this rank's rows of the head (tensor
parallel: logitless' ``process_group=`` on the layer's TP group); with sequence parallel
the hidden states are all-gathered along the sequence as ColumnParallelLinear does, and
the gradient reduce-scattered back; context parallel and packed (THD) sequences are
per-token and local; tied embeddings (``output_weight``); MuP's ``mup_output_mult``
(the logits' scale, folded into the hidden states for the loss and into the temperature
for log-probs). Padding rows of the vocabulary stay in the softmax, as in Megatron.

Megatron is imported only inside the functions: importing this module needs no Megatron.
"""

from __future__ import annotations

from typing import Any, Optional

from torch import Tensor

from logitless.ops.linear_cross_entropy import linear_cross_entropy
from logitless.ops.linear_log_probs import linear_log_probs

from ._announce import announce

__all__ = ["output_processor", "log_probs_processor", "install"]

#: Set on an installed model class (True) and on an installed model (its plan: "seam" or "tail").
_MARK = "_logitless_megatron"
_CONTEXT_KEYS = ("temperature", "entropy", "top_k", "top_p", "min_p")


def _logit_scale(config) -> float:
    """MuP's output multiplier (Megatron's ``_scale_logits``), 1.0 without MuP."""
    if config is not None and getattr(config, "use_mup", False):
        return float(config.mup_output_mult)
    return 1.0


def _head(output_layer, output_weight, hidden_states: Tensor):
    """(x (s, b, h) holding every token of the sequence, weight, bias, tp group or None,
    partial_dx): the inputs of the logitless call that replaces ``output_layer``."""
    from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

    weight = output_layer.weight if output_weight is None else output_weight
    bias = output_layer.bias if getattr(output_layer, "bias", None) is not None \
        and not output_layer.skip_bias_add else None
    group = output_layer.tp_group
    tp = group.size() if group is not None else 1
    if tp == 1:
        return hidden_states, weight, bias, None, False
    if output_layer.sequence_parallel:
        # ColumnParallelLinear's all-gather; its backward reduce-scatters the partial dx
        x = gather_from_sequence_parallel_region(hidden_states, tensor_parallel_output_grad=True, group=group)
        return x, weight, bias, group, True
    return hidden_states, weight, bias, group, False  # the op all-reduces dx itself (fp32)


def _per_token_loss(hidden_states: Tensor, output_layer, output_weight, labels: Tensor, config,
                    stats: bool = False):
    """Megatron's per-token LM loss (b, s) fp32 (and logitless' LossStats with ``stats``)."""
    x, weight, bias, group, partial = _head(output_layer, output_weight, hidden_states)
    scale = _logit_scale(config)
    if scale != 1.0:
        x = x * scale  # (x @ W.T + b) * c == (c x) @ W.T + c b
        bias = None if bias is None else bias * scale
    target = labels.transpose(0, 1)  # (b, s) -> (s, b), like x's leading dims
    out = linear_cross_entropy(x, weight, target, bias, reduction="none", process_group=group,
                               partial_dx=partial, return_stats=stats)
    if stats:
        loss, st = out
        return loss.transpose(0, 1).contiguous(), st
    return out.transpose(0, 1).contiguous()


def _megatron_logits(hidden_states, output_layer, output_weight, runtime_gather_output, scale_logits):
    logits, _ = output_layer(hidden_states, weight=output_weight, runtime_gather_output=runtime_gather_output)
    if scale_logits is not None:
        logits = scale_logits(logits)
    return logits.transpose(0, 1).contiguous()  # [s b h] => [b s h], as GPTModel returns them


def output_processor(*, hidden_states: Tensor, output_layer, output_weight: Optional[Tensor] = None,
                     labels: Optional[Tensor] = None, runtime_gather_output=None, scale_logits=None,
                     config=None, **_unused: Any) -> Tensor:
    """Megatron Core's ``output_processor``: ``GPTModel._postprocess`` calls it with keyword
    arguments (hidden_states (s, b, h), output_layer, output_weight, labels (b, s),
    loss_mask, packed_seq_params, config, scale_logits, ...; the others are not needed).

    Returns: with ``labels``, the per-token cross-entropy (b, s) fp32, what
    ``compute_language_model_loss(labels, logits)`` returns (Megatron masks and averages
    it with ``loss_mask`` itself), computed without logits; without labels, the logits
    (b, s, V/tp) from ``output_layer`` as Megatron computes them.
    """
    if labels is None:
        return _megatron_logits(hidden_states, output_layer, output_weight, runtime_gather_output, scale_logits)
    announce("megatron", "the output_processor computes the per-token loss from the output layer's weight, no logits")
    return _per_token_loss(hidden_states, output_layer, output_weight, labels, config)


def log_probs_processor(*, hidden_states: Tensor, output_layer, output_weight: Optional[Tensor] = None,
                        labels: Optional[Tensor] = None, context: Optional[dict] = None, config=None,
                        **_unused: Any) -> dict:
    """An ``output_processor`` for RL: per-token log-probs of ``labels`` (b, s) under
    softmax(logits / temperature), and the entropy of that softmax when asked.

    ``context`` (``output_processor_context=``): None or a dict with any of
    ``temperature`` (default 1.0), ``entropy`` (default False), ``top_k``, ``top_p``,
    ``min_p`` (``logitless.linear_log_probs``' truncation: the log-probs of the
    renormalised truncated distribution, as the sampler drew them).

    Returns ``{"log_probs": (b, s) fp32}`` plus ``"entropy": (b, s) fp32`` with
    ``entropy=True``; gradients flow to the hidden states and the head.
    """
    if labels is None:
        raise ValueError("log_probs_processor needs labels (the tokens whose log-probs are wanted): "
                         "pass labels= to the model's forward")
    ctx = dict(context or {})
    unknown = sorted(set(ctx) - set(_CONTEXT_KEYS))
    if unknown:
        raise ValueError(f"output_processor_context has unknown keys {unknown}; log_probs_processor "
                         f"reads {list(_CONTEXT_KEYS)}")
    want_entropy = bool(ctx.get("entropy", False))
    temperature = float(ctx.get("temperature", 1.0))
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    extras = {}
    if ctx.get("top_k") is not None:
        extras["top_k"] = ctx["top_k"]
    if ctx.get("top_p") is not None and ctx["top_p"] != 1.0:
        extras["top_p"] = ctx["top_p"]
    if ctx.get("min_p") is not None and ctx["min_p"] != 0.0:
        extras["min_p"] = ctx["min_p"]
    announce("megatron", "log_probs_processor computes the RL log-probs from the output layer's weight, no logits")
    x, weight, bias, group, partial = _head(output_layer, output_weight, hidden_states)
    # softmax(c * z / T) == softmax(z / (T / c)): MuP's scale goes into the temperature
    out = linear_log_probs(x, weight, labels.transpose(0, 1), bias, temperature=temperature / _logit_scale(config),
                           entropy=want_entropy, process_group=group, partial_dx=partial, **extras)
    if want_entropy:
        lp, ent = out
        return {"log_probs": lp.transpose(0, 1).contiguous(), "entropy": ent.transpose(0, 1).contiguous()}
    return {"log_probs": out.transpose(0, 1).contiguous()}


# ----------------------------------------------------------------------------- install
#
# GPTModel without MTP: Megatron's public seam, ``forward(..., output_processor=)``; nothing else.
# GPTModel with MTP, and HybridModel (whose forward has no seam): the model's own forward runs up
# to the hidden states, as a pipeline stage without the output layer runs it (``post_process``
# off for the call: both return the decoder's, and the MTP block's, hidden states right there),
# and this module runs the rest: the MTP depths' losses (``_mtp_loss``, Megatron's
# ``process_mtp_loss`` with logitless' loss) and the processor. That runs around Megatron code
# that is not an API, so ``install`` checks that code first (``_check_code``): its digest must be
# one this module was written against, or install refuses, naming the releases.

#: The megatron-core releases whose code ``_DIGESTS`` pins (0.19.0, 0.19.1 and 0.19.2 have the same).
_WRITTEN_AGAINST = "megatron-core 0.19.0 - 0.19.2"
#: The Megatron functions install runs around, by the digest of their code (``_code_digest``).
_DIGESTS = {
    # copied by _mtp_loss (each depth's loss from logitless; the rolls, masks, scaling, logging kept)
    "megatron.core.transformer.multi_token_prediction.process_mtp_loss": "103e1726de653ef6",
    # run with post_process off: they return the (decoder + MTP block) hidden states before the loss
    "megatron.core.models.gpt.gpt_model.GPTModel.forward": "6d1247775fb4f57f",
    "megatron.core.models.gpt.gpt_model.GPTModel._postprocess": "c14b909619a74453",
    "megatron.core.models.hybrid.hybrid_model.HybridModel.forward": "ef3b1f6c04a45e11",
}


def _code_digest(fn) -> str:
    """sha256 (16 hex digits) of ``fn``'s syntax tree without its docstring: a comment or a
    reformatting keeps it, any change to the code changes it."""
    import ast
    import hashlib
    import inspect
    import textwrap

    node = ast.parse(textwrap.dedent(inspect.getsource(fn))).body[0]
    body = node.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and isinstance(body[0].value.value, str):
        node.body = body[1:]
    return hashlib.sha256(ast.dump(node, include_attributes=False).encode()).hexdigest()[:16]


def _megatron_version() -> str:
    try:
        from importlib.metadata import version

        return version("megatron-core")
    except Exception:  # an install without metadata (a source checkout on PYTHONPATH)
        from megatron.core import package_info

        return str(package_info.__version__)


def _check_code(fn, name: str, why: str, instead: str) -> None:
    """Raises RuntimeError unless ``fn`` (Megatron's ``name``) has the code this module was
    written against."""
    try:
        digest = _code_digest(fn)
    except (OSError, TypeError, SyntaxError):  # no source to read
        digest = None
    if digest != _DIGESTS[name]:
        raise RuntimeError(
            f"logitless.integrations.megatron.install: {why} runs around megatron-core's {name}, "
            f"written against its code in {_WRITTEN_AGAINST}; this megatron-core ({_megatron_version()}) has "
            f"other code there, which logitless has not been checked against. Use {_WRITTEN_AGAINST}, "
            f"or {instead}")


def _unwrap(module):
    """The model inside DDP / Float16Module / FSDP wrappers (their ``.module``)."""
    seen = 0
    while hasattr(module, "module") and seen < 16:
        module = module.module
        seen += 1
    return module


def _model_classes() -> tuple:
    """(GPTModel, HybridModel) as this megatron-core has them (HybridModel: >= 0.18)."""
    from megatron.core.models.gpt.gpt_model import GPTModel

    try:
        from megatron.core.models.hybrid.hybrid_model import HybridModel
    except ImportError:
        return (GPTModel,)
    return (GPTModel, HybridModel)


def _original(cls):
    """The class install started from (``cls`` itself when not installed)."""
    return cls.__mro__[1] if cls.__dict__.get(_MARK) else cls


def _check(model) -> None:
    """Raises ValueError naming the first option of ``model`` the processor cannot serve."""
    from megatron.core import tensor_parallel
    from megatron.core.models.common.language_module.language_module import LanguageModule

    cfg = model.config
    layer = model.output_layer
    name = _original(type(model)).__name__
    if type(layer) is not tensor_parallel.ColumnParallelLinear:
        raise ValueError(f"output layer {type(layer).__name__} is not Megatron's ColumnParallelLinear (e.g. the "
                         "MXFP8 output projection, fp8_recipe/fp8_output_proj): logitless reads its weight as the "
                         "head; install on a model with the plain ColumnParallelLinear output layer")
    if type(model).compute_language_model_loss is not LanguageModule.compute_language_model_loss:
        raise ValueError(f"{name} overrides compute_language_model_loss: logitless computes "
                         "Megatron's cross-entropy only; do not install on a model with another loss")
    if type(model)._scale_logits is not LanguageModule._scale_logits:
        raise ValueError(f"{name} overrides _scale_logits: logitless folds only MuP's "
                         "mup_output_mult into the head; do not install on a model with another logit scaling")
    if getattr(cfg, "defer_embedding_wgrad_compute", False):
        raise ValueError("defer_embedding_wgrad_compute=True: the output layer's weight gradient is deferred to "
                         "the pipeline flush, which a logitless head does not do; set it to False to install")
    if getattr(layer, "disable_grad_reduce", False) or getattr(layer, "explicit_expert_comm", False):
        raise ValueError("output layer with disable_grad_reduce / explicit_expert_comm: its input gradient is "
                         "not reduced over the TP group as logitless reduces it; not supported")
    if not getattr(model, "parallel_output", True):
        raise ValueError("parallel_output=False (logits gathered over the TP group): Megatron's loss expects "
                         "vocab-parallel logits; install needs parallel_output=True")


def _mtp_in_tail(model) -> bool:
    """Whether Megatron's own code would run ``process_mtp_loss`` after the hidden states
    (GPTModel._postprocess: any ``mtp_num_layers``; HybridModel.forward: ``mtp_num_layers``
    and this chunk's MTP block)."""
    from megatron.core.models.gpt.gpt_model import GPTModel

    if isinstance(model, GPTModel):
        return bool(model.config.mtp_num_layers)
    return model.config.mtp_num_layers is not None and bool(model.mtp_process)


def _plan(model) -> str:
    """How ``install`` serves ``model`` (checked): "seam" (GPTModel without MTP: Megatron's
    ``output_processor``) or "tail" (this module runs the loss after the hidden states)."""
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer import multi_token_prediction

    base = _original(type(model))
    mtp = _mtp_in_tail(model)
    if isinstance(model, GPTModel) and not mtp:
        return "seam"
    what = "HybridModel" if not isinstance(model, GPTModel) else "a GPTModel with MTP (mtp_num_layers)"
    instead = ("call the model without install (Megatron's own loss)" if not isinstance(model, GPTModel) else
               "pass output_processor=logitless.integrations.megatron.output_processor to the model's forward "
               "without install (the main loss through logitless, the MTP depths' through Megatron's logits)")
    if getattr(model.config, "fine_grained_activation_offloading", False):
        raise ValueError(f"fine_grained_activation_offloading=True: install on {what} runs the model's forward with "
                         "post_process off, which that offloading reads; not supported")
    if isinstance(model, GPTModel):
        for fn, name in ((base.forward, "GPTModel.forward"), (base._postprocess, "GPTModel._postprocess")):
            if fn is not getattr(GPTModel, name.split(".")[1]):
                raise ValueError(f"{base.__name__} overrides {name}: install on {what} runs GPTModel's own; "
                                 "not supported")
            _check_code(fn, f"megatron.core.models.gpt.gpt_model.{name}", f"install on {what}", instead)
    else:
        hybrid = _model_classes()[1]
        if base.forward is not hybrid.forward:
            raise ValueError(f"{base.__name__} overrides HybridModel.forward: install runs HybridModel's own; "
                             "not supported")
        _check_code(base.forward, "megatron.core.models.hybrid.hybrid_model.HybridModel.forward",
                    f"install on {what}", instead)
    if mtp:
        _check_code(multi_token_prediction.process_mtp_loss,
                    "megatron.core.transformer.multi_token_prediction.process_mtp_loss",
                    "the MTP depths' losses through logitless (a copy of it)", instead)
    return "tail"


def install(model):
    """Makes ``model(input_ids, position_ids, attention_mask, labels=labels, ...)`` compute
    its loss with ``output_processor`` without the logits, and the MTP depths' losses with
    logitless, for a Megatron Core ``GPTModel`` or ``HybridModel``, the same inside wrappers
    with ``.module`` (DDP, Float16Module), or a list of pipeline chunks (only the
    post-process chunk has a head; the others are left as they are). The call takes
    ``output_processor=`` / ``output_processor_context=`` (``log_probs_processor`` for RL),
    HybridModel's too; a call without labels and without a processor runs Megatron's own
    path (logits). Idempotent.

    GPTModel without MTP goes through Megatron's ``output_processor`` seam. GPTModel with
    MTP and HybridModel run Megatron code that is not an API (``_plan``): install checks it
    against the code of the releases it was written against and raises otherwise.

    Raises:
        TypeError: no GPTModel / HybridModel inside ``model`` (or a chunk of it).
        ValueError: a configuration logitless cannot serve, naming the option (another
            output layer class, an overridden ``compute_language_model_loss``,
            ``defer_embedding_wgrad_compute``, ``parallel_output=False``, ...).
        RuntimeError: Megatron code it runs around is not the code of the megatron-core
            releases it was written against (the message names them).
    Returns ``model``.
    """
    classes = _model_classes()
    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    plans = []
    for chunk in chunks:
        inner = _unwrap(chunk)
        if not isinstance(inner, classes):
            raise TypeError(f"install expects a megatron.core GPTModel or HybridModel (or a wrapper of one, or a "
                            f"list of them), got {type(inner).__name__}")
        if inner.post_process:
            _check(inner)
            plans.append((inner, _plan(inner)))
    for inner, plan in plans:
        base = _original(type(inner))
        inner.__class__ = _installed_class(base)
        inner.__dict__[_MARK] = plan
        announce("megatron", f"{base.__name__}'s loss from the output layer's weight, no logits "
                             f"({'the output_processor seam' if plan == 'seam' else 'its tail run by logitless'})")
    return model


#: model class -> its installed subclass (one per class)
_CLASSES: dict = {}


def _installed_class(base):
    """``base`` with a ``forward`` that runs the loss through logitless when labels (or a
    processor) are given (a subclass, not an instance attribute: no bound method of one
    model held by it)."""
    import inspect

    cls = _CLASSES.get(base)
    if cls is None:
        signature = inspect.signature(base.forward)

        def forward(self, *args, **kwargs):
            return _forward(self, base, signature, args, kwargs)

        forward.__doc__ = base.forward.__doc__
        cls = type(base.__name__, (base,), {"forward": forward, _MARK: True, "__module__": __name__,
                                            "__qualname__": f"installed.{base.__qualname__}"})
        _CLASSES[base] = cls
    return cls


def _forward(model, base, signature, args, kwargs):
    given = kwargs.pop("output_processor", None)
    context = kwargs.pop("output_processor_context", None)
    call = signature.bind(model, *args, **kwargs).arguments  # the arguments by name, as forward binds them
    processor = given if given is not None else output_processor if call.get("labels") is not None else None
    plan = model.__dict__.get(_MARK)
    if processor is None or plan is None:  # no labels: Megatron's logits (plan None: a stage without the head)
        return base.forward(model, *args, **kwargs)
    if plan == "seam":
        return base.forward(model, *args, output_processor=processor, output_processor_context=context, **kwargs)
    from megatron.core.inference.utils import InferenceMode

    if InferenceMode.is_active():  # Megatron's engine: its own path (logits, KV cache, speculative MTP)
        if given is not None:
            raise ValueError("output_processor= under Megatron's inference engine: install serves training and "
                             "log-probs outside it (GPTModel with MTP, HybridModel); call the model without it")
        return base.forward(model, *args, **kwargs)
    model.post_process = False  # the forward returns its hidden states, as a stage without the head does
    try:
        hidden_states = base.forward(model, *args, **kwargs)
    finally:
        model.post_process = True
    return _tail(model, hidden_states, call, processor, context)


def _tail(model, hidden_states, call: dict, processor, context):
    """What GPTModel._postprocess / HybridModel.forward do after the hidden states (training,
    not inference), with the MTP losses from logitless and the output layer and loss replaced
    by ``processor`` (called as GPTModel calls its ``output_processor``)."""
    output_weight = model.shared_embedding_or_output_weight() if model.share_embeddings_and_output_weights else None
    if _mtp_in_tail(model):
        hidden_states = _mtp_loss(hidden_states, call.get("labels"), call.get("loss_mask"), model.output_layer,
                                  output_weight, model.training, model.config, cp_group=model.pg_collection.cp,
                                  packed_seq_params=call.get("packed_seq_params"), input_ids=call.get("input_ids"))
    return processor(hidden_states=hidden_states, output_layer=model.output_layer, output_weight=output_weight,
                     labels=call.get("labels"), loss_mask=call.get("loss_mask"), input_ids=call.get("input_ids"),
                     position_ids=call.get("position_ids"), attention_mask=call.get("attention_mask"),
                     decoder_input=call.get("decoder_input"), inference_context=call.get("inference_context"),
                     packed_seq_params=call.get("packed_seq_params"),
                     runtime_gather_output=call.get("runtime_gather_output"), context=context,
                     compute_language_model_loss=model.compute_language_model_loss,
                     scale_logits=model._scale_logits, config=model.config)


def _mtp_loss(hidden_states, labels, loss_mask, output_layer, output_weight, is_training, config, *,
              cp_group=None, packed_seq_params=None, input_ids=None):
    """Megatron's ``process_mtp_loss`` (megatron-core 0.19; ``_DIGESTS`` pins the code) with
    each depth's loss (and acceptance counts) from logitless: the same rolls, masks, depth
    scaling, logging and MTPLossAutoScaler."""
    import torch
    from megatron.core import parallel_state
    from megatron.core.transformer import multi_token_prediction as mtp

    chunks = torch.chunk(hidden_states, 1 + config.mtp_num_layers, dim=0)
    hidden_states = chunks[0]
    derived = False
    if labels is None:
        if input_ids is None:
            return hidden_states
        labels, _ = mtp.roll_tensor(input_ids, shifts=-1, dims=-1, cp_group=cp_group,
                                    packed_seq_params=packed_seq_params)
        derived = True
    if config.mtp_detach_heads:
        output_weight = (output_layer.weight if output_weight is None else output_weight).detach()
    mtp_labels = labels.clone()
    if loss_mask is None:
        loss_mask = torch.ones_like(mtp_labels)
    if derived:
        loss_mask, _ = mtp.roll_tensor(loss_mask, shifts=-1, dims=-1, cp_group=cp_group,
                                       packed_seq_params=packed_seq_params)
    original_num_tokens = loss_mask.sum()
    for depth in range(config.mtp_num_layers):
        mtp_labels, _ = mtp.roll_tensor(mtp_labels, shifts=-1, dims=-1, cp_group=cp_group,
                                        packed_seq_params=packed_seq_params)
        loss_mask, num_tokens = mtp.roll_tensor(loss_mask, shifts=-1, dims=-1, cp_group=cp_group,
                                                packed_seq_params=packed_seq_params)
        mtp_loss, stats = _per_token_loss(chunks[depth + 1], output_layer, output_weight, mtp_labels, config,
                                          stats=True)
        mtp_loss = loss_mask * mtp_loss
        if is_training:
            mtp_loss_for_log = (torch.sum(mtp_loss) * (num_tokens > 0).to(mtp_loss.dtype)) / num_tokens.clamp(min=1)
            with torch.no_grad():
                valid = loss_mask.bool()
                correct = (stats.correct.transpose(0, 1) & valid).sum().float()
                total = valid.sum().float()
            mtp.MTPLossLoggingHelper.save_metrics_to_tracker(
                mtp_loss_for_log, correct, total, depth, config.mtp_num_layers,
                avg_group=parallel_state.get_data_parallel_group(with_context_parallel=True))
        scale = config.mtp_loss_scaling_factor / config.mtp_num_layers
        if config.calculate_per_token_loss:
            normalized = scale * mtp_loss * (original_num_tokens / torch.clamp(num_tokens, min=1))
            hidden_states = mtp.MTPLossAutoScaler.apply(hidden_states, normalized)
        else:
            hidden_states = mtp.MTPLossAutoScaler.apply(hidden_states, scale * mtp_loss / num_tokens.clamp(min=1))
    return hidden_states
