"""MaxText drop-ins (jax only; MaxText is not imported): its vocabulary-tiling loss and the
sparse KL of its offline distillation over saved top-k teacher logits, with MaxText's
arguments where they are arrays and its results, computed by logitless without the
(tokens x vocab) logits. docs/jax.md ("MaxText") shows where each goes in MaxText's code.

``vocab_tiling_loss``: MaxText's ``vocab_tiling_linen_loss`` / ``vocab_tiling_nnx_loss``
(``maxtext/utils/vocabulary_tiling.py``) return ``(xent_sum, total_z_loss)``: over the
positions whose ``targets_segmentation`` is not 0, the sum of the cross-entropy of the
output head's logits plus ``z_loss_multiplier * lse**2`` (T5X's
``cross_entropy_with_logits``), and the sum of that z-loss term alone (its gradient is not
used: MaxText's backward drops it). They take the decoder's hidden states and run the
output head (final norm, then ``logits_dense`` or the tied embedding) on chunks of them;
this function takes the head's input after the final norm and the head's weight.

``sparse_distillation_loss``: the "offline" branch of MaxText's
``CombinedDistillationStrategy.compute_loss`` (``trainers/post_train/distillation/
distillation_utils.py``): the teacher's saved ``top_k_logits`` and ``top_k_indices``, the
teacher's softmax at temperature T over its K logits, the student's log-softmax over its
own logits at the same K ids (both renormalised over the K), KL(teacher || student) per
position, times T**2; plus the student's cross-entropy (T = 1, full vocabulary) on the
targets; ``total = alpha * soft_mean + (1 - alpha) * hard_mean``, both means over the
positions whose target is not ``pad_id`` (and whose segmentation is not 0), divided by
max(count, 1). That is ``linear_topk_kl`` with ``tail="renormalize"`` and the teacher's
log-probabilities ``log_softmax(top_k_logits / T)``: one pass over the vocabulary.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from logitless.jax.ops.linear_cross_entropy.api import linear_cross_entropy
from logitless.jax.ops.linear_topk_kl.api import linear_topk_kl

#: The target value the drop-ins give to positions that count for nothing.
_IGNORED = -100


def _head(lm_head, hidden_states, config):
    """(weight, layout, hidden, softcap) of MaxText's output head: the ``logits_dense``
    kernel (embed, vocab) ("hv"), or the embedding table (vocab, embed) ("vh") with
    ``logits_via_embedding`` (``normalize_embedding_logits``: the hidden states scaled by
    embed**-0.5, one rounding in their dtype instead of MaxText's of the logits);
    ``final_logits_soft_cap`` (MaxText applies it to tied-embedding logits only)."""
    via_embedding = bool(getattr(config, "logits_via_embedding", False))
    softcap = None
    if via_embedding:
        if getattr(config, "normalize_embedding_logits", False):
            hidden_states = (hidden_states.astype(jnp.float32) * hidden_states.shape[-1] ** -0.5).astype(
                hidden_states.dtype)
        softcap = getattr(config, "final_logits_soft_cap", None) or None
    return lm_head.astype(hidden_states.dtype), "vh" if via_embedding else "hv", hidden_states, softcap


def vocab_tiling_loss(hidden_states, lm_head, data, config, *, implementation: Optional[str] = None,
                      memory_budget: Optional[int] = None):
    """``(xent_sum, total_z_loss)`` of MaxText's vocabulary-tiling loss, without logits.

    Args:
        hidden_states: (batch, length, embed): the output head's input, after the final
            norm (MaxText's ``decoder_norm``; its hidden states before it are what the
            decoder sows).
        lm_head: the ``logits_dense`` kernel (embed, vocab), or with
            ``config.logits_via_embedding`` the token embedding table (vocab, embed).
            Cast to the hidden states' dtype (MaxText's ``dtype``).
        data: a mapping with "targets" (batch, length) and "targets_segmentation"
            (batch, length): positions whose segmentation is 0 count for nothing.
        config: MaxText's config (read: ``z_loss_multiplier``, ``logits_via_embedding``,
            ``normalize_embedding_logits``, ``final_logits_soft_cap``).
        implementation, memory_budget: as ``logitless.jax.linear_cross_entropy``.

    Returns:
        (xent_sum, total_z_loss), fp32 scalars: sum over counted positions of
        lse - z_target + z_loss_multiplier * lse**2, and of z_loss_multiplier * lse**2
        (a constant for autodiff, as in MaxText). MaxText's logits are the model's
        ``dtype`` (bf16) unless ``logits_dot_in_fp32``; these are fp32 from the same
        inputs. A target outside [0, vocab) at a counted position: MaxText's one-hot
        row is zero (loss lse); here NaN (traced) or ValueError (eager CPU).
    """
    w, layout, x, softcap = _head(lm_head, hidden_states, config)
    z = float(getattr(config, "z_loss_multiplier", 0.0) or 0.0)
    t = jnp.where(data["targets_segmentation"] != 0, data["targets"], _IGNORED)
    kw = dict(ignore_index=_IGNORED, reduction="sum", softcap=softcap, weight_layout=layout,
              implementation=implementation, memory_budget=memory_budget)
    if z == 0.0:
        return linear_cross_entropy(x, w, t, z_loss=0.0, **kw), jnp.zeros((), jnp.float32)
    loss, stats = linear_cross_entropy(x, w, t, z_loss=z, return_stats=True, **kw)
    z_sum = z * jnp.sum(jnp.where(t != _IGNORED, jnp.square(stats.lse), 0.0))
    return loss, jax.lax.stop_gradient(z_sum)


def sparse_distillation_loss(student_hidden, lm_head, top_k_indices, top_k_logits, targets,
                             targets_segmentation=None, *, temperature: float = 2.0, alpha: float = 0.5,
                             pad_id: int = 0, weight_layout: str = "hv", implementation: Optional[str] = None,
                             memory_budget: Optional[int] = None):
    """The total loss of MaxText's offline distillation (its sparse top-k KL and the hard
    cross-entropy; ``CombinedDistillationStrategy.compute_loss`` with the teacher's saved
    ``top_k_indices``) from the student's hidden states, without its logits.

    Args:
        student_hidden: (batch, length, embed): the student's output-head input (after its
            final norm).
        lm_head: the student's head weight: (embed, vocab) with ``weight_layout="hv"``
            (MaxText's ``logits_dense`` kernel), (vocab, embed) with "vh" (a tied
            embedding table).
        top_k_indices: (batch, length, K) the teacher's saved top-k ids (distinct).
        top_k_logits: (batch, length, K) the teacher's logits at those ids.
        targets: (batch, length) ground-truth ids; targets_segmentation: optional, 0 at
            padding. A position counts when its target is not ``pad_id`` and its
            segmentation (if given) is not 0 (MaxText's ``create_labels`` mask).
        temperature: T > 0 (the scheduled value of a step); alpha: in [0, 1], the soft
            loss's weight.

    Returns:
        alpha * T**2 * sum(KL) / max(count, 1) + (1 - alpha) * sum(CE) / max(count, 1),
        fp32; gradients to student_hidden and lm_head (the teacher's arrays are
        constants). The feature and MoE terms of MaxText's total are the caller's to add.
        Its metrics (the soft and hard sums apart) are not returned: they would need a
        second pass over the vocabulary.
    """
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    mask = targets != pad_id
    if targets_segmentation is not None:
        mask = mask & (targets_segmentation != 0)
    t = jnp.where(mask, targets, _IGNORED)
    count = jnp.maximum(jnp.sum(mask).astype(jnp.float32), 1.0)
    kw = dict(ignore_index=_IGNORED, reduction="sum", weight_layout=weight_layout, implementation=implementation,
              memory_budget=memory_budget)
    if alpha == 0.0:
        return linear_cross_entropy(student_hidden, lm_head, t, **kw) / count
    lp = jax.nn.log_softmax(top_k_logits.astype(jnp.float32) / temperature, axis=-1)
    hard = (1.0 - alpha) / (alpha * temperature**2)
    loss = linear_topk_kl(student_hidden, lm_head, top_k_indices, lp, t, direction="forward", tail="renormalize",
                          temperature=temperature, hard_label_weight=hard, **kw)
    return alpha * temperature**2 * loss / count
