"""``patch``: a transformers model's training forward computes its loss without logits.

Mechanism (the same for every family; no copied forwards):

1. At patch time two attributes are set on the *instance*: ``model.forward`` (the patched
   forward below) and ``head.forward`` on the LM head (``model.get_output_embeddings()``).
   Nothing is swapped per call, so ``torch.compile`` traces the patched model (also with
   ``fullgraph=True``) and module hooks on the head (FSDP2's and DeepSpeed ZeRO-3's weight
   gathering, PEFT) run as usual: the head is still *called* by the model's own code, and
   its weight is read only inside its ``forward``, after every forward pre-hook.
2. In training mode with ``labels``, the patched forward records a job (labels, the
   family's logit transform, ``shift_labels``, ``num_items_in_batch``, ``ignore_index``) on
   a small state object shared by the model and its head, and calls the model's own
   forward with ``labels=None``: every other argument (pixel values, image grids,
   ``output_router_logits`` ...) is passed through untouched.
3. The head's forward, finding the job, computes ``hf_causal_lm_loss`` on exactly what the
   head receives (the last hidden state sliced by ``logits_to_keep``) and returns an empty
   ``(..., 0)`` tensor for the logits; the model's transforms run on it for free.
4. The patched forward adds the router auxiliary loss for MoE families exactly as
   transformers does (``loss + coef * aux_loss``, the ``aux_loss`` the model returned) and
   returns the model's output class with ``loss`` set and ``logits=None``.

Without labels or in eval mode the original forward runs unchanged (generation, metrics).
A trainer that later replaces ``model.forward`` and runs the backbone itself (TRL's fused
LM head) bypasses all of this: a forward pre-hook on the backbone warns once, naming the
fix (``bypass.py``).
The state lives in the instance's ``__dict__``: ``copy.deepcopy`` (TRL's reference
models) gives an independent patched copy; pickling is not supported while patched.
``nn.DataParallel`` (what HF's Trainer uses when one process sees several GPUs) copies each
module per GPU and runs the copies in threads: the patched model and head carry their own
``_replicate_for_data_parallel``, so each copy gets its own state and forwards bound to
itself (``_replicate_model``, ``_replicate_head``).
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import types
from typing import Any, Optional

import torch
from torch import nn

from logitless.options import CrossEntropyOptions, check_memory_budget

from . import bypass as _bypass
from .head import head_out_features, head_refusal
from .loss import hf_causal_lm_loss
from .registry import ADVICE, SUPPORTED, module_name
from .source_check import check_forward_source, forward_transform

#: Options of ``linear_cross_entropy`` that ``patch`` accepts. The rest (reduction,
#: ignore_index, shift, softcap) are fixed by transformers' loss and the model.
ALLOWED_OPTIONS = ("memory_budget", "backend", "z_loss", "label_smoothing")

_STATE = "_logitless_patch"  # on the model: the _State
_HEAD_STATE = "_logitless_head"  # on the head: the same _State
_CLASS_STATE = "_logitless_class_patch"  # on a class patched by patch(cls)
_REPLICATE = "_replicate_for_data_parallel"  # on the model and head: nn.DataParallel's copy (see below)


class _State:
    """Shared by a patched model and its head(s); ``job`` is set only during a patched call."""

    def __init__(self, options: dict, original, params: tuple, var_kw: Optional[str], transform: str):
        self.options = options
        self.transform = transform  # the family's logit transform this class's forward has (forward_transform)
        self.original = original  # the instance's own forward before patching, or None
        self.params = params  # the forward's positional-or-keyword parameter names (no self)
        self.var_kw = var_kw
        self.job = None
        self.result = None
        self.guard = None  # the backbone's bypass detector (bypass.py), or None


def find_model(model) -> nn.Module:
    """The transformers model inside a PeftModel or a torch.compile wrapper (or the model itself)."""
    for _ in range(4):
        if isinstance(model, torch._dynamo.eval_frame.OptimizedModule):
            model = model._orig_mod
            continue
        get_base = getattr(model, "get_base_model", None)
        if callable(get_base) and type(model).__name__.startswith("Peft"):
            model = get_base()
            continue
        break
    return model


def _supported_list() -> str:
    return ", ".join(SUPPORTED)


def _model_class(cls: type) -> type:
    """``cls``, or the class FSDP2's ``fully_shard`` derived ``FSDP<cls>(FSDPModule, cls)`` from."""
    mro = cls.__mro__
    if len(mro) > 2 and mro[1].__name__ == "FSDPModule" and cls.__name__ == f"FSDP{mro[2].__name__}":
        return mro[2]
    return cls


