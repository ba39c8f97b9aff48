"""Drop-in replacements of liger-kernel's (0.8.5) loss functions and modules, on logitless.

Switching is one import:

    # from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
    from logitless.integrations.liger import LigerFusedLinearCrossEntropyLoss

Every name here has liger-kernel's signature (argument names, order and defaults),
return types (a tensor, or ``CrossEntropyOutput`` with ``loss``, ``z_loss``,
``token_accuracy``, ``predicted_tokens`` when one of the ``return_*`` flags is set) and
Liger's rules where they differ from torch's; logitless's own functions keep torch's:

- "mean" over a batch whose tokens are all ignored is 0 (torch and logitless: NaN);
  its gradient is 0 either way.
- With class weights and ``lse_square_scale`` (z-loss), the cross-entropy part of a
  "mean" is divided by the sum of the targets' weights (as torch) and the z-loss part
  by the number of non-ignored tokens (logitless divides both by the weight sum).
- ``use_token_scaling`` multiplies each token's loss (and its z-loss) by the
  model's probability of its target, detached.
- ``token_accuracy`` is the fraction of non-ignored tokens whose argmax is the target
  (per token with reduction="none", 0 at ignored tokens); ``predicted_tokens`` the
  argmax id per token, -1 at ignored tokens.
- ``LigerJSD``/``liger_jsd`` take LOG-probabilities (student first) and differentiate
  them as free variables, as Liger does; see :class:`LigerJSD`.

What differs from Liger (docs/peers.md has the full list): a target outside [0, V)
in the fused loss raises ``ValueError`` on the CPU and gives a NaN loss on a GPU (Liger:
undefined); in the logits-input loss it raises ``TargetOutOfBounds`` on every device, an
``AssertionError`` as Liger's (and a ``ValueError``); the
fused loss accumulates gradients in fp32 whatever ``accum_dtype`` says (they come back
in the parameters' dtype, as Liger's); ``chunk_mem_const`` is accepted and unused (the
chunking follows logitless's memory budget); the logits-input loss never overwrites its
input with the gradient; inputs may be (..., H) (or (..., V)), not only 2-D.
Every output (``predicted_tokens`` included: ``LossStats.argmax``) comes from the
loss's own pass over the vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor, nn

from logitless.ops.cross_entropy import cross_entropy as _ce
from logitless.ops.linear_cross_entropy import linear_cross_entropy as _lce
from logitless.ops.linear_jsd import linear_jsd as _linear_jsd
from logitless.ops.linear_log_probs import linear_log_probs as _linear_log_probs

__all__ = [
    "CrossEntropyOutput",
    "LigerFusedLinearCrossEntropyLoss",
    "LigerFusedLinearCrossEntropyFunction",
    "liger_fused_linear_cross_entropy",
    "LigerCrossEntropyLoss",
    "LigerCrossEntropyFunction",
    "liger_cross_entropy",
    "LigerFusedLinearJSD",
    "LigerFusedLinearJSDFunction",
    "liger_fused_linear_jsd",
    "LigerJSD",
    "LigerJSDFunction",
    "liger_jsd",
]

@dataclass
class CrossEntropyOutput:
    """What Liger's cross-entropy losses return when a ``return_*`` flag is set."""

    loss: Tensor
    z_loss: Optional[Tensor] = None
    token_accuracy: Optional[Tensor] = None
    predicted_tokens: Optional[Tensor] = None


def _check_options(label_smoothing, reduction, softcap) -> None:
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be between 0.0 and 1.0. Got: {label_smoothing}")
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean' or 'sum' or 'none'. Got: {reduction}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must greater than 0.0 or None. Got: {softcap}")


def _keep_options(module: nn.Module, options: dict) -> None:
    """A Liger cross-entropy module's constructor arguments (the ``locals()`` of its
    ``__init__``), checked as Liger checks them, then kept as attributes of the same
    names, as Liger's modules keep them."""
    _check_options(options["label_smoothing"], options["reduction"], options["softcap"])
    for name, value in options.items():
        if name not in ("self", "__class__"):
            setattr(module, name, value)


def _check_flags(**flags) -> None:
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be True or False. Got: {value!r}")


