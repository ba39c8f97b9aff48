"""Training steps of a small Megatron Core GPT (or HybridModel: ``--model hybrid``), unpatched vs
``logitless.integrations.megatron.install``: the loss curves (equal within bf16 noise), the peak
memory (torch.cuda.max_memory_allocated) and the median step time; a JSON per run in $OUT
(default ./out).

Needs megatron-core (0.19.2, its wheel: no TE, no apex; Megatron's local layer specs):

  # where there is network, in the repository root (the wheel is cp312 manylinux):
  # (add numpy and packaging to .peers if the GPU image lacks them)
  WHEEL="--only-binary=:all: --platform manylinux_2_28_x86_64 --python-version 3.12"
  pip download --no-deps $WHEEL -d .peers megatron-core==0.19.2
  # on the GPU machine, carrying .peers (prelude.sh installs .peers/*.whl into /tmp/peers
  # with pip install --no-deps --target and sets PYTHONPATH to src and /tmp/peers):
  . benchmarks/gpu/prelude.sh
  python3 benchmarks/gpu/megatron_steps.py                                   # 1 GPU, TP=1
  python3 benchmarks/gpu/megatron_steps.py --model hybrid --mtp 1            # HybridModel, one MTP depth
  python3 benchmarks/gpu/megatron_steps.py --mtp 1                           # GPTModel, one MTP depth
  torchrun --nproc_per_node 2 benchmarks/gpu/megatron_steps.py --tp 2 --sp   # TP=2 + sequence parallel
  # the same on the CPU at a tiny size (gloo), as checked where it was written:
  python3 benchmarks/gpu/megatron_steps.py --device cpu --tiny
  torchrun --nproc_per_node 2 benchmarks/gpu/megatron_steps.py --device cpu --tiny --tp 2 --sp

Defaults (GPU): 8 layers, hidden 2048, 16 heads, vocab 128256, sequence 4096, batch 1, bf16
(Float16Module, fp32 master weights and AdamW), 12 steps (the first 2 not timed) on a fixed
set of 4 batches (the loss falls). Without apex / TE, Megatron's torch norms refuse sequence
parallel: this script builds them with it off and marks their weights ``sequence_parallel``
(their gradients are all-reduced over TP after each backward, as finalize_model_grads does).
``--model hybrid``: Megatron's HybridModel from the pattern "*-" repeated (attention, MLP: the
local layer specs; no Mamba, which needs mamba_ssm), ``--mtp N`` MTP depths "/*-"; its stack's
final norm is Transformer Engine's, built here as Megatron's torch norm.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "src"))


def parse():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--tiny", action="store_true", help="2 layers, hidden 64, vocab 1000, sequence 64, 4 steps")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--sp", action="store_true", help="sequence parallel (needs --tp > 1)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--dtype", default=None, choices=["bf16", "fp32"], help="default: bf16 on cuda, fp32 on cpu")
    p.add_argument("--modes", default="unpatched,logitless")
    p.add_argument("--model", default="gpt", choices=["gpt", "hybrid"])
    p.add_argument("--mtp", type=int, default=0, help="MTP depths")
    a = p.parse_args()
    if a.tiny:
        a.layers, a.hidden, a.heads, a.vocab, a.seq = 2, 64, 4, 1000, 64
        a.steps, a.warmup = min(a.steps, 4), 1
    a.dtype = a.dtype or ("bf16" if a.device == "cuda" else "fp32")
    if a.sp and a.tp < 2:
        p.error("--sp needs --tp > 1")
    return a


def setup(a):
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if a.device == "cuda":
        os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")  # before CUDA starts (Megatron's advice)
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if "MASTER_ADDR" not in os.environ:  # one process without torchrun
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29500 + os.getpid() % 1000))
    dist.init_process_group("nccl" if a.device == "cuda" else "gloo", rank=rank, world_size=world)
    if world % a.tp:
        raise SystemExit(f"--tp {a.tp} does not divide the world size {world}")
    if a.device == "cpu":
        # Megatron allocates some buffers on torch.cuda.current_device() and forks the CUDA RNG
        # around dropout: on the CPU, the CPU and no fork (dropout is 0 here).
        torch.cuda.current_device = lambda: "cpu"
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
        get_cuda_rng_tracker().fork = lambda *args, **kw: contextlib.nullcontext()
    from megatron.core import parallel_state
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=a.tp)
    return rank, world


def sp_torch_norms():
    """Megatron's torch norms (no apex / TE) with sequence parallel: built with it off,
    their weights marked ``sequence_parallel`` (grads all-reduced over TP by ``step``)."""
    from megatron.core.transformer import torch_norm

    cls = torch_norm.WrappedTorchNorm
    if getattr(cls, "_sp_ok", False):
        return
    original = cls.__new__

    def new(klass, config, hidden_size, *args, **kw):
        sp = config.sequence_parallel
        config.sequence_parallel = False
        try:
            norm = original(klass, config, hidden_size, *args, **kw)
        finally:
            config.sequence_parallel = sp
        for p in norm.parameters():
            p.sequence_parallel = sp
        return norm

    cls.__new__ = new
    cls._sp_ok = True


def build(a, device):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec, get_gpt_mtp_block_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.transformer_config import TransformerConfig

    bf16 = a.dtype == "bf16"
    cfg = TransformerConfig(
        num_layers=a.layers, hidden_size=a.hidden, num_attention_heads=a.heads, ffn_hidden_size=4 * a.hidden,
        normalization="RMSNorm", hidden_dropout=0.0, attention_dropout=0.0, bf16=bf16,
        params_dtype=torch.float32, tensor_model_parallel_size=a.tp, sequence_parallel=a.sp,
        use_cpu_initialization=device.type == "cpu", init_method_std=0.02)
    if a.mtp:
        cfg.mtp_num_layers = a.mtp
    torch.manual_seed(1234)
    if device.type == "cuda":  # the same initial weights for every mode (Megatron's TP RNG too)
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
        model_parallel_cuda_manual_seed(1234)
    if a.model == "hybrid":
        model = hybrid(a, cfg).to(device)
        master = [p.detach().clone().float() for p in model.parameters()]
        return model, Float16Module(cfg, model) if bf16 else model, master
    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    mtp = get_gpt_mtp_block_spec(cfg, spec, use_transformer_engine=False) if a.mtp else None
    model = GPTModel(config=cfg, transformer_layer_spec=spec, mtp_block_spec=mtp,
                     vocab_size=a.vocab, max_sequence_length=a.seq, position_embedding_type="rope",
                     share_embeddings_and_output_weights=False).to(device)
    master = [p.detach().clone().float() for p in model.parameters()]
    wrapped = Float16Module(cfg, model) if bf16 else model
    return model, wrapped, master


def hybrid(a, cfg):
    """Megatron's HybridModel, pattern "*-" x layers/2 (+ "/*-" per MTP depth), local layer specs."""
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec, get_gpt_mtp_block_spec
    from megatron.core.models.hybrid import hybrid_block
    from megatron.core.models.hybrid.hybrid_model import HybridModel
    from megatron.core.ssm.mlp_layer import MLPLayer
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

    local = get_gpt_layer_local_spec(normalization="RMSNorm")
    attention = ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
        input_layernorm=WrappedTorchNorm, self_attention=local.submodules.self_attention,
        self_attn_bda=get_bias_dropout_add))
    mlp = ModuleSpec(module=MLPLayer, submodules=TransformerLayerSubmodules(
        pre_mlp_layernorm=WrappedTorchNorm, mlp=local.submodules.mlp, mlp_bda=get_bias_dropout_add))
    mtp = get_gpt_mtp_block_spec(cfg, local, use_transformer_engine=False) if a.mtp else None
    stack = ModuleSpec(module=hybrid_block.HybridStack, submodules=hybrid_block.HybridStackSubmodules(
        attention_layer=attention, mlp_layer=mlp, mtp_block_spec=mtp))
    pattern = "*-" * (a.layers // 2) + "/*-" * a.mtp
    saved, hybrid_block.TENorm = hybrid_block.TENorm, WrappedTorchNorm   # no Transformer Engine here
    try:
        return HybridModel(config=cfg, hybrid_stack_spec=stack, vocab_size=a.vocab, max_sequence_length=a.seq,
                           hybrid_layer_pattern=pattern, position_embedding_type="rope")
    finally:
        hybrid_block.TENorm = saved


def batches(a, device):
    g = torch.Generator().manual_seed(42)
    out = []
    for _ in range(4):
        ids = torch.randint(0, a.vocab, (a.batch, a.seq + 1), generator=g)
        out.append((ids[:, :-1].to(device), ids[:, 1:].contiguous().to(device)))
    pos = torch.arange(a.seq, device=device).expand(a.batch, a.seq)
    mask = torch.ones(1, 1, a.seq, a.seq, dtype=torch.bool, device=device).triu(1)  # True: masked
    return out, pos, mask


def run(a, mode, device):
    from megatron.core import parallel_state

    import logitless.integrations.megatron as lm

    model, wrapped, master = build(a, device)
    if mode == "logitless":
        lm.install(wrapped)
    params = list(model.parameters())
    opt = torch.optim.AdamW(master, lr=a.lr, betas=(0.9, 0.95), weight_decay=0.0)
    tp_group = parallel_state.get_tensor_model_parallel_group()
    data, pos, mask = batches(a, device)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    losses, times = [], []
    for step in range(a.steps):
        ids, labels = data[step % len(data)]
        t0 = time.perf_counter()
        per_token = wrapped(ids, pos, mask, labels=labels)  # (b, s) fp32
        loss = per_token.float().mean()
        loss.backward()
        for p, m in zip(params, master):
            if p.grad is None:
                continue
            if a.sp and getattr(p, "sequence_parallel", False):
                dist.all_reduce(p.grad, group=tp_group)
            m.grad = p.grad.float()
            p.grad = None
        opt.step()
        opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            for p, m in zip(params, master):
                p.copy_(m)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    out = dict(losses=losses, step_s=times, median_step_s=statistics.median(times[a.warmup:] or times),
               peak_bytes=torch.cuda.max_memory_allocated() if cuda else None)
    del model, wrapped, master, opt
    if cuda:
        torch.cuda.empty_cache()
    return out


def main():
    a = parse()
    device_type = a.device
    rank, world = setup(a)
    device = torch.device("cuda", torch.cuda.current_device()) if device_type == "cuda" else torch.device("cpu")
    if a.sp:
        sp_torch_norms()
    results = {}
    for mode in a.modes.split(","):
        results[mode] = run(a, mode, device)
        if rank == 0:
            r = results[mode]
            peak = f"{r['peak_bytes'] / 2**30:.2f} GiB" if r["peak_bytes"] is not None else "n/a"
            print(f"{mode:>10}: median step {r['median_step_s'] * 1e3:.1f} ms, peak {peak}, "
                  f"losses {[round(x, 4) for x in r['losses']]}", flush=True)
    if rank == 0:
        summary = dict(vars(a), world=world, torch=torch.__version__,
                       gpu=torch.cuda.get_device_name() if device_type == "cuda" else None, results=results)
        if {"unpatched", "logitless"} <= results.keys():
            u, lg = results["unpatched"], results["logitless"]
            summary["max_abs_loss_diff"] = max(abs(x - y) for x, y in zip(u["losses"], lg["losses"]))
            summary["step_time_ratio"] = lg["median_step_s"] / u["median_step_s"]
            if u["peak_bytes"]:
                summary["peak_saved_bytes"] = u["peak_bytes"] - lg["peak_bytes"]
            print(f"max |loss diff| {summary['max_abs_loss_diff']:.3g}, step time x{summary['step_time_ratio']:.3f}"
                  + (f", peak memory saved {summary['peak_saved_bytes'] / 2**30:.2f} GiB" if u["peak_bytes"] else ""))
        out = os.environ.get("OUT", "./out")
        os.makedirs(out, exist_ok=True)
        name = (f"megatron_steps-{a.model}{f'-mtp{a.mtp}' if a.mtp else ''}-{device_type}-tp{a.tp}"
                f"{'-sp' if a.sp else ''}{'-tiny' if a.tiny else ''}.json")
        with open(os.path.join(out, name), "w") as f:
            json.dump(summary, f, indent=1)
        print("wrote", os.path.join(out, name))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