def _class_refusal(cls: type) -> Optional[str]:
    cls = _model_class(cls)
    name = cls.__name__
    if name not in SUPPORTED:
        if name in ADVICE:
            return f"{name} is not supported: {ADVICE[name]}"
        return (f"{name} is not a supported model class (not in logitless.transformers.SUPPORTED; a new family "
                f"is one registry row in logitless/transformers/registry.py plus a test: please open an issue). "
                f"Until then, compute the loss with logitless.linear_cross_entropy on the model's hidden states "
                f"(output_hidden_states=True) and its head weight")
    expected = module_name(SUPPORTED[name])
    if cls.__module__ != expected:
        return (f"{name} is defined in {cls.__module__}, not in {expected} (remote code, a subclass "
                f"or a wrapper); its forward cannot be checked")
    reason = check_forward_source(cls)
    if reason:
        return (f"{name}: {reason}. The installed transformers changed this forward; please report it "
                f"(logitless checks each forward's source so as never to compute a different loss)")
    return None


def _refusal(model) -> Optional[str]:
    if not isinstance(model, nn.Module):
        return f"{type(model).__name__} is not a torch.nn.Module (pass a model instance or a model class)"
    reason = _class_refusal(type(model))
    if reason:
        return reason
    name = type(model).__name__
    if _STATE not in vars(model) and any(_bypass.is_fused_head_forward(f) for f in _bypass.instance_forwards(model)):
        return (f"{name} carries TRL's fused LM head (its trainer runs the backbone and the head itself, so "
                f"patch would never run); use {_bypass.TRL_FIX} instead")
    if "forward" in vars(model) and _STATE not in vars(model) and "_original_forward" not in vars(model):
        # (accelerate's autocast wrapper, which keeps _original_forward, is fine: it calls the original)
        return (f"{name}.forward is already replaced on this instance by another library (e.g. liger-kernel's "
                f"patch); use one of the two")
    head = model.get_output_embeddings()
    if head is None or head is not getattr(model, "lm_head", None):
        return f"{name}.get_output_embeddings() is not model.lm_head (the module its forward calls)"
    reason = head_refusal(head)
    if reason:
        return f"{name}: {reason}"
    if "forward" in vars(head) and vars(head).get(_HEAD_STATE) is None:
        return f"{name}'s head forward is already replaced on the instance by another library"
    vocab = getattr(model.config.get_text_config(), "vocab_size", None)
    if head_out_features(head) != vocab:
        return f"{name}'s head has {head_out_features(head)} outputs but the (text) config's vocab_size is {vocab}"
    from transformers.loss.loss_utils import LOSS_MAPPING

    if model.loss_function is not LOSS_MAPPING["ForCausalLM"]:
        return f"{name} uses a custom loss_function ({model.loss_function!r}), not transformers' ForCausalLMLoss"
    return None


# ---------------------------------------------------------------------- the head


def _head_forward(self, hidden, *args, **kwargs):
    """The patched head: the loss during a patched call, the head's own forward otherwise."""
    state = getattr(self, _HEAD_STATE, None)
    job = None if state is None else state.job
    if job is None or job[0] is not self:
        return type(self).forward(self, hidden, *args, **kwargs)
    _, labels, shift_labels, n_items, ignore_index, softcap, scale, reduction = job
    loss = hf_causal_lm_loss(self, hidden, labels, shift_labels, n_items, ignore_index, softcap, scale,
                             state.options, reduction)
    state.result = loss
    # Stands in for the logits: an empty (..., 0) view *of the loss*. The caller adds
    # ``logits.sum()`` (an exact 0) to the loss, so the loss's gradient flows through the
    # head's output: backward hooks on the head's outputs (DeepSpeed ZeRO-3 re-gathers the
    # weight there) run before the loss's backward reads the weight.
    return _carrier(loss, hidden.shape[:-1])


