"""Drop-ins for verl: its fused linear cross-entropy (``verl.utils.kernel.linear_cross_entropy``,
verl 0.9.1), the same signature and outputs, computed by ``logitless.linear_log_probs``;
and its top-k distillation loss (``compute_forward_kl_topk``, at the end of this module),
from hidden states instead of logits, by ``logitless.linear_topk_kl``.

Swap in verl::

    # from verl.utils.kernel.linear_cross_entropy import linear_cross_entropy
    from logitless.integrations.verl import linear_cross_entropy

verl's conventions, kept here (read from verl 0.9.1's kernel source):

- ``hidden`` (..., H) and ``labels`` (...) are flattened: both outputs have shape (N,),
  N = labels.numel(), whatever the input ranks (as verl's ``labels.view(-1)``).
- ``logprobs`` is +log softmax(hidden @ weight.T / temperature)[label] (<= 0), fp32;
  ``entropy`` is the entropy of that softmax, fp32, always per token (N,).
- ``reduction``: "none" (per token), "sum" (scalar sum of the log-probs over all N
  tokens), "mean" (that sum / N); case-insensitive; the entropy is never reduced.
- Gradients flow from both outputs to hidden and weight (no bias in verl's op).
- With ``dist_process_group`` (a head split by vocabulary over the group's ranks),
  hidden's gradient is this rank's PARTIAL gradient (the sum over its own rows), as
  verl's kernel returns it: the caller all-reduces it (Megatron's copy-to-tensor-parallel
  region does in verl's TP training; verl's TP test calls ``dist.all_reduce``). weight's
  gradient is this rank's rows, complete.

Differences, on purpose: the division by the temperature is done on the fp32 logits
as in verl, and the statistics are exact fp32 (verl's error vs float64 ~3e-5,
ours fp32 rounding); any H, V, dtype and device (verl: CUDA, H a multiple of 128).
A label equal to -100 gives 0 for both outputs and no gradient (verl gives -lse and
the entropy: a silent wrong number); any other label outside [0, V) raises
``ValueError`` on the CPU and gives NaN on a GPU (verl: -lse). ``temperature`` may be
an int (verl asserts a float).
"""

from __future__ import annotations

from torch import Tensor

from logitless.ops.linear_log_probs import linear_log_probs

from ._announce import announce

_REDUCTIONS = ("none", "sum", "mean")


def linear_cross_entropy(hidden: Tensor, weight: Tensor, labels: Tensor, temperature: float = 1.0,
                         reduction: str = "none", dist_process_group=None, *, top_k=None, top_p=1.0,
                         min_p=0.0, batch_invariant: bool = False) -> tuple[Tensor, Tensor]:
    """verl's ``linear_cross_entropy(hidden, weight, labels, temperature, reduction,
    dist_process_group) -> (logprobs, entropy)`` (module docstring: conventions).

    Math: a = hidden @ weight.T / T in fp32, logprobs = a_label - logsumexp(a),
    entropy = -sum softmax(a) log softmax(a). Memory: no (tokens x vocab) logits; the
    budget and traffic of ``logitless.linear_log_probs`` (one GEMM pass forward, three
    GEMMs forward+backward at the default budget).

    Args:
        hidden: (..., H) last hidden states (bf16/fp16/fp32).
        weight: (V, H) LM-head weight.
        labels: (...) int64/int32 token ids, hidden's leading shape.
        temperature: > 0.
        reduction: "none", "sum" or "mean" (of the log-probs; case-insensitive).
        dist_process_group: None, or the ``torch.distributed.ProcessGroup`` over which
            ``weight`` is split by vocabulary (verl's tensor-parallel head): ``weight`` is
            then this rank's contiguous block of rows, ``hidden`` and ``labels`` (global
            ids) the same on every rank; forwarded as ``process_group=`` to
            ``logitless.linear_log_probs`` with ``partial_dx=True`` (outputs identical on
            every rank; hidden's gradient this rank's partial sum, to be all-reduced by
            the caller as verl's own kernel requires; weight's gradient this rank's rows).
        top_k, top_p, min_p, batch_invariant: keyword-only, beyond verl's signature
            (verl's kernel has none; its rollout config's ``top_k``/``top_p`` can be
            passed here): ``logitless.linear_log_probs``'s truncated sampling and
            batch invariance (not with ``dist_process_group``).

    Returns:
        (logprobs, entropy): logprobs (N,) fp32 or a 0-d fp32 tensor for "sum"/"mean";
        entropy (N,) fp32.
    """
    if not isinstance(reduction, str) or reduction.lower() not in _REDUCTIONS:
        raise ValueError(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}")
    reduction = reduction.lower()
    if not isinstance(labels, Tensor):
        raise TypeError(f"labels must be a torch.Tensor, got {type(labels).__name__}")
    if not isinstance(hidden, Tensor):
        raise TypeError(f"hidden must be a torch.Tensor, got {type(hidden).__name__}")
    if hidden.dim() < 1 or hidden.shape[:-1].numel() != labels.numel():
        raise ValueError(f"hidden {tuple(hidden.shape)} and labels {tuple(labels.shape)} must hold the "
                         "same number of tokens")
    announce("verl", "the actor's log-probs and entropy from linear_log_probs (hidden states and the head), no logits")
    hidden2d = hidden.reshape(-1, hidden.shape[-1])
    flat = labels.reshape(-1)
    logprobs, entropy = linear_log_probs(hidden2d, weight, flat, temperature=temperature, entropy=True,
                                         process_group=dist_process_group,
                                         partial_dx=dist_process_group is not None,
                                         **_extras(top_k, top_p, min_p, batch_invariant))
    if reduction == "sum":
        logprobs = logprobs.sum()
    elif reduction == "mean":
        logprobs = logprobs.sum() / flat.numel()  # 0 / 0 = NaN for no tokens, as verl
    return logprobs, entropy


