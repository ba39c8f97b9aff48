"""The LM head as a linear map: ``head(x) == x' @ W'.T + b`` without calling it.

``head_operands(head, x)`` returns ``(x', W', b)`` for the heads the patch supports:

- ``torch.nn.Linear`` (also FSDP2's ``FSDPLinear``, any subclass that keeps
  ``nn.Linear.forward``): ``(x, W, b)``.
- PEFT LoRA on the head (``peft.tuners.lora.Linear``, vanilla LoRA, any number of active
  adapters, dropout included): ``head(x) = W x + b + sum_a s_a * B_a A_a drop_a(x)``
  ``= [x, s_1 A_1 drop_1(x), ...] @ [W, B_1, ...].T + b``: the (tokens x r) adapter
  projections are concatenated to the hidden state and the (V x r) ``B`` matrices to the
  weight, one extra (V x (H + r)) copy of the weight per step instead of the (tokens x V)
  logits; gradients reach A and B through the concatenation. ``A_a`` is called as a
  module (its hooks run). Merged or disabled adapters: the base layer alone.
- PEFT ``modules_to_save`` on the head (``ModulesToSaveWrapper``): the active copy.

Anything else (quantized heads, DoRA and other LoRA variants, a LoRA bias) is refused by
``head_refusal`` with the reason.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn

from logitless.ops.common import validate as _validate


def _is_plain_linear(head) -> bool:
    return isinstance(head, nn.Linear) and type(head).forward is nn.Linear.forward


def _is_peft_lora_linear(head) -> bool:
    return (type(head).__module__.startswith("peft.tuners.lora") and type(head).__name__ == "Linear"
            and hasattr(head, "base_layer") and hasattr(head, "lora_A"))


def _is_modules_to_save(head) -> bool:
    return type(head).__name__ == "ModulesToSaveWrapper" and hasattr(head, "modules_to_save")


def _lora_active(head) -> list:
    if head.disable_adapters or head.merged:
        return []
    return [a for a in head.active_adapters if a in head.lora_A.keys()]


def _saved_module(head):
    active = list(getattr(head, "active_adapters", [getattr(head, "active_adapter", None)]))
    if head.disable_adapters or not active or any(a not in head.modules_to_save for a in active):
        return head.original_module
    if len(active) != 1:
        raise ValueError(f"modules_to_save on the head with {len(active)} active adapters is not supported")
    return head.modules_to_save[active[0]]


def head_refusal(head) -> Optional[str]:
    """None if ``head_operands`` supports ``head``, else why not."""
    if _is_modules_to_save(head):
        try:
            return head_refusal(_saved_module(head))
        except ValueError as e:
            return str(e)
    if _is_peft_lora_linear(head):
        reason = head_refusal(head.base_layer)
        if reason:
            return f"the LoRA head's base layer: {reason}"
        for a in _lora_active(head):
            if a in getattr(head, "lora_variant", {}) or getattr(head, "use_dora", {}).get(a, False):
                return f"the head's adapter {a!r} is a LoRA variant (DoRA, ...), not vanilla LoRA"
            if head.lora_B[a].bias is not None:
                return f"the head's adapter {a!r} has a LoRA bias"
        return None
    if not _is_plain_linear(head):
        return (f"the head is {type(head).__module__}.{type(head).__name__}, not a torch.nn.Linear, a PEFT LoRA "
                f"Linear or a PEFT modules_to_save copy (quantized or custom heads are not supported)")
    if head.weight.dtype not in _validate.FLOAT_DTYPES:
        return f"the head's weight is {head.weight.dtype}, not a float dtype"
    return None


def head_out_features(head) -> int:
    if _is_modules_to_save(head):
        return head_out_features(_saved_module(head))
    if _is_peft_lora_linear(head):
        return head_out_features(head.base_layer)
    return head.out_features


def head_operands(head, x: Tensor) -> tuple[Tensor, Tensor, Optional[Tensor]]:
    """``(x', W', b)`` with ``head(x) == F.linear(x', W', b)`` (see the module docstring)."""
    if _is_modules_to_save(head):
        return head_operands(_saved_module(head), x)
    if _is_peft_lora_linear(head):
        xs, ws = [x], []
        base_x, weight, bias = head_operands(head.base_layer, x)
        ws.append(weight)
        for a in _lora_active(head):
            z = head.lora_A[a](head.lora_dropout[a](x)) * head.scaling[a]
            xs.append(z.to(x.dtype))
            ws.append(head.lora_B[a].weight.to(weight.dtype))
        if len(xs) == 1:
            return base_x, weight, bias
        return torch.cat(xs, dim=-1), torch.cat(ws, dim=1), bias
    return x, head.weight, head.bias