def _carrier(loss, lead):
    scalar = loss if loss.dim() == 0 else loss.sum()
    return scalar.reshape((1,) * (len(lead) + 1)).expand(*lead, 0)


def _install_head(head: nn.Module, state: _State) -> None:
    if vars(head).get(_HEAD_STATE) is state:
        return
    object.__setattr__(head, "forward", types.MethodType(_head_forward, head))
    object.__setattr__(head, _REPLICATE, types.MethodType(_replicate_head, head))
    object.__setattr__(head, _HEAD_STATE, state)


def _uninstall_head(head: nn.Module, state: _State) -> None:
    if vars(head).get(_HEAD_STATE) is state:
        object.__delattr__(head, "forward")
        object.__delattr__(head, _HEAD_STATE)
        if _REPLICATE in vars(head):
            object.__delattr__(head, _REPLICATE)


# ---------------------------------------------------------------------- nn.DataParallel


def _rebound(fn, old: nn.Module, new: nn.Module):
    """``fn`` bound to ``new`` instead if it is a method bound to ``old``; else ``fn``."""
    if isinstance(fn, types.MethodType) and fn.__self__ is old:
        return types.MethodType(fn.__func__, new)
    return fn


def _replica(module: nn.Module, names: tuple) -> nn.Module:
    """torch's own per-device shallow copy of ``module``, with the instance methods ``names``
    (bound to ``module`` in the copied ``__dict__``) bound to the copy."""
    replica = type(module)._replicate_for_data_parallel(module)
    for name in names:
        fn = vars(replica).get(name)
        if fn is not None:
            object.__setattr__(replica, name, _rebound(fn, module, replica))
    return replica


def _replicate_head(self: nn.Module) -> nn.Module:
    """A patched head's copy for nn.DataParallel: its forward reads the copy's weight. The
    copy keeps the original's state until its model copy's first patched call installs the
    copy's own (``_call``: a head whose state is not the model's is re-installed)."""
    return _replica(self, ("forward", _REPLICATE))


def _replicate_model(self: nn.Module) -> nn.Module:
    """A patched model's copy for nn.DataParallel: its own _State (the copies run at once,
    in threads: one ``job`` each), forwards bound to the copy (the patched one, accelerate's
    ``_original_forward``, a forward of the instance kept as ``state.original``), and no
    bypass guard (the original's warns)."""
    replica = _replica(self, ("forward", "_original_forward", _REPLICATE))
    state = copy.copy(vars(self)[_STATE])
    state.job = state.result = state.guard = None
    state.original = _rebound(state.original, self, replica)
    object.__setattr__(replica, _STATE, state)
    return replica


@torch.compiler.disable
def _install_head_eager(model, head, state) -> None:
    reason = head_refusal(head)
    if reason:
        raise ValueError(f"logitless.transformers: the head of {type(model).__name__} was replaced after patch and "
                         f"is not supported: {reason}; unpatch the model")
    _install_head(head, state)


# ---------------------------------------------------------------------- the model


def family_of(cls: type):
    """The registry row of ``cls`` or of the class it derives from by FSDP2's ``fully_shard`` (``FSDP<cls>``)."""
    name = _model_class(cls).__name__
    if name not in SUPPORTED:
        raise ValueError(f"{name} is not a supported model class")
    return SUPPORTED[name]


def _wrapped_forward(self, state: _State, *args, **kwargs):
    """The forward the patch wraps: the instance's own if it had one, else the class's.
    Called as ``type(self).forward(self, ...)``: torch 2.11's dynamo cannot trace
    ``function.__get__`` (a graph break, fatal under fullgraph=True)."""
    if state.original is not None:
        return state.original(*args, **kwargs)
    return type(self).forward(self, *args, **kwargs)


def _call(self, state: _State, labels, kw: dict, reduction=None):
    """The model's own forward with labels=None and the head computing the loss: (output, loss)."""
    family = family_of(type(self))
    head = self.get_output_embeddings()
    if getattr(head, _HEAD_STATE, None) is not state:  # a new head: LoRA added, resize_token_embeddings
        _install_head_eager(self, head, state)
    softcap, scale = family.softcap_and_scale(self, state.transform)
    kw["labels"] = None
    state.job = (head, labels, kw.get("shift_labels"), kw.get("num_items_in_batch"), kw.get("ignore_index", -100),
                 softcap, scale, reduction)
    try:
        out = _wrapped_forward(self, state, **kw)
        loss = state.result
    finally:
        state.job = None
        state.result = None
    if loss is None:
        raise RuntimeError(f"{type(self).__name__}'s forward did not call its head; the logitless patch cannot be "
                           f"used with it")
    logits = getattr(out, "logits", None)
    if logits is not None and logits.numel() == 0:
        loss = loss + logits.sum()  # an exact 0 that routes the gradient through the head's output
    return out, loss


