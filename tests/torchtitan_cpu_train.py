"""torchtitan's own trainer (``torchtitan.train.main``, torchtitan 0.3.0) on the CPU, for
tests/test_torchtitan_trainer.py: run under torchrun with torchtitan's own arguments::

    torchrun --nproc-per-node 2 tests/torchtitan_cpu_train.py --module llama3 --config llama3_debugmodel \\
        --override.imports logitless.integrations.torchtitan.logitless_loss ...

torchtitan 0.3.0 has no CPU mode: at import it takes the accelerator's device module
(``torch.cuda`` where none is found) and its ``Trainer`` calls ``set_device`` on it before
anything else; its language models' attention (``FlexAttention``, compiled) has no backward
on a CPU; FSDP2's gradient reduce-scatter with torchtitan's divide factor of 1 is a
``PREMUL_SUM``, which gloo lacks. This harness changes exactly these before ``main()`` runs,
all outside the loss: ``torchtitan.tools.utils.device_type`` / ``device_module`` become the
CPU (the process group is gloo, the model is initialised on the CPU, the memory monitor reads
zeros); ``FlexAttention.compiled_flex_attn`` runs the same block mask densified through
``F.scaled_dot_product_attention``, ``create_block_mask`` uncompiled; FSDP modules reduce
their gradients with a plain sum (``set_force_sum_reduction_for_comms``; the factor is 1: the
same numbers). The trainer, its config parsing, the override, FSDP2, TP and the loss are
torchtitan's and logitless'.

It prints one ``LOGITLESS_TEST {json}`` line per logged step (the step's loss and gradient
norm as floats, exactly, from ``MetricsProcessor.log``) and one at exit with the number of
calls of logitless' fused op in this process.
"""

import atexit
import json
import os
import sys
import types

import torch
import torch.nn.functional as F
import torchtitan.tools.utils as tt_utils

_CPU = types.ModuleType("torchtitan_cpu_device")
_CPU.set_device = lambda device: None
_CPU.device_count = lambda: 1
_CPU.current_device = lambda: 0
_CPU.is_available = lambda: True
_CPU.synchronize = lambda device=None: None
_CPU.empty_cache = lambda: None
_CPU.reset_peak_memory_stats = lambda device=None: None
_CPU.get_device_name = lambda device=None: "cpu"
_CPU.get_device_properties = lambda device=None: types.SimpleNamespace(name="cpu", total_memory=2**34)
_CPU.memory_stats = lambda device=None: {"active_bytes.all.peak": 0, "reserved_bytes.all.peak": 0,
                                         "num_alloc_retries": 0, "num_ooms": 0}
tt_utils.device_type = "cpu"
tt_utils.device_module = _CPU

import torchtitan.distributed.fsdp as tt_fsdp  # noqa: E402
from torch.nn.attention.flex_attention import create_block_mask, create_mask  # noqa: E402
from torchtitan.components.metrics import MetricsProcessor  # noqa: E402
from torchtitan.models.common import attention as tt_attention  # noqa: E402

import logitless.integrations.torchtitan as logitless_torchtitan  # noqa: E402


def _flex_attention_on_cpu(q, k, v, *, score_mod, block_mask, scale, enable_gqa, return_aux, kernel_options):
    """FlexAttention's result for a mask-only block mask (torchtitan's language models)."""
    if score_mod is not None or return_aux.lse:
        raise NotImplementedError("the CPU harness runs mask-only FlexAttention without lse")
    mask = create_mask(block_mask.mask_mod, q.shape[0], 1, q.shape[2], k.shape[2], device=q.device)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=enable_gqa)
    return out, types.SimpleNamespace(lse=None)


tt_attention.FlexAttention.compiled_flex_attn = staticmethod(_flex_attention_on_cpu)
tt_attention._compiled_create_block_mask = create_block_mask
_divide_by_one = tt_fsdp.disable_fsdp_gradient_division


def _sum_on_gloo(model):
    _divide_by_one(model)
    for module in model.modules():
        if isinstance(module, tt_fsdp.FSDPModule):
            module.set_force_sum_reduction_for_comms(True)


tt_fsdp.disable_fsdp_gradient_division = _sum_on_gloo

_RANK = int(os.environ.get("RANK", "0"))
_calls = [0]
_fused_op = logitless_torchtitan.linear_cross_entropy


def _counted(*args, **kwargs):
    _calls[0] += 1
    return _fused_op(*args, **kwargs)


logitless_torchtitan.linear_cross_entropy = _counted
_log = MetricsProcessor.log


def _emit(record: dict) -> None:
    """One line in one write (the ranks share the launcher's stdout)."""
    sys.stdout.flush()
    os.write(1, ("LOGITLESS_TEST " + json.dumps(dict(rank=_RANK, **record)) + "\n").encode())


def _log_step(self, step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=None):
    _emit({"step": step, "loss": float(global_avg_loss), "grad_norm": float(grad_norm)})
    return _log(self, step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=extra_metrics)


MetricsProcessor.log = _log_step
atexit.register(lambda: _emit({"calls": _calls[0]}))

if __name__ == "__main__":
    torch.set_num_threads(1)
    from torchtitan.train import main

    main()