def _liger_ce(
    core,
    target_prob,
    in_dtype: torch.dtype,
    target: Tensor,
    ce_weight: Optional[Tensor],
    ignore_index: int,
    lse_square_scale: float,
    label_smoothing: float,
    reduction: str,
    softcap: Optional[float],
    return_z_loss: bool,
    use_token_scaling: bool,
    return_token_accuracy: bool,
    return_predicted_tokens: bool,
):
    """Liger's cross-entropy rules on a logitless loss ``core(reduction, z_loss,
    return_stats)``; returns Liger's 4-tuple (loss, z_loss, token_accuracy,
    predicted_tokens), entries None where not asked for."""
    _check_options(label_smoothing, reduction, softcap)
    _check_flags(return_z_loss=return_z_loss, return_token_accuracy=return_token_accuracy,
                 return_predicted_tokens=return_predicted_tokens)
    s = float(lse_square_scale)
    valid = target != ignore_index
    n = valid.sum()  # a tensor: no host sync
    # Liger divides the z-loss of a class-weighted "mean" by the token count and the
    # cross-entropy by the weight sum; logitless divides both by the weight sum, so
    # there the z-loss is added here from the (differentiable) per-token lse.
    separate_z = s != 0.0 and ce_weight is not None and reduction == "mean"
    need_stats = return_z_loss or return_token_accuracy or return_predicted_tokens or separate_z
    core_reduction = "none" if use_token_scaling else reduction
    out = core(core_reduction, 0.0 if separate_z else s, need_stats)
    loss, stats = out if need_stats else (out, None)
    dt = torch.promote_types(loss.dtype, torch.float32)  # fp32 (fp64 for fp64 inputs)

    z_tok = None  # per-token z-loss s * lse**2 (0 at ignored), differentiable, fp32
    if stats is not None and s != 0.0:
        lse = stats.lse.to(dt)
        z_tok = torch.where(valid, s * lse * lse, torch.zeros_like(lse))
    elif stats is not None:
        z_tok = torch.zeros_like(stats.lse, dtype=dt)
    scale = target_prob().detach().to(dt) if use_token_scaling else None  # p(target), 0 at ignored

    n_den = n.clamp_min(1).to(dt)
    if use_token_scaling:
        # loss: per-token (w_t * ce + z unless separated); Liger scales each token.
        per_tok = loss.to(dt) * scale
        if reduction == "none":
            loss = per_tok
        elif reduction == "sum":
            loss = per_tok.sum()
        else:
            if ce_weight is None:
                den = n_den
            else:
                w_t = torch.where(valid, ce_weight.to(dt)[target.clamp(0, ce_weight.shape[0] - 1)],
                                  torch.zeros((), device=target.device))
                den = w_t.sum()
            loss = per_tok.sum() / den
    if separate_z:
        z_part = z_tok * scale if use_token_scaling else z_tok
        loss = loss + z_part.sum() / n_den
    if reduction == "mean":
        loss = torch.where(n > 0, loss, torch.zeros_like(loss))  # Liger: 0, torch: NaN

    z_loss = None
    if return_z_loss:
        z = z_tok.detach()
        if use_token_scaling:
            z = z * scale
        if reduction == "mean":
            z = z / n_den
        z = z.to(in_dtype)  # Liger stores the per-token z-loss in the input dtype
        z_loss = z if reduction == "none" else z.sum()
    token_accuracy = None
    if return_token_accuracy:
        acc = stats.correct.to(torch.float32)
        token_accuracy = acc if reduction == "none" else acc.sum() / n  # NaN over no token, as Liger
    predicted = None
    if return_predicted_tokens:
        predicted = stats.argmax  # -1 at ignored tokens
    return loss, z_loss, token_accuracy, predicted


def _flce(_input, weight, target, bias, ce_weight, ignore_index, lse_square_scale, label_smoothing,
          reduction, softcap, return_z_loss, accum_dtype, use_token_scaling, return_token_accuracy,
          return_predicted_tokens):
    target_l = target.long()

    def core(red, z, stats):
        return _lce(_input, weight, target, bias, ignore_index=ignore_index, reduction=red,
                    label_smoothing=label_smoothing, class_weight=ce_weight, softcap=softcap,
                    z_loss=z, return_stats=stats)

    def target_prob():
        with torch.no_grad():
            safe = torch.where(target_l == ignore_index, torch.zeros_like(target_l), target_l)
            logp = _linear_log_probs(_input.detach(), weight.detach(), safe,
                                     None if bias is None else bias.detach(), softcap=softcap)
            return torch.where(target_l != ignore_index, logp.exp(), torch.zeros_like(logp))

    return _liger_ce(core, target_prob, _input.dtype, target_l, ce_weight, ignore_index,
                     lse_square_scale, label_smoothing, reduction, softcap, return_z_loss,
                     use_token_scaling, return_token_accuracy, return_predicted_tokens)


