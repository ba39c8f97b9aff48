"""Hugging Face ``transformers`` causal LMs trained with logitless' loss, no logits stored.

    import logitless.transformers as lt
    model = AutoModelForCausalLM.from_pretrained(...)
    lt.patch(model)                 # this instance only; returns the model
    ...train as usual (Trainer, TRL, your own loop)...
    lt.unpatch(model)

How it works. ``patch`` replaces ``model.forward`` on the instance. In training mode
(``model.training``) with ``labels``, the patched forward calls the model's *own*
forward with ``labels=None`` while the LM head's ``forward`` is swapped, for that call
only, for a function that receives exactly what the head would receive (the last
hidden state, already sliced by ``logits_to_keep``), computes
``logitless.linear_cross_entropy`` on it with the head's weight and bias, and returns an
empty ``(..., 0)`` tensor in place of the logits: the logits are never computed, and the
model's own logit transforms (soft-capping, scaling) run on an empty tensor for free.
Everything else (argument handling, backbone call, past_key_values, hidden_states,
attentions, the output class, hooks on the head such as FSDP's gather) is the model's own
code. The output has ``loss`` set and ``logits=None``. Without labels, or in eval mode
(``Trainer.evaluate`` wants logits for metrics), the original forward runs unchanged.

The loss is transformers' ``ForCausalLMLoss``: labels shifted inside (or the caller's
``shift_labels``), ``ignore_index`` (-100 unless passed), mean over non-ignored tokens, or
sum / ``num_items_in_batch`` when given (a tensor stays on the device: no host sync); as in
transformers, ``shift_labels`` without ``labels`` computes no loss. Plus
the family's logit transform, known from an explicit allow-list (``SUPPORTED``):

- soft-capping (Gemma 2, Gemma 3): ``config.final_logit_softcapping`` -> ``softcap=``.
- scaling (Cohere ``logit_scale``, Granite ``1 / logits_scaling``): the scale is applied
  to the hidden state, ``(s * x) @ W.T == s * (x @ W.T)``, an (tokens x H) elementwise
  product instead of a per-step copy of the (V x H) weight. It is exact when ``s`` is a
  power of two (Cohere's default 1/16, Granite's usual 1/8, 1/16 ...): scaling by 2^k
  only changes exponents, so even after an autocast cast to bf16 the products are those
  of transformers. Other scales differ from ``(x @ W.T) * s`` by one rounding of ``s * x``
  (relative 2^-24 in fp32).

Refused at patch time, with ``ValueError``: classes not in ``SUPPORTED`` (the message
lists them), classes not defined by transformers itself (remote code, subclasses,
``torch.compile`` wrappers: patch before compiling), models whose forward source does
not match the expected structure (the code between the head call and the loss must be
exactly the family's known transform; extra terms such as MoE auxiliary losses are
refused), a head that is not a plain ``torch.nn.Linear`` (LoRA on the head, quantized
heads), a custom ``loss_function``/``loss_type``, and a head whose size is not
``config.vocab_size``.

Mixed precision: the head is called exactly as ``nn.Linear`` would be: under autocast
(``Trainer(bf16=True)``, fp32 master weights) ``linear_cross_entropy`` follows F.linear's
autocast casts itself; in pure bf16 the inputs are bf16. The loss is fp32.
PEFT: pass the ``PeftModel`` or its base model; the frozen head gets no gradient.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import textwrap
import types
from collections.abc import Callable
from typing import Any, Optional

import torch
from torch import nn

from logitless.ops.common import validate as _validate
from logitless.ops.linear_cross_entropy import linear_cross_entropy
from logitless.options import CrossEntropyOptions, check_memory_budget

__all__ = ["patch", "unpatch", "is_patched", "SUPPORTED"]

_SOFTCAP_CODE = ("""
if self.config.final_logit_softcapping is not None:
    logits = logits / self.config.final_logit_softcapping
    logits = torch.tanh(logits)
    logits = logits * self.config.final_logit_softcapping