def _patched_forward(self, *args, **kwargs):
    state = getattr(self, _STATE)
    if not self.training:
        return _wrapped_forward(self, state, *args, **kwargs)
    if len(args) > len(state.params):
        raise TypeError(f"{type(self).__name__}.forward got {len(args)} positional arguments")
    kw = dict(zip(state.params, args))
    kw.update(kwargs)
    labels = kw.get("labels")
    if labels is None:
        return _entered(state, _wrapped_forward, self, state, *args, **kwargs)
    from transformers.loss.loss_utils import LOSS_MAPPING

    if self.loss_function is not LOSS_MAPPING["ForCausalLM"]:
        raise RuntimeError(f"{type(self).__name__}.loss_function was changed after logitless.transformers.patch: "
                           f"unpatch the model to use a custom loss")
    return_dict = kw.pop("return_dict", None)
    if return_dict is None:
        return_dict = getattr(self.config, "return_dict", True)
    if state.var_kw or "return_dict" in state.params:
        kw["return_dict"] = True
    out, loss = _call(self, state, labels, kw)
    coef = family_of(type(self)).router_aux_coef(self)
    aux = getattr(out, "aux_loss", None)
    if coef is not None and aux is not None:
        # as transformers: loss += coef * aux_loss.to(loss.device)
        loss = loss + coef * (aux.to(loss.device) if torch.is_tensor(aux) else aux)
    fields = {f.name: getattr(out, f.name) for f in dataclasses.fields(out)}
    fields.update(loss=loss, logits=None)
    out = type(out)(**fields)
    return out if return_dict else out.to_tuple()