def _output(loss, z_loss, token_accuracy, predicted_tokens, return_z_loss, return_token_accuracy,
            return_predicted_tokens):
    if not return_z_loss and not return_token_accuracy and not return_predicted_tokens:
        return loss
    return CrossEntropyOutput(loss=loss, z_loss=z_loss, token_accuracy=token_accuracy,
                              predicted_tokens=predicted_tokens)


def liger_fused_linear_cross_entropy(
    input,
    weight,
    target,
    bias=None,
    ce_weight=None,
    ignore_index: int = -100,
    lse_square_scale: float = 0.0,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
    softcap: Optional[float] = None,
    return_z_loss: bool = False,
    accum_dtype=None,
    use_token_scaling: bool = False,
    return_token_accuracy: bool = False,
    return_predicted_tokens: bool = False,
    chunk_mem_const: int = 1,
):
    """Liger's ``liger_fused_linear_cross_entropy``: cross-entropy of ``input @
    weight.T + bias`` (input (..., H), weight (V, H)) on logitless, with Liger's rules
    (module docstring). ``accum_dtype`` and ``chunk_mem_const`` are accepted; logitless
    always accumulates in fp32 and sizes its own chunks."""
    if isinstance(chunk_mem_const, bool) or not isinstance(chunk_mem_const, int) or chunk_mem_const < 1:
        raise ValueError(f"chunk_mem_const must be a positive integer. Got: {chunk_mem_const!r}")
    out = _flce(input, weight, target, bias, ce_weight, ignore_index, lse_square_scale, label_smoothing,
                reduction, softcap, return_z_loss, accum_dtype, use_token_scaling, return_token_accuracy,
                return_predicted_tokens)
    return _output(*out, return_z_loss, return_token_accuracy, return_predicted_tokens)


class LigerFusedLinearCrossEntropyFunction:
    """``LigerFusedLinearCrossEntropyFunction.apply(...)`` with Liger's positional
    arguments; returns its 4-tuple (loss, z_loss, token_accuracy, predicted_tokens)."""

    supports_inner_impl_dispatch = True

    @staticmethod
    def apply(_input, weight, target, bias=None, ce_weight=None, ignore_index=-100, lse_square_scale=0.0,
              label_smoothing=0.0, reduction="mean", softcap=None, return_z_loss=False, accum_dtype=None,
              use_token_scaling=False, return_token_accuracy=False, return_predicted_tokens=False,
              ce_impl=None, ce_mode=None, chunk_mem_const=1):
        return _flce(_input, weight, target, bias, ce_weight, ignore_index, lse_square_scale, label_smoothing,
                     reduction, softcap, return_z_loss, accum_dtype, use_token_scaling, return_token_accuracy,
                     return_predicted_tokens)


class LigerFusedLinearCrossEntropyLoss(nn.Module):
    """Liger's module: ``loss_fn(lin_weight, _input, target, bias=None)`` (the weight
    first, as Liger); returns the loss, or ``CrossEntropyOutput`` when a ``return_*``
    flag is set."""

    def __init__(
        self,
        ce_weight: Optional[torch.FloatTensor] = None,
        ignore_index: int = -100,
        lse_square_scale: float = 0.0,
        label_smoothing: float = 0.0,
        reduction: str = "mean",
        softcap: Optional[float] = None,
        return_z_loss: bool = False,
        accum_dtype: Optional[torch.dtype] = None,
        use_token_scaling: bool = False,
        return_token_accuracy: bool = False,
        return_predicted_tokens: bool = False,
    ):
        super().__init__()
        _keep_options(self, locals())

    def forward(self, lin_weight, _input, target, bias=None):
        out = _flce(_input, lin_weight, target, bias, self.ce_weight, self.ignore_index, self.lse_square_scale,
                    self.label_smoothing, self.reduction, self.softcap, self.return_z_loss, self.accum_dtype,
                    self.use_token_scaling, self.return_token_accuracy, self.return_predicted_tokens)
        return _output(*out, self.return_z_loss, self.return_token_accuracy, self.return_predicted_tokens)


