"""Megatron Core (>= 0.18; tested on 0.19.2): the LM loss, MTP losses and RL log-probs of
a ``GPTModel`` computed by logitless from the hidden states and the vocabulary-parallel
output layer's weight, without the (tokens x vocab) logits.

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
  pipeline chunks), and the MTP depths' losses run through logitless too. A configuration
  this module cannot serve raises ``ValueError`` naming the option.

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

__all__ = ["output_processor", "log_probs_processor", "install"]

#: Attribute set on an installed model's output layer: the MTP losses of its model run
#: through logitless.
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
    x, weight, bias, group, partial = _head(output_layer, output_weight, hidden_states)
    # softmax(c * z / T) == softmax(z / (T / c)): MuP's scale goes into the temperature
    out = linear_log_probs(x, weight, labels.transpose(0, 1), bias, temperature=temperature / _logit_scale(config),
                           entropy=want_entropy, process_group=group, partial_dx=partial, **extras)
    if want_entropy:
        lp, ent = out
        return {"log_probs": lp.transpose(0, 1).contiguous(), "entropy": ent.transpose(0, 1).contiguous()}
    return {"log_probs": out.transpose(0, 1).contiguous()}


# ----------------------------------------------------------------------------- install


def _unwrap(module):
    """The GPTModel inside DDP / Float16Module / FSDP wrappers (their ``.module``)."""
    seen = 0
    while hasattr(module, "module") and seen < 16:
        module = module.module
        seen += 1
    return module


def _check(gpt) -> None:
    """Raises ValueError naming the first option of ``gpt`` the processor cannot serve."""
    from megatron.core import tensor_parallel
    from megatron.core.models.common.language_module.language_module import LanguageModule

    cfg = gpt.config
    layer = gpt.output_layer
    if type(layer) is not tensor_parallel.ColumnParallelLinear:
        raise ValueError(f"output layer {type(layer).__name__} is not Megatron's ColumnParallelLinear (e.g. the "
                         "MXFP8 output projection, fp8_recipe/fp8_output_proj): logitless reads its weight as the "
                         "head; install on a model with the plain ColumnParallelLinear output layer")
    if type(gpt).compute_language_model_loss is not LanguageModule.compute_language_model_loss:
        raise ValueError(f"{type(gpt).__name__} overrides compute_language_model_loss: logitless computes "
                         "Megatron's cross-entropy only; do not install on a model with another loss")
    if type(gpt)._scale_logits is not LanguageModule._scale_logits:
        raise ValueError(f"{type(gpt).__name__} overrides _scale_logits: logitless folds only MuP's "
                         "mup_output_mult into the head; do not install on a model with another logit scaling")
    if getattr(cfg, "defer_embedding_wgrad_compute", False):
        raise ValueError("defer_embedding_wgrad_compute=True: the output layer's weight gradient is deferred to "
                         "the pipeline flush, which a logitless head does not do; set it to False to install")
    if getattr(layer, "disable_grad_reduce", False) or getattr(layer, "explicit_expert_comm", False):
        raise ValueError("output layer with disable_grad_reduce / explicit_expert_comm: its input gradient is "
                         "not reduced over the TP group as logitless reduces it; not supported")
    if not getattr(gpt, "parallel_output", True):
        raise ValueError("parallel_output=False (logits gathered over the TP group): Megatron's loss expects "
                         "vocab-parallel logits; install needs parallel_output=True")


def _mtp_loss(hidden_states, labels, loss_mask, output_layer, output_weight, runtime_gather_output,
              is_training, compute_language_model_loss, config, cp_group=None, tp_group=None,
              packed_seq_params=None, scale_logits_fn=None, input_ids=None):
    """Megatron's ``process_mtp_loss`` with each depth's loss (and acceptance counts) from
    logitless: the same rolls, masks, depth scaling, logging and MTPLossAutoScaler."""
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


def _install_mtp_dispatch() -> None:
    """GPTModel's module-level ``process_mtp_loss`` becomes a dispatcher: an installed
    model's output layer gets ``_mtp_loss``, every other model Megatron's own function."""
    from megatron.core.models.gpt import gpt_model

    current = gpt_model.process_mtp_loss
    if getattr(current, _MARK, False):
        return
    original = current

    def process_mtp_loss(*args, **kwargs):
        layer = kwargs.get("output_layer", args[3] if len(args) > 3 else None)
        if getattr(layer, _MARK, False):
            return _mtp_loss(*args, **kwargs)
        return original(*args, **kwargs)

    setattr(process_mtp_loss, _MARK, True)
    process_mtp_loss.__wrapped__ = original
    gpt_model.process_mtp_loss = process_mtp_loss


def install(model):
    """Makes ``model(input_ids, position_ids, attention_mask, labels=labels, ...)`` compute
    its loss with ``output_processor`` (and the MTP depths' losses with logitless), for
    a Megatron Core ``GPTModel``, the same inside wrappers with ``.module`` (DDP,
    Float16Module), or a list of pipeline chunks (only the post-process chunk has a head;
    the others are left as they are). A call that passes its own ``output_processor``
    keeps it; a call without labels runs Megatron's own path (logits). Idempotent.

    Raises:
        TypeError: no GPTModel inside ``model`` (or a chunk of it).
        ValueError: a configuration logitless cannot serve, naming the option (another
            output layer class, an overridden ``compute_language_model_loss``,
            ``defer_embedding_wgrad_compute``, ``parallel_output=False``, ...).
    Returns ``model``.
    """
    from megatron.core.models.gpt.gpt_model import GPTModel

    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    gpts = []
    for chunk in chunks:
        gpt = _unwrap(chunk)
        if not isinstance(gpt, GPTModel):
            raise TypeError(f"install expects a megatron.core GPTModel (or a wrapper of one, or a list of them), "
                            f"got {type(gpt).__name__}")
        if gpt.post_process:
            _check(gpt)
            gpts.append(gpt)
    for gpt in gpts:
        if not getattr(gpt, _MARK, False):
            setattr(gpt.output_layer, _MARK, True)
            gpt.__class__ = _installed_class(type(gpt))
    if gpts:
        _install_mtp_dispatch()
    return model


#: GPTModel class -> its installed subclass (one per class)
_CLASSES: dict = {}


def _installed_class(base):
    """``base`` with a ``forward`` that defaults ``output_processor`` when labels are given
    (a subclass, not an instance attribute: no bound method of one model held by it)."""
    cls = _CLASSES.get(base)
    if cls is None:
        def forward(self, *args, **kwargs):
            labels = kwargs.get("labels", args[4] if len(args) > 4 else None)
            if labels is not None and kwargs.get("output_processor") is None:
                kwargs["output_processor"] = output_processor
            return base.forward(self, *args, **kwargs)

        forward.__doc__ = base.forward.__doc__
        cls = type(base.__name__, (base,), {"forward": forward, _MARK: True, "__module__": __name__,
                                            "__qualname__": f"installed.{base.__qualname__}"})
        _CLASSES[base] = cls
    return cls