def _entered(state: _State, fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` counted as a logitless path running the backbone (see bypass.py)."""
    guard = state.guard
    if guard is None or torch.compiler.is_compiling():
        return fn(*args, **kwargs)
    guard.entered += 1
    try:
        return fn(*args, **kwargs)
    finally:
        guard.entered -= 1


def run_backbone(model, backbone, *args, **kwargs):
    """``backbone(*args, **kwargs)`` for logitless' own heads that run a (possibly patched)
    model's backbone themselves (``logitless.integrations``): never taken for a bypass of
    the patch. Plain call if the model is not patched."""
    state = vars(find_model(model)).get(_STATE)
    if state is None:
        return backbone(*args, **kwargs)
    return _entered(state, backbone, *args, **kwargs)


def _forward_signature(fn) -> tuple[inspect.Signature, tuple, Optional[str]]:
    sig = inspect.signature(fn)
    params = tuple(p.name for p in sig.parameters.values()
                   if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD))
    var_kw = next((p.name for p in sig.parameters.values() if p.kind is inspect.Parameter.VAR_KEYWORD), None)
    return sig, params, var_kw


_FORWARDS: dict = {}


def _forward_for(cls: type, sig: inspect.Signature):
    """A per-class function showing the class's forward signature (Trainer inspects it)."""
    fn = _FORWARDS.get(cls)
    if fn is None:
        def forward(self, *args, **kwargs):
            return _patched_forward(self, *args, **kwargs)

        self_param = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)
        # No ``__wrapped__``: accelerate's unwrap_model follows it and would drop the patch.
        forward.__signature__ = sig.replace(parameters=[self_param, *sig.parameters.values()])
        forward.__doc__ = cls.forward.__doc__
        forward.__name__ = "forward"
        forward.__qualname__ = f"{cls.__name__}.forward"
        setattr(forward, _bypass.PATCHED_FORWARD_ATTR, True)
        fn = _FORWARDS[cls] = forward
    return fn


def _check_options(loss_options: dict) -> dict:
    unknown = sorted(set(loss_options) - set(ALLOWED_OPTIONS))
    if unknown:
        raise ValueError(f"unknown option(s) {unknown} for logitless.transformers.patch; allowed: "
                         f"{list(ALLOWED_OPTIONS)} (reduction, ignore_index, shift and softcap follow "
                         f"the model and transformers' loss)")
    CrossEntropyOptions.checked(ignore_index=-100, reduction="sum", softcap=None,
                                label_smoothing=loss_options.get("label_smoothing", 0.0),
                                z_loss=loss_options.get("z_loss", 0.0))
    if "memory_budget" in loss_options:
        check_memory_budget(loss_options["memory_budget"])
    return dict(loss_options)


def _patch_instance(model, options: dict):
    inner = find_model(model)
    reason = _refusal(inner)
    if reason:
        raise ValueError(f"logitless.transformers.patch refuses this model: {reason}.")
    if is_patched(inner):
        _unpatch_instance(inner)
    original = vars(inner).get("forward")  # accelerate's wrapper, or None: the class's forward
    sig, params, var_kw = _forward_signature(original if original is not None else inner.forward)
    state = _State(options, original, params, var_kw, forward_transform(_model_class(type(inner))))
    _install_head(inner.get_output_embeddings(), state)
    object.__setattr__(inner, "forward", types.MethodType(_forward_for(type(inner), sig), inner))
    object.__setattr__(inner, _REPLICATE, types.MethodType(_replicate_model, inner))
    object.__setattr__(inner, _STATE, state)
    state.guard = _bypass.install(inner, state)
    return model


def _unpatch_instance(model):
    inner = find_model(model)
    state = vars(inner).get(_STATE)
    if state is None:
        return model
    for module in inner.modules():  # the head, and former heads still inside it (a LoRA head's base layer)
        _uninstall_head(module, state)
    if state.guard is not None:
        _bypass.uninstall_from(state.guard.backbone)
    if state.original is not None:
        object.__setattr__(inner, "forward", state.original)
    else:
        object.__delattr__(inner, "forward")
    if _REPLICATE in vars(inner):
        object.__delattr__(inner, _REPLICATE)
    object.__delattr__(inner, _STATE)
    return model


# ---------------------------------------------------------------------- classes


def _classes(cls: type) -> list:
    """The supported classes meant by ``cls``: itself, or those of an Auto* class's mapping."""
    mapping = getattr(cls, "_model_mapping", None)
    if mapping is None:
        return [cls]
    import importlib

    names = set()
    for value in mapping._model_mapping.values():
        names.update(value if isinstance(value, (list, tuple)) else [value])
    found = []
    for name in sorted(names & set(SUPPORTED)):
        module = importlib.import_module(module_name(SUPPORTED[name]))
        found.append(getattr(module, name))
    if not found:
        raise ValueError(f"logitless.transformers.patch: {cls.__name__} maps to no supported class")
    return found


def _patch_class(cls: type, options: dict):
    targets = _classes(cls)
    for target in targets:
        reason = _class_refusal(target)
        if reason:
            raise ValueError(f"logitless.transformers.patch refuses this class: {reason}.")
    for target in targets:
        _unpatch_class(target)
        own_init = vars(target).get("__init__")
        init = target.__init__

        def __init__(self, *args, __init=init, __target=target, **kwargs):
            __init(self, *args, **kwargs)
            state = vars(__target).get(_CLASS_STATE)
            if state is not None and type(self) is __target:  # subclasses are not patched
                _patch_instance(self, dict(state[1]))

        __init__.__signature__ = inspect.signature(init)
        __init__.__doc__ = init.__doc__
        target.__init__ = __init__
        setattr(target, _CLASS_STATE, (own_init, options))
    return cls


def _unpatch_class(cls: type):
    for target in _classes(cls):
        state = vars(target).get(_CLASS_STATE)
        if state is None:
            continue
        own_init = state[0]
        if own_init is None:
            delattr(target, "__init__")
        else:
            target.__init__ = own_init
        delattr(target, _CLASS_STATE)
    return cls


# ---------------------------------------------------------------------- public


def patch(model, **loss_options: Any):
    """Make a model's training forward compute transformers' causal-LM loss without logits.

    Args:
        model: one of:
            - a supported model instance (``logitless.transformers.SUPPORTED``: causal LMs,
              MoE and vision-language models), a PEFT ``PeftModel`` wrapping one, or a
              ``torch.compile`` wrapper of one: that instance is patched;
            - a supported model class (``LlamaForCausalLM``): every instance created
              afterwards (``from_pretrained``, ``from_config``) is patched on creation;
            - an Auto class (``AutoModelForCausalLM``, ``AutoModelForImageTextToText``):
              every supported class of its mapping, as above.
        **loss_options: ``memory_budget`` and ``backend`` of ``linear_cross_entropy`` (the
            loss is unchanged); ``z_loss`` and ``label_smoothing`` (these change the loss
            away from transformers', on purpose; default off).

    Returns:
        ``model`` (the object passed). Patching again replaces the options.

    In training mode with ``labels``, the forward returns the model's usual output with
    ``loss`` set (the router auxiliary loss included for MoE models, as transformers adds
    it) and ``logits=None``; otherwise the original forward runs.

    Raises:
        ValueError: the model or class is not supported (the message says why and what to
            do instead) or an option is unknown or out of range.
    """
    options = _check_options(loss_options)
    if isinstance(model, type):
        return _patch_class(model, options)
    return _patch_instance(model, options)


def unpatch(model):
    """Undo :func:`patch` on an instance, or on a class (instances already created stay patched)."""
    if isinstance(model, type):
        return _unpatch_class(model)
    return _unpatch_instance(model)


def is_patched(model) -> bool:
    """True if :func:`patch` is in effect on the instance (or, for a class, on its new instances)."""
    if isinstance(model, type):
        return all(_CLASS_STATE in vars(t) for t in _classes(model))
    return _STATE in vars(find_model(model))


def causal_lm_loss(model, hidden_states, labels=None, *, shift_labels=None, num_items_in_batch=None,
                   ignore_index: int = -100, temperature: float = 1.0, reduction: Optional[str] = None,
                   **loss_options: Any):
    """transformers' causal-LM loss of ``model``'s head on ``hidden_states``, without logits.

    For trainers that run the backbone themselves (TRL's fused-head paths): equals
    ``ForCausalLMLoss(transform(model.lm_head(hidden_states) / temperature), labels, ...)``
    with the family's logit transform (soft-cap, scale) and the head as it is (LoRA
    included), where ``hidden_states`` is the last hidden state (what the head receives).
    The MoE router auxiliary loss is not included (it needs the router logits: add
    ``coef * outputs.aux_loss``).

    Args:
        labels / shift_labels: as transformers (labels are shifted inside; shift_labels are not).
        num_items_in_batch: sum / num_items_in_batch instead of the mean.
        temperature: the logits are divided by it (GRPO's sampling temperature).
        reduction: None (transformers'), "sum", "mean" or "none" (per position: the
            negative log-probability of the target, 0 where ignored).
        **loss_options: as :func:`patch`; defaults to the model's patch options if patched.

    If the model is patched, the head is *called* (its forward pre-hooks run: FSDP2's and
    ZeRO-3's gathering); otherwise its weight is read directly (gather it first).
    """
    inner = find_model(model)
    reason = _refusal(inner)
    if reason:
        raise ValueError(f"logitless.transformers.causal_lm_loss: {reason}.")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    family = family_of(type(inner))
    softcap, scale = family.softcap_and_scale(inner, forward_transform(_model_class(type(inner))))
    # softcap_c(s z) / T == softcap_{c/T}(s z / T): the temperature scales x and the cap
    scale = scale / temperature
    softcap = None if softcap is None else softcap / temperature
    state = vars(inner).get(_STATE)
    options = _check_options(loss_options) if loss_options or state is None else state.options
    head = inner.get_output_embeddings()
    if state is not None and not loss_options:
        if getattr(head, _HEAD_STATE, None) is not state:
            _install_head_eager(inner, head, state)
        state.job = (head, labels, shift_labels, num_items_in_batch, ignore_index, softcap, scale, reduction)
        try:
            carrier = head(hidden_states)
            loss = state.result + carrier.sum()  # (through the head's output: see _head_forward)
        finally:
            state.job = None
            state.result = None
        return loss
    return hf_causal_lm_loss(head, hidden_states, labels, shift_labels, num_items_in_batch, ignore_index, softcap,
                             scale, options, reduction)
