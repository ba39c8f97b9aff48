"""Warn (once) when a patched model's training loss bypasses the patch.

A trainer that replaces ``model.forward`` *after* :func:`logitless.transformers.patch`
and runs the backbone (``model.base_model``) itself never reaches the patched forward or
head: the loss is silently the trainer's own. TRL does exactly that: ``SFTTrainer`` and
``GRPOTrainer`` (``RLOOTrainer``...) install a fused-LM-head forward
(``trl.trainer.utils.add_fused_lm_head``) that calls ``model.base_model`` and reads
``lm_head.weight`` directly.

Detection: a forward pre-hook on the patched model's backbone. It warns when, all at once,

- the backbone runs in training mode with autograd enabled (not compiling: a compiled
  graph never warns),
- no logitless path is running it: neither the patched forward (``state.job`` set, or
  its ``entered`` count) nor logitless' own heads that run the backbone themselves
  (``logitless.integrations.trl``'s, ``hf_log_probs``: they call it through
  ``run_backbone``),
- and ``model.forward`` on the instance is no longer the patched forward (seen through
  accelerate's mixed-precision wrapper, which keeps ``_original_forward``): something
  replaced it. A user loop that calls ``model.model(...)`` itself and then
  :func:`causal_lm_loss` leaves the forward in place and is never warned.

The message names the replacing function and, for TRL's fused head (a forward taking
``fused_lm_head``), the fix: ``logitless.integrations.trl.patch_sft(trainer)`` or
``patch_grpo(trainer)``. Cost on the hot path: a few attribute reads per backbone call.
"""

from __future__ import annotations

import warnings
from typing import Optional

import torch
from torch import nn

#: On the backbone: its Guard (the hook finds it there; deepcopy copies it with the model).
BACKBONE_ATTR = "_logitless_backbone"
#: On the patched forward's function.
PATCHED_FORWARD_ATTR = "_logitless_patched_forward"

TRL_FIX = ("logitless.integrations.trl.patch_sft(trainer) (SFTTrainer) or "
           "logitless.integrations.trl.patch_grpo(trainer) (GRPOTrainer, RLOOTrainer)")


class PatchBypassedWarning(UserWarning):
    """A patched model's training loss was computed without the patch (see this module)."""


class Guard:
    """Per patched model: what the backbone pre-hook reads."""

    def __init__(self, owner: nn.Module, backbone: nn.Module, state):
        self.owner = owner  # the patched model
        self.backbone = backbone
        self.state = state  # the patch's _State (its ``job`` is set inside a patched call)
        self.entered = 0  # > 0 while a logitless path runs the backbone
        self.warned = False


def backbone_of(model: nn.Module):
    """The module a fused-head trainer calls for the hidden states: ``model.base_model``, or None."""
    base = getattr(model, "base_model", None)
    return base if isinstance(base, nn.Module) and base is not model else None


def install(owner: nn.Module, state) -> Optional[Guard]:
    backbone = backbone_of(owner)
    if backbone is None:
        return None
    guard = Guard(owner, backbone, state)
    uninstall_from(backbone)
    object.__setattr__(backbone, BACKBONE_ATTR, guard)
    backbone.register_forward_pre_hook(pre_hook)
    return guard


def uninstall_from(backbone: nn.Module) -> None:
    if BACKBONE_ATTR in vars(backbone):
        object.__delattr__(backbone, BACKBONE_ATTR)
    hooks = backbone._forward_pre_hooks
    for key in [k for k, fn in hooks.items() if fn is pre_hook]:
        del hooks[key]


def _function(fn):
    return getattr(fn, "__func__", fn)


def instance_forwards(owner: nn.Module) -> list:
    """The instance's forward and, under accelerate's autocast wrapper, the one it wraps
    (``_original_forward``)."""
    return [f for f in (vars(owner).get("forward"), vars(owner).get("_original_forward")) if f is not None]


def is_patched_forward(fn) -> bool:
    return getattr(_function(fn), PATCHED_FORWARD_ATTR, False)


def is_fused_head_forward(fn) -> bool:
    """TRL's fused-LM-head protocol: a forward with a ``fused_lm_head`` argument (its code, not
    its signature: TRL copies the model's signature onto it with functools.wraps)."""
    code = getattr(_function(fn), "__code__", None)
    return code is not None and "fused_lm_head" in code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]


def _describe(fn) -> str:
    f = _function(fn)
    code = getattr(f, "__code__", None)
    where = f" ({code.co_filename}:{code.co_firstlineno})" if code is not None else ""
    return f"{getattr(code, 'co_name', None) or getattr(f, '__qualname__', repr(f))}{where}"


def message(owner: nn.Module, fwd) -> str:
    name = type(owner).__name__
    if is_fused_head_forward(fwd):
        return (f"logitless: {name} is patched by logitless.transformers.patch, but its loss is computed by TRL's "
                f"fused LM head ({_describe(fwd)}), which runs the backbone itself: the patch is bypassed and "
                f"logitless computes nothing. Use {TRL_FIX} after building the trainer (instead of, or in addition "
                f"to, patch(model))")
    return (f"logitless: {name} is patched by logitless.transformers.patch, but model.forward was replaced after "
            f"patching by {_describe(fwd)}, which ran the model's backbone without calling the patched forward: the "
            f"loss it computes is not logitless'. Patch after that library, or compute the loss with "
            f"logitless.transformers.causal_lm_loss on the backbone's hidden states")


def pre_hook(module: nn.Module, args) -> None:
    if torch.compiler.is_compiling() or not module.training or not torch.is_grad_enabled():
        return
    guard = vars(module).get(BACKBONE_ATTR)
    if guard is None or guard.warned or guard.entered or guard.state.job is not None:
        return
    forwards = instance_forwards(guard.owner)
    if not forwards or any(is_patched_forward(f) for f in forwards):
        return  # the caller runs the backbone itself and keeps the patched forward (causal_lm_loss)
    fwd = next((f for f in forwards if is_fused_head_forward(f)), forwards[0])
    guard.warned = True
    warnings.warn(message(guard.owner, fwd), PatchBypassedWarning, stacklevel=3)