""",)


def _no_transform(model) -> tuple[Optional[float], float]:
    return None, 1.0


def _softcap(model) -> tuple[Optional[float], float]:
    cap = model.config.final_logit_softcapping
    return (None if cap is None else float(cap)), 1.0


def _cohere_scale(model) -> tuple[Optional[float], float]:
    return None, float(model.logit_scale)


def _granite_scale(model) -> tuple[Optional[float], float]:
    return None, 1.0 / float(model.config.logits_scaling)


@dataclasses.dataclass(frozen=True)
class _Family:
    module: str  # transformers.models.<module>.modeling_<module>
    transform_code: tuple  # the forward's statements between the head call and `loss = None`
    transform: Callable  # model -> (softcap or None, scale applied to the logits)


#: Supported classes (tested with transformers 5.17): class name -> family.
SUPPORTED: dict[str, _Family] = {
    "LlamaForCausalLM": _Family("llama", (), _no_transform),
    "MistralForCausalLM": _Family("mistral", (), _no_transform),
    "Qwen2ForCausalLM": _Family("qwen2", (), _no_transform),
    "Qwen3ForCausalLM": _Family("qwen3", (), _no_transform),
    "GemmaForCausalLM": _Family("gemma", (), _no_transform),
    "Gemma2ForCausalLM": _Family("gemma2", _SOFTCAP_CODE, _softcap),
    "Gemma3ForCausalLM": _Family("gemma3", _SOFTCAP_CODE, _softcap),
    "Phi3ForCausalLM": _Family("phi3", (), _no_transform),
    "PhiForCausalLM": _Family("phi", (), _no_transform),
    "Olmo2ForCausalLM": _Family("olmo2", (), _no_transform),
    "GPT2LMHeadModel": _Family("gpt2", (), _no_transform),
    "CohereForCausalLM": _Family("cohere", ("logits = logits * self.logit_scale",), _cohere_scale),
    "GraniteForCausalLM": _Family("granite", ("logits = logits / self.config.logits_scaling",), _granite_scale),
}

#: Options of ``linear_cross_entropy`` that ``patch`` accepts. The rest (reduction,
#: ignore_index, shift, softcap) are fixed by transformers' loss and the model.
_ALLOWED_OPTIONS = ("memory_budget", "backend", "z_loss", "label_smoothing")

_STATE_ATTR = "_logitless_patch"


def _supported_list() -> str:
    return ", ".join(SUPPORTED)


def _normalize(code: str) -> str:
    return ast.unparse(ast.parse(textwrap.dedent(code)))


def _assigns(stmt: ast.stmt, name: str) -> bool:
    """True if ``stmt`` (or a statement nested in it) assigns to the variable ``name``."""
    for node in ast.walk(stmt):
        targets = node.targets if isinstance(node, ast.Assign) else (
            [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
        if any(isinstance(t, ast.Name) and t.id == name for t in targets):
            return True
    return False


@functools.cache
def _check_forward_source(cls: type) -> Optional[str]:
    """None if ``cls.forward`` has the structure the patch relies on, else the reason.

    The structure: exactly one ``logits = self.lm_head(...)``; between it and ``loss =
    None`` exactly the family's known transform; after it, the loss is only
    ``self.loss_function(...)`` under ``if labels is not None:`` and the logits never change.
    """
    fn = inspect.unwrap(cls.forward)
    try:
        body = ast.parse(textwrap.dedent(inspect.getsource(fn))).body[0].body
    except (OSError, TypeError, SyntaxError, IndexError, AttributeError):
        return "its forward's source is not available to check"
    stmts = [ast.unparse(s) for s in body]
    heads = [i for i, s in enumerate(stmts) if "self.lm_head(" in s]
    if len(heads) != 1 or not stmts[heads[0]].startswith("logits = self.lm_head("):
        return "its forward does not compute `logits = self.lm_head(...)` exactly once"
    h = heads[0]
    try:
        loss_none = stmts.index("loss = None", h)
    except ValueError:
        return "its forward has no `loss = None` after the head"
    family = SUPPORTED[cls.__name__]
    between = tuple(stmts[h + 1:loss_none])
    expected = tuple(_normalize(line) for line in family.transform_code)
    if between != expected:
        return (f"its forward transforms the logits as {list(between)}, not as the patch expects "
                f"({list(expected)})")
    after = body[loss_none + 1:]
    loss_stmts = [s for s in after if _assigns(s, "loss")]
    ok = (len(loss_stmts) == 1 and isinstance(loss_stmts[0], ast.If)
          and ast.unparse(loss_stmts[0].test) == "labels is not None" and len(loss_stmts[0].body) == 1
          and ast.unparse(loss_stmts[0].body[0]).startswith("loss = self.loss_function(")
          and not loss_stmts[0].orelse)
    if not ok:
        return ("its loss is not only `if labels is not None: loss = self.loss_function(...)`: "
                f"{[ast.unparse(s) for s in loss_stmts]}")
    if any(_assigns(s, "logits") for s in after):
        return "its forward changes the logits after the loss"
    return None


def _find_model(model) -> nn.Module:
    """The transformers model inside a PeftModel (or the model itself)."""
    get_base = getattr(model, "get_base_model", None)
    if callable(get_base) and type(model).__name__.startswith("Peft"):
        return get_base()
    return model


def _refusal(model) -> Optional[str]:
    cls = type(model)
    name = cls.__name__
    if name not in SUPPORTED:
        return f"{name} is not a supported model class"
    family = SUPPORTED[name]
    expected_module = f"transformers.models.{family.module}.modeling_{family.module}"
    if cls.__module__ != expected_module:
        return (f"{name} is defined in {cls.__module__}, not in {expected_module} (remote code, a subclass "
                f"or a wrapper such as torch.compile's; patch the transformers model before compiling)")
    reason = _check_forward_source(cls)
    if reason:
        return f"{name}: {reason}"
    if "forward" in vars(model) and not is_patched(model) and "_original_forward" not in vars(model):
        # (accelerate's autocast wrapper, which keeps _original_forward, is fine: it calls the original)
        return (f"{name}.forward is already replaced on this instance by another library (e.g. liger-kernel's "
                f"patch); patch a model without it")
    head = model.get_output_embeddings()
    if type(head) is not nn.Linear:
        return (f"{name}'s output embeddings are {type(head).__name__}, not a plain torch.nn.Linear "
                f"(LoRA or modules_to_save on the head, quantized or custom heads are not supported)")
    if head is not getattr(model, "lm_head", None):
        return f"{name}.get_output_embeddings() is not model.lm_head"
    if "forward" in vars(head):
        return f"{name}.lm_head.forward is already replaced on the instance by another library"
    if head.weight.dtype not in _validate.FLOAT_DTYPES:
        return f"{name}'s head weight is {head.weight.dtype}, not a float dtype"
    vocab = getattr(model.config, "vocab_size", None)
    if head.out_features != vocab:
        return f"{name}'s head has {head.out_features} outputs but config.vocab_size is {vocab}"
    from transformers.loss.loss_utils import LOSS_MAPPING

    if model.loss_function is not LOSS_MAPPING["ForCausalLM"]:
        return f"{name} uses a custom loss_function ({model.loss_function!r}), not transformers' ForCausalLMLoss"
    return None


def _hf_loss(hidden, weight, bias, labels, shift_labels, num_items_in_batch, ignore_index, softcap, scale, opts):
    """transformers' ForCausalLMLoss(softcap(scale * (hidden @ weight.T + bias))), no logits."""
    if scale != 1.0:
        # (s * x) @ W.T == s * (x @ W.T); the bias is scaled too in transformers.
        hidden = hidden * scale
        bias = None if bias is None else bias * scale
    lead = hidden.shape[:-1]
    if shift_labels is None:
        target, shift = labels, True  # labels[..., 1:] padded with ignore_index, as transformers
    else:
        target, shift = shift_labels, False
    target = target.to(hidden.device)
    if target.numel() != lead.numel():
        raise ValueError(f"{'shift_labels' if shift_labels is not None else 'labels'} has shape "
                         f"{tuple(target.shape)} but the head receives {tuple(lead)} positions "
                         f"(with logits_to_keep, labels must match the kept positions)")
    target = target.reshape(lead)
    reduction = "mean" if num_items_in_batch is None else "sum"
    loss = linear_cross_entropy(hidden, weight, target, bias, ignore_index=ignore_index, reduction=reduction,
                                softcap=softcap, shift=shift, **opts)
    if num_items_in_batch is not None:
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(loss.device)
        loss = loss / num_items_in_batch
    return loss


