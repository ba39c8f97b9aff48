"""LLaMA-Factory (0.9): SFT and DPO losses computed by logitless, without the (tokens x vocab)
logits (docs/transformers.md#llama-factory). llamafactory is imported by :func:`patch` and
:func:`main`, not by importing this module.

LLaMA-Factory 0.9 reads no key from a training YAML that loads outside code (its
``enable_liger_kernel`` imports Liger by name; its parser refuses unknown keys), so the switch is
the command that runs the YAML, LLaMA-Factory's own ``run_exp`` after :func:`patch`::

    python -m logitless.integrations.llamafactory examples/train_lora/llama3_lora_sft.yaml
    torchrun --nproc-per-node 8 -m logitless.integrations.llamafactory config.yaml   # as its launcher

(what ``llamafactory-cli train config.yaml`` runs, one process per GPU under torchrun), or in
Python ``patch(); llamafactory.train.tuner.run_exp(args)``. Two optional YAML keys are read and
removed before LLaMA-Factory parses the rest: ``logitless_memory_budget`` (bytes) and
``logitless_backend``.

:func:`patch` (idempotent, this process) changes two LLaMA-Factory classes:

- SFT (``stage: sft``, ``CustomSeq2SeqTrainer``): each trainer's model is
  ``logitless.transformers.patch``-ed when the trainer is built; transformers' ``Trainer`` calls it
  with ``labels``, so the loss is transformers' ``ForCausalLMLoss`` without logits (LoRA, DDP,
  DeepSpeed ZeRO-3 and FSDP as ``logitless.transformers`` supports them).
- DPO (``stage: dpo``, ``CustomDPOTrainer.concatenated_forward``): the model (through its wrappers)
  returns its final hidden states and one position's logits (``logits_to_keep=1``); the summed
  (or, for IPO / ORPO / SimPO, averaged) log-probs of the chosen and rejected labels come from
  ``linear_log_probs``, with ``ld_alpha`` as LLaMA-Factory's ``get_batch_logps`` applies it; the
  ``logits/chosen`` and ``logits/rejected`` metrics are the exact means of the logits, from the
  mean head row. The DPO loss, reference model and metrics are LLaMA-Factory's. Refused with a
  ``ValueError``: a head weight that DeepSpeed ZeRO-3 or FSDP shards outside the forward (use
  ZeRO-0/1/2 or DDP for DPO), heads that scale their logits otherwise.

``patch`` logs once per process, at INFO, on LLaMA-Factory's logger, that logitless is active.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from logitless.ops.linear_log_probs import linear_log_probs
from logitless.options import check_memory_budget

from . import hf as _hf
from ._announce import announce

__all__ = ["patch", "main", "OPTION_KEYS"]

#: The YAML keys this integration reads (and removes) and the option each sets.
OPTION_KEYS = {"logitless_memory_budget": "memory_budget", "logitless_backend": "backend"}

_IGNORE_INDEX = -100


def _check_options(options: dict) -> dict:
    unknown = set(options) - set(OPTION_KEYS.values())
    if unknown:
        raise ValueError(f"logitless.integrations.llamafactory: unknown option(s) {sorted(unknown)}; "
                         f"known: {sorted(OPTION_KEYS.values())}")
    if options.get("memory_budget") is not None:
        try:
            check_memory_budget(options["memory_budget"])
        except ValueError as e:
            raise ValueError(f"logitless_memory_budget: {e}") from None
    if options.get("backend", "auto") not in ("auto", "triton", "torch"):
        raise ValueError(f"logitless_backend must be 'auto', 'triton' or 'torch', got {options['backend']!r}")
    return {k: v for k, v in options.items() if v is not None}


def patch(**options: Any) -> None:
    """Route LLaMA-Factory's SFT and DPO trainers of this process through logitless (module
    docstring); ``options``: ``memory_budget``, ``backend``."""
    from llamafactory.train.dpo.trainer import CustomDPOTrainer
    from llamafactory.train.sft.trainer import CustomSeq2SeqTrainer

    options = _check_options(options)
    sft_init = getattr(CustomSeq2SeqTrainer.__init__, "_logitless_original", CustomSeq2SeqTrainer.__init__)
    dpo_forward = getattr(CustomDPOTrainer.concatenated_forward, "_logitless_original",
                          CustomDPOTrainer.concatenated_forward)

    def __init__(self, *args, **kwargs):
        sft_init(self, *args, **kwargs)
        import logitless.transformers as lt

        lt.patch(self.model, **options)

    def concatenated_forward(self, model, batch, is_ref_model=False):
        return _dpo_forward(self, model, batch, is_ref_model, options)

    __init__._logitless_original = sft_init
    concatenated_forward._logitless_original = dpo_forward
    CustomSeq2SeqTrainer.__init__ = __init__
    CustomDPOTrainer.concatenated_forward = concatenated_forward
    announce("llamafactory", "SFT and DPO losses from hidden states and the head weight, no logits",
             logger="llamafactory.logitless")


def _dpo_forward(trainer, model, batch: dict, is_ref_model: bool, options: dict) -> dict:
    """LLaMA-Factory 0.9's ``CustomDPOTrainer.concatenated_forward`` without the logits."""
    from llamafactory.train.trainer_utils import nested_detach

    if trainer.finetuning_args.use_ref_model:
        batch = nested_detach(batch, clone=True)
    labels = batch.pop("labels")
    inner = trainer.accelerator.unwrap_model(model)
    head = _hf.lm_head(inner)
    weight, bias = head.weight, head.bias
    if hasattr(weight, "ds_id") or hasattr(weight, "device_mesh"):
        raise ValueError("logitless.integrations.llamafactory: DPO reads the LM-head weight outside the model's "
                         "forward, where DeepSpeed ZeRO-3 / FSDP keep only a shard; use ZeRO-0/1/2 or DDP for DPO, "
                         "or run it without logitless")
    out = model(**batch, return_dict=True, use_cache=False, logits_to_keep=1, output_hidden_states=True)
    hidden = out.hidden_states[-1]
    tokens = labels[:, 1:]
    mask = tokens != _IGNORE_INDEX
    logp = linear_log_probs(hidden[:, :-1], weight, tokens.masked_fill(~mask, 0), bias,
                            **_hf.head_options(inner), **options)
    all_logps, valid_length = _sequence_logps(logp, mask, None if is_ref_model else trainer.ld_alpha)
    if trainer.loss_type in ("ipo", "orpo", "simpo"):
        all_logps = all_logps / valid_length
    with torch.no_grad():   # the mean over the vocabulary of each position's logits: h . mean(W) + mean(b)
        mean_logit = hidden.float() @ weight.float().mean(0) + (0.0 if bias is None else bias.float().mean())
    half = batch["input_ids"].size(0) // 2
    chosen_logps, rejected_logps = all_logps.split(half, dim=0)
    chosen_length, _ = valid_length.split(half, dim=0)
    chosen_mean, rejected_mean = mean_logit.unsqueeze(-1).split(half, dim=0)
    chosen_avg = chosen_logps if trainer.loss_type in ("ipo", "orpo", "simpo") else chosen_logps / chosen_length
    return {"chosen_logps": chosen_logps, "rejected_logps": rejected_logps, "chosen_logits": chosen_mean,
            "rejected_logits": rejected_mean, "chosen_logps_avg": chosen_avg}


