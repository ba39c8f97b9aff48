"""The CPU token-range check of linear_log_probs (the custom ops' and the vocab-parallel
forward's; its own module so that neither imports the other)."""

from __future__ import annotations

from torch import Tensor


def check_tokens_in_range(tokens: Tensor, num_classes: int, ignore_index: int) -> None:
    """ValueError for a token outside [0, V) that is not ignore_index (CPU tensors only:
    on a GPU the check would be a host sync; the token's outputs are NaN there)."""
    if tokens.device.type != "cpu" or tokens.numel() == 0:
        return
    bad = (tokens != ignore_index) & ((tokens < 0) | (tokens >= num_classes))
    if bool(bad.any()):
        raise ValueError(f"tokens contains {int(tokens[bad][0])}, outside [0, {num_classes}) and not "
                         f"ignore_index={ignore_index}")