def _make_forward(model: nn.Module, original: Callable, opts: dict) -> Callable:
    sig = inspect.signature(original)
    var_kw = next((p.name for p in sig.parameters.values() if p.kind is inspect.Parameter.VAR_KEYWORD), None)
    family = SUPPORTED[type(model).__name__]

    def forward(self, *args, **kwargs):
        if not model.training:
            return original(*args, **kwargs)
        bound = sig.bind(*args, **kwargs)
        labels = bound.arguments.get("labels")
        if labels is None:
            return original(*args, **kwargs)
        extra = bound.arguments.get(var_kw, {}) if var_kw else {}
        return_dict = extra.pop("return_dict", None)
        if return_dict is None:
            return_dict = getattr(model.config, "return_dict", True)
        extra["return_dict"] = True
        bound.arguments["labels"] = None
        if var_kw:
            bound.arguments[var_kw] = extra
        loss_fn = model.loss_function
        from transformers.loss.loss_utils import LOSS_MAPPING

        if loss_fn is not LOSS_MAPPING["ForCausalLM"]:
            raise RuntimeError(f"{type(model).__name__}.loss_function was changed after logitless.transformers."
                               f"patch: unpatch the model to use a custom loss")
        softcap, scale = family.transform(model)
        head = model.get_output_embeddings()
        losses = []

        def head_forward(hidden):
            losses.append(_hf_loss(
                hidden, head.weight, head.bias, labels, extra.get("shift_labels"),
                extra.get("num_items_in_batch"), extra.get("ignore_index", -100), softcap, scale, opts))
            return hidden.new_empty(hidden.shape[:-1] + (0,))  # stands in for the logits

        head.forward = head_forward
        try:
            out = original(*bound.args, **bound.kwargs)
        finally:
            del head.forward
        if len(losses) != 1:
            raise RuntimeError(f"{type(model).__name__}'s forward called its head {len(losses)} times "
                               f"(expected once); the logitless patch cannot be used with it")
        fields = {f.name: getattr(out, f.name) for f in dataclasses.fields(out)}
        fields.update(loss=losses[0], logits=None)
        out = type(out)(**fields)
        return out if return_dict else out.to_tuple()

    # A method (so accelerate's autocast wrapping finds ``__func__``) showing the original
    # signature (Trainer inspects it for dataset columns and loss kwargs). No ``__wrapped__``:
    # accelerate's unwrap_model follows it and would drop the patch.
    self_param = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)
    forward.__signature__ = sig.replace(parameters=[self_param, *sig.parameters.values()])
    forward.__doc__ = getattr(original, "__doc__", None)
    forward.__name__ = forward.__qualname__ = "forward"
    return types.MethodType(forward, model)