def _sequence_logps(per_token: torch.Tensor, mask: torch.Tensor, ld_alpha: Optional[float]):
    """LLaMA-Factory's ``get_batch_logps`` reduction of per-token log-probs (B, L - 1)."""
    valid_length = mask.sum(-1)
    if ld_alpha is None:
        return (per_token * mask).sum(-1), valid_length
    half = mask.shape[0] // 2
    min_lengths = torch.min(valid_length[:half], valid_length[half:])
    public_lengths = torch.argmax(mask.int(), dim=1) + torch.cat([min_lengths, min_lengths], dim=0)
    position = torch.arange(mask.shape[-1], device=mask.device).expand_as(per_token)
    front = position < public_lengths.unsqueeze(1)
    logps = (per_token * (front & mask).float()).sum(-1) + ld_alpha * (per_token * (~front & mask).float()).sum(-1)
    return logps, valid_length


def main(args: Optional[dict] = None, callbacks: Optional[list] = None) -> None:
    """``python -m logitless.integrations.llamafactory CONFIG.yaml [key=value ...]``: LLaMA-Factory's
    ``run_exp`` on the YAML (read as its launcher reads ``sys.argv``; or ``args``, a dict; with
    ``callbacks`` as ``run_exp`` takes them) after :func:`patch` with the YAML's ``logitless_*``
    options."""
    from llamafactory.hparams.parser import read_args
    from llamafactory.train.tuner import run_exp

    args = read_args(dict(args) if args is not None else None)
    if not isinstance(args, dict):
        raise ValueError("logitless.integrations.llamafactory: give a YAML or JSON config file "
                         "(python -m logitless.integrations.llamafactory config.yaml)")
    options = {option: args.pop(key) for key, option in OPTION_KEYS.items() if key in args}
    patch(**options)
    run_exp(args, callbacks=callbacks)


if __name__ == "__main__":
    main()