def _extras(top_k, top_p, min_p, batch_invariant) -> dict:
    """The truncation / invariance keywords that are set (none: verl's call unchanged)."""
    out = {}
    if top_k is not None:
        out["top_k"] = top_k
    if not (isinstance(top_p, (int, float)) and top_p == 1.0):
        out["top_p"] = top_p
    if not (isinstance(min_p, (int, float)) and min_p == 0.0):
        out["min_p"] = min_p
    if batch_invariant:
        out["batch_invariant"] = batch_invariant
    return out


# --------------------------------------------------------------------------- top-k distillation


def compute_forward_kl_topk(hidden_states: Tensor, weight: Tensor, teacher_topk_log_probs: Tensor,
                            teacher_topk_ids: Tensor, config=None, data_format: str = "thd", *,
                            temperature: float = 1.0, tail: str = "none", dist_process_group=None) -> dict:
    """verl's on-policy distillation loss ``compute_forward_kl_topk(student_logits,
    teacher_topk_log_probs, teacher_topk_ids, config, data_format)``
    (``verl.trainer.distillation.fsdp.losses``) from the student's last hidden states and
    LM-head weight instead of its logits, by ``logitless.linear_topk_kl`` (no
    tokens x vocab tensor, forward or backward).

    verl's loss per token is sum_i p_i (log p_i - log q_i) over the teacher's top-k ids,
    p the teacher's probabilities (its log-probs as given), q the student's softmax:
    ``tail="none"`` (the default here, verl's). ``tail="bucket"`` gives the tail-bin form of
    verl's RFC (``forward_kl_topk_tail``: the mass outside the top-k as one more bin, 1 - Q
    from the student's logits outside the ids, exact), ``"renormalize"`` the renormalised one.

    Args:
        hidden_states: (..., H) the student's last hidden states, the positions of
            ``student_logits`` (verl's FSDP path: (1, total_nnz, H), THD).
        weight: (V, H) the student's LM-head weight (this rank's rows with
            ``dist_process_group``: a vocabulary-parallel head; the loss is then the full
            vocabulary's and hidden's gradient the full one).
        teacher_topk_log_probs, teacher_topk_ids: (..., K) as verl passes them (nested
            jagged tensors are flattened to (1, total_nnz, K), as verl does).
        config: verl's ``DistillationConfig`` (or None). Its
            ``distillation_loss.log_prob_min_clamp`` must be None (verl's default is -10):
            logitless does not clamp the log-probs (its log q is exact and its gradient flows
            at every id; verl's clamp changes both where a log-prob is below it), and says so
            with a ValueError. ``loss_max_clamp`` is applied by verl's caller, as before.
        data_format: verl's ("thd" or "bshd"); the positions follow hidden_states'.
        temperature: the student's logits are divided by it (verl's distillation uses 1).

    Returns:
        ``{"distillation_losses": (...) fp32 per token, "teacher_mass": (...) P per token}``.
        Not computed (they need the student's logits or top-k): verl's diagnostics
        ``student_mass``, ``overlap_count``, ``overlap_token_advantage``.
    """
    import torch

    from logitless.ops.linear_topk_kl import linear_topk_kl

    if getattr(teacher_topk_log_probs, "is_nested", False):
        teacher_topk_log_probs = teacher_topk_log_probs.values().unsqueeze(0)
    if getattr(teacher_topk_ids, "is_nested", False):
        teacher_topk_ids = teacher_topk_ids.values().unsqueeze(0)
    clamp = getattr(getattr(config, "distillation_loss", None), "log_prob_min_clamp", None)
    if clamp is not None:
        raise ValueError(
            f"distillation_loss.log_prob_min_clamp={clamp}: logitless computes the student's log-probs exactly "
            "(their gradient flows at every id) and does not clamp them; set distillation.distillation_loss."
            "log_prob_min_clamp=null to use logitless.integrations.verl.compute_forward_kl_topk")
    announce("verl_topk", "compute_forward_kl_topk from the student's hidden states and head (linear_topk_kl), "
                          "no logits")
    lp = teacher_topk_log_probs.float()
    losses = linear_topk_kl(hidden_states, weight, teacher_topk_ids, lp, direction="forward", tail=tail,
                            temperature=temperature, reduction="none", process_group=dist_process_group)
    with torch.no_grad():
        teacher_mass = lp.exp().sum(dim=-1)
    return {"distillation_losses": losses, "teacher_mass": teacher_mass}