class TargetOutOfBounds(ValueError, AssertionError):
    """A target outside [0, V) that is not ``ignore_index``, from the logits-input loss:
    Liger's ``LigerCrossEntropyLoss`` raises ``AssertionError`` for it, logitless's rule is
    ``ValueError``; this error is both, so either ``except`` catches it."""


def _check_targets(target: Tensor, num_classes: int, ignore_index: int) -> None:
    """Liger's check of the logits-input loss, on every device (a host sync, as Liger's)."""
    bad = (target != ignore_index) & ((target < 0) | (target >= num_classes))
    if bool(bad.any()):
        pos = int(bad.reshape(-1).nonzero()[0, 0])
        raise TargetOutOfBounds(f"Target {int(target.reshape(-1)[pos])} is out of bounds: expected in [0, "
                                f"{num_classes}) or ignore_index={ignore_index} (flat position {pos})")


def _ce_logits(_input, target, weight, ignore_index, lse_square_scale, label_smoothing, reduction, softcap,
               return_z_loss, return_token_accuracy, return_predicted_tokens):
    target_l = target.long()
    _check_targets(target_l, _input.shape[-1], ignore_index)

    def core(red, z, stats):
        return _ce(_input, target_l, ignore_index=ignore_index, reduction=red, label_smoothing=label_smoothing,
                   class_weight=weight, softcap=softcap, z_loss=z, return_stats=stats)

    loss, z_loss, acc, pred = _liger_ce(core, None, _input.dtype, target_l, weight, ignore_index,
                                        lse_square_scale, label_smoothing, reduction, softcap, return_z_loss,
                                        False, return_token_accuracy, return_predicted_tokens)
    return loss.to(_input.dtype), z_loss, acc, pred  # Liger's loss is in the logits' dtype


def liger_cross_entropy(
    input,
    target,
    weight=None,
    size_average=None,
    ignore_index: int = -100,
    reduce=None,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    lse_square_scale: float = 0.0,
    softcap: Optional[float] = None,
    return_z_loss: bool = False,
    return_token_accuracy: bool = False,
    return_predicted_tokens: bool = False,
):
    """Liger's ``liger_cross_entropy`` on logits (..., V), on logitless.cross_entropy
    (``size_average``/``reduce`` are placeholders, as in Liger)."""
    out = _ce_logits(input, target, weight, ignore_index, lse_square_scale, label_smoothing, reduction, softcap,
                     return_z_loss, return_token_accuracy, return_predicted_tokens)
    return _output(*out, return_z_loss, return_token_accuracy, return_predicted_tokens)


class LigerCrossEntropyFunction:
    """``LigerCrossEntropyFunction.apply(...)`` with Liger's positional arguments; returns
    its 4-tuple. The input is never overwritten (Liger stores its gradient there)."""

    @staticmethod
    def apply(_input, target, weight=None, ignore_index=-100, lse_square_scale=0.0, label_smoothing=0.0,
              reduction="mean", softcap=None, return_z_loss=False, return_token_accuracy=False,
              return_predicted_tokens=False):
        return _ce_logits(_input, target, weight, ignore_index, lse_square_scale, label_smoothing, reduction,
                          softcap, return_z_loss, return_token_accuracy, return_predicted_tokens)


class LigerCrossEntropyLoss(nn.Module):
    """Liger's ``LigerCrossEntropyLoss``: ``loss_fn(logits, target)``."""

    def __init__(
        self,
        weight: Optional[torch.FloatTensor] = None,
        ignore_index: int = -100,
        lse_square_scale: float = 0.0,
        label_smoothing: float = 0.0,
        reduction: str = "mean",
        softcap: Optional[float] = None,
        return_z_loss: bool = False,
        return_token_accuracy: bool = False,
        return_predicted_tokens: bool = False,
    ):
        super().__init__()
        _keep_options(self, locals())

    def forward(self, _input: Tensor, target: Tensor):
        out = _ce_logits(_input, target, self.weight, self.ignore_index, self.lse_square_scale,
                         self.label_smoothing, self.reduction, self.softcap, self.return_z_loss,
                         self.return_token_accuracy, self.return_predicted_tokens)
        return _output(*out, self.return_z_loss, self.return_token_accuracy, self.return_predicted_tokens)


# ----------------------------------------------------------------------------- JSD