def patch(model, **loss_options: Any):
    """Make ``model``'s training forward compute transformers' causal-LM loss without logits.

    Args:
        model: a supported ``*ForCausalLM`` instance (``SUPPORTED``), or a PEFT ``PeftModel``
            wrapping one. Only this instance changes.
        **loss_options: ``memory_budget`` and ``backend`` of ``linear_cross_entropy`` (the
            loss is unchanged); ``z_loss`` and ``label_smoothing`` (these change the loss
            away from transformers', on purpose; default off).

    Returns:
        ``model`` (the object passed), patched. Patching again replaces the options.

    In training mode with ``labels``, the forward returns the model's usual output with
    ``loss`` set and ``logits=None``; otherwise the original forward runs. See the
    module docstring for the loss, the supported families and what is refused.

    Raises:
        ValueError: the model is not supported (the message says why and lists
            the supported classes) or an option is unknown or out of range.
    """
    unknown = sorted(set(loss_options) - set(_ALLOWED_OPTIONS))
    if unknown:
        raise ValueError(f"unknown option(s) {unknown} for logitless.transformers.patch; allowed: "
                         f"{list(_ALLOWED_OPTIONS)} (reduction, ignore_index, shift and softcap follow "
                         f"the model and transformers' loss)")
    CrossEntropyOptions.checked(ignore_index=-100, reduction="sum", softcap=None,
                            label_smoothing=loss_options.get("label_smoothing", 0.0),
                            z_loss=loss_options.get("z_loss", 0.0))
    if "memory_budget" in loss_options:
        check_memory_budget(loss_options["memory_budget"])
    inner = _find_model(model)
    reason = _refusal(inner)
    if reason:
        raise ValueError(f"logitless.transformers.patch refuses this model: {reason}. Supported classes: "
                         f"{_supported_list()}.")
    if is_patched(inner):
        unpatch(inner)
    had_instance_forward = "forward" in vars(inner)
    original = inner.forward
    forward = _make_forward(inner, original, dict(loss_options))
    object.__setattr__(inner, "forward", forward)
    object.__setattr__(inner, _STATE_ATTR, (had_instance_forward, original))
    return model


def unpatch(model):
    """Undo :func:`patch` on ``model`` (or the PeftModel's base model); returns ``model``."""
    inner = _find_model(model)
    state = vars(inner).get(_STATE_ATTR)
    if state is None:
        return model
    had_instance_forward, original = state
    if had_instance_forward:
        object.__setattr__(inner, "forward", original)
    else:
        object.__delattr__(inner, "forward")
    object.__delattr__(inner, _STATE_ATTR)
    return model


def is_patched(model) -> bool:
    """True if :func:`patch` is in effect on ``model`` (or the PeftModel's base model)."""
    return _STATE_ATTR in vars(_find_model(model))