def _check_labels(shift_labels: Optional[Tensor], rows: int) -> None:
    if shift_labels is not None and tuple(shift_labels.shape) != (rows,):
        raise ValueError(f"the shape of shift_labels must be (BT,). Got: {tuple(shift_labels.shape)}")


def _fused_jsd(student_input, student_weight, teacher_input, teacher_weight, shift_labels, jsd_beta,
               ignore_index, temperature, accum_dtype):
    if temperature == 0:
        raise ValueError("temperature cannot be 0.")
    _check_labels(shift_labels, teacher_input.shape[0])
    loss = _linear_jsd(student_input, student_weight, teacher_input.detach(), teacher_weight.detach(),
                       shift_labels, beta=float(jsd_beta), temperature=float(temperature),
                       ignore_index=ignore_index, reduction="mean")
    if shift_labels is not None:  # Liger: 0 over a batch of ignored tokens (torch's rule: NaN)
        loss = torch.where((shift_labels != ignore_index).any(), loss, torch.zeros_like(loss))
    return loss


def liger_fused_linear_jsd(
    student_input,
    student_weight,
    teacher_input,
    teacher_weight,
    shift_labels=None,
    jsd_beta: float = 0.5,
    ignore_index: int = -100,
    temperature: float = 1.0,
    accum_dtype=None,
):
    """Liger's ``liger_fused_linear_jsd`` on logitless.linear_jsd: beta * KL(P || M) +
    (1 - beta) * KL(Q || M), M = beta * P + (1 - beta) * Q, P the teacher's and Q the
    student's softmax(logits / temperature), averaged over non-ignored tokens (0 if
    there are none). The teacher gets no gradient (its tensors are detached)."""
    return _fused_jsd(student_input, student_weight, teacher_input, teacher_weight, shift_labels, jsd_beta,
                      ignore_index, temperature, accum_dtype)


class LigerFusedLinearJSDFunction:
    """``LigerFusedLinearJSDFunction.apply(...)`` with Liger's positional arguments."""

    @staticmethod
    def apply(student_input, student_weight, teacher_input, teacher_weight, shift_labels=None, jsd_beta=0.5,
              ignore_index=-100, temperature=1.0, accum_dtype=None, jsd_impl=None, jsd_mode=None):
        return _fused_jsd(student_input, student_weight, teacher_input, teacher_weight, shift_labels, jsd_beta,
                          ignore_index, temperature, accum_dtype)


class LigerFusedLinearJSD(nn.Module):
    """Liger's module: ``loss_fn(student_input, student_weight, teacher_input,
    teacher_weight, shift_labels)``; see :func:`liger_fused_linear_jsd`."""

    def __init__(self, jsd_beta=0.5, ignore_index=-100, temperature=1.0, accum_dtype: Optional[torch.dtype] = None):
        super().__init__()
        if temperature == 0:
            raise ValueError("temperature cannot be 0.")
        self.jsd_beta = jsd_beta
        self.temperature = temperature
        self.ignore_index = ignore_index
        self.accum_dtype = accum_dtype

    def forward(self, student_input, student_weight, teacher_input, teacher_weight, shift_labels=None):
        return _fused_jsd(student_input, student_weight, teacher_input, teacher_weight, shift_labels,
                          self.jsd_beta, self.ignore_index, self.temperature, self.accum_dtype)


class _LogSpaceJSD(torch.autograd.Function):
    """Liger's JSD of two tensors of LOG-probabilities, differentiated with respect to
    the student's log-probabilities as free variables (no renormalisation), in fp32
    row chunks of bounded memory."""

    @staticmethod
    def forward(ctx, log_q: Tensor, log_p: Tensor, valid: Optional[Tensor], beta: float, n: Tensor, rows: int):
        dt = torch.promote_types(log_q.dtype, torch.float32)  # fp32 (fp64 for fp64 inputs)
        total = torch.zeros((), dtype=dt, device=log_q.device)
        grad = torch.empty_like(log_q) if ctx.needs_input_grad[0] else None
        inv_n = 1.0 / n.clamp_min(1).to(dt)
        for r0 in range(0, log_q.shape[0], rows):
            x = log_q[r0:r0 + rows].to(dt)
            y = log_p[r0:r0 + rows].to(dt)
            if beta == 0.0:  # forward KL(P || Q)
                p = y.exp()
                loss, dx = p * (y - x), -p
            elif beta == 1.0:  # reverse KL(Q || P)
                q = x.exp()
                loss = q * (x - y)
                dx = loss + q
            else:
                hi = torch.maximum(x, y)
                log_m = hi + torch.log(beta * (y - hi).exp() + (1.0 - beta) * (x - hi).exp())
                q = x.exp()
                dx = (1.0 - beta) * q * (x - log_m)
                loss = beta * y.exp() * (y - log_m) + dx
            if valid is not None:
                keep = valid[r0:r0 + rows, None]
                loss = torch.where(keep, loss, torch.zeros_like(loss))
                dx = torch.where(keep, dx, torch.zeros_like(dx))
            total = total + loss.sum()
            if grad is not None:
                grad[r0:r0 + rows] = (dx * inv_n).to(grad.dtype)
        ctx.save_for_backward(grad)
        return torch.where(n > 0, total * inv_n, torch.zeros_like(total))

    @staticmethod
    def backward(ctx, grad_out):
        (grad,) = ctx.saved_tensors
        if grad is None:
            return None, None, None, None, None, None
        return grad * grad_out.to(grad.dtype), None, None, None, None, None


def _log_space_jsd(log_q: Tensor, log_p: Tensor, shift_labels: Optional[Tensor], beta: float,
                   ignore_index: int) -> Tensor:
    if log_q.dim() != 2 or log_p.shape != log_q.shape:
        raise ValueError(f"input and target must both have shape (BT, V); got {tuple(log_q.shape)} and "
                         f"{tuple(log_p.shape)}")
    if not 0.0 <= float(beta) <= 1.0:
        raise ValueError(f"beta must be in [0, 1], got {beta}")
    _check_labels(shift_labels, log_q.shape[0])
    if shift_labels is not None:
        valid = shift_labels != ignore_index
        n = valid.sum()
    else:
        valid = None
        n = torch.tensor(log_q.shape[0], device=log_q.device)
    rows = max(1, (1 << 22) // max(1, log_q.shape[1]))
    loss = _LogSpaceJSD.apply(log_q, log_p.detach(), valid, float(beta), n, rows)
    return loss.to(log_q.dtype)  # Liger's loss is in the input dtype


def liger_jsd(input, target, shift_labels=None, beta: float = 0.5, ignore_index: int = -100):
    """Liger's ``liger_jsd``: generalized JSD of LOG-probabilities ``input`` (student,
    log Q) and ``target`` (teacher, log P), (BT, V) each; see :class:`LigerJSD`."""
    return _log_space_jsd(input, target, shift_labels, beta, ignore_index)


class LigerJSDFunction:
    """``LigerJSDFunction.apply(input, target, shift_labels, beta, ignore_index, ...)``."""

    @staticmethod
    def apply(_input, target, shift_labels=None, beta=0.5, ignore_index=-100, jsd_impl=None, jsd_mode=None):
        return _log_space_jsd(_input, target, shift_labels, beta, ignore_index)


class LigerJSD(nn.Module):
    """Liger's ``LigerJSD``: ``loss_fn(log_q, log_p, shift_labels=None)`` with log_q the
    student's and log_p the teacher's LOG-probabilities, (BT, V):

        beta * KL(P || M) + (1 - beta) * KL(Q || M),  M = beta * P + (1 - beta) * Q

    (beta = 0: KL(P || Q); beta = 1: KL(Q || P)), summed over the vocabulary and
    averaged over the tokens whose label is not ``ignore_index`` (all tokens without
    labels; 0 if all are ignored). As Liger, the gradient is the partial derivative
    with respect to the entries of log_q taken as free variables (P = exp(log_p) and
    Q = exp(log_q), not renormalised); for log-probabilities made by ``log_softmax``
    the gradient reaching the logits equals that of ``logitless.jsd`` on them, which is
    the op to use when the logits are at hand (it takes logits). This module runs on
    the already materialised inputs in fp32 row chunks; the teacher gets no gradient.
    """

    def __init__(self, beta: float = 0.5, ignore_index: int = -100):
        super().__init__()
        self.beta = beta
        self.ignore_index = ignore_index

    def forward(self, log_q: Tensor, log_p: Tensor, shift_labels: Optional[torch.LongTensor] = None):
        return _log_space_jsd(log_q, log_p, shift_labels, self.beta, self.ignore_index)

