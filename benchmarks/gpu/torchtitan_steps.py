"""Training steps of torchtitan's llama3 (vocab 128256, seq 4096): torchtitan's own loss vs
``logitless.integrations.torchtitan.LogitlessLoss``: loss curves, peak memory, median step time.

Commands (GPU machine; $OUT defaults to ./out):

    pip install --no-deps wheels/*.whl          # the wheels below, carried (no network there)
    PYTHONPATH=$PWD/src python benchmarks/gpu/torchtitan_steps.py                    # 1 GPU
    export PYTHONPATH=$PWD/src S=benchmarks/gpu/torchtitan_steps.py
    torchrun --nproc_per_node 2 $S --dp 2                                           # FSDP2
    torchrun --nproc_per_node 2 $S --tp 2                                           # TP=2
    # torchtitan's own spmd_types loss-parallel CE needs V divisible by TP (128256 is)
    # CPU proof at tiny size (gloo), as run on the development machine:
    python $S --device cpu --vocab 1001 --seq 32 --layers 1 --steps 3 --warmup 1
    torchrun --nproc_per_node 2 $S --device cpu --dp 2 --vocab 1001 --seq 32 --layers 1 --steps 3 --warmup 1
    torchrun --nproc_per_node 2 $S --device cpu --tp 2 --vocab 1000 --seq 32 --layers 1 --steps 3 --warmup 1

Wheels to carry (torchtitan 0.3.0 and what ``import torchtitan.trainer`` loads, measured here
with torch 2.15: the trainer module imports its checkpointer, dataloader, tokenizer and
metrics even when they are not built): torchtitan==0.3.0 spmd_types==0.2.3 torch_checkpointing
torchdata tyro docstring-parser typeguard shtab rich markdown-it-py mdurl pygments datasets
pyarrow pandas python-dateutil dill multiprocess xxhash fsspec huggingface_hub aiohttp
aiohappyeyeballs aiosignal frozenlist multidict propcache yarl attrs tokenizers tensorboard
absl-py protobuf grpcio markdown werkzeug tensorboard-data-server (skip those the machine
has; ``pip download --no-deps <names> -d wheels`` on a machine with network, Python 3.12).
Not imported on this path: wandb, einops, pillow, torchao (lazy).

torch 2.11: torchtitan 0.3.0's llama3 path imports ``torch.distributed.fsdp.DataParallelMeshDims``
(``distributed/full_dtensor.py``), which PyTorch added in March 2026 (pytorch#176334), after
2.11's branch cut as far as can be told here (no torch 2.11 on this machine: torch 2.13 has
every torch name the path imports). If the import fails the script says so in its JSON
(``"torchtitan": "unavailable: ..."``) and runs the same comparison on a plain-PyTorch Llama
(the same shapes; FSDP2 by ``fully_shard`` with the loss as a registered head method, TP=2 by a
``ColwiseParallel`` head with ``loss_parallel``): torch's cross-entropy on the logits vs
``logitless.linear_cross_entropy``. ``--impl plain`` forces that path, ``--impl torchtitan``
refuses the fallback.

Per loss: ``--steps`` steps on the same synthetic batches (a fixed set of token sequences
drawn from a seeded bigram chain, cycled, so the loss falls); per step the loss (mean over
tokens), and after ``--warmup`` steps the median step time and the peak memory
(``torch.cuda.max_memory_allocated``). Steps run eagerly (no CUDA graphs, no compile) for
both losses alike. JSON to ``$OUT/torchtitan_steps-<torchtitan|plain>-<1gpu|fsdp2|tp2>-<device>.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import platform
import statistics
import tempfile
import time
import types

import torch
import torch.distributed as dist


def parse():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--impl", default="auto", choices=["auto", "torchtitan", "plain"])
    p.add_argument("--flavor", default="debugmodel", help="torchtitan llama3 flavour (debugmodel, 1B, ...)")
    p.add_argument("--layers", type=int, default=None, help="keep the first N layers (default: all)")
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--batch", type=int, default=1, help="local batch size")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--dp", type=int, default=1, help="FSDP2 degree")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (vocabulary-parallel head)")
    p.add_argument("--spmd-backend", default="spmd_types", choices=["spmd_types", "partial_dtensor"])
    p.add_argument("--losses", default="titan,logitless",
                   help="comma list: titan (torchtitan's CrossEntropyLoss on logits), chunked "
                        "(ChunkedLossWrapper), logitless")
    p.add_argument("--lr", type=float, default=3e-4)
    return p.parse_args()


def init_dist(device):
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    if device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device == "cuda" else "gloo")
    return dist.get_rank(), dist.get_world_size()


def batches(args, rank_data, n=4):
    """n fixed (tokens, labels) batches from a seeded bigram chain (learnable, so the loss falls)."""
    g = torch.Generator().manual_seed(0)
    nxt = torch.randint(0, args.vocab, (args.vocab, 4), generator=g)
    out = []
    for i in range(n):
        g2 = torch.Generator().manual_seed(1000 * rank_data + i)
        seq = torch.empty(args.batch, args.seq + 1, dtype=torch.long)
        seq[:, 0] = torch.randint(0, args.vocab, (args.batch,), generator=g2)
        choice = torch.randint(0, 4, (args.batch, args.seq), generator=g2)
        for t in range(args.seq):
            seq[:, t + 1] = nxt[seq[:, t], choice[:, t]]
        out.append((seq[:, :-1].contiguous(), seq[:, 1:].contiguous()))
    return out


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


# ---- torchtitan's own machinery ---------------------------------------------------------

def titan_trainer(args, loss_kind, world, device, parallel_dims=None):
    """What ``Trainer.__init__`` builds, in its order (no tokenizer, dataloader or
    checkpointer: the batches are synthetic), with torchtitan's optimizer."""
    import torchtitan.distributed.parallel_dims as pd
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
    from torchtitan.components.optimizer import default_adamw
    from torchtitan.config import TORCH_DTYPE_MAP
    from torchtitan.config.override import apply_overrides
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.models.llama3 import model_registry
    from torchtitan.models.llama3.config_registry import llama3_debugmodel
    from torchtitan.tools import utils

    pd.device_type = device
    if device == "cpu":   # FlexAttention has no CPU backward and compiling it on a CPU is slow
        from torch.nn.attention.flex_attention import flex_attention
        from torchtitan.models.common.attention import FlexAttention
        FlexAttention._compiled_flex_attn = flex_attention
    config = llama3_debugmodel()
    spec = model_registry(args.flavor, attn_backend="flex")
    m = spec.model
    if args.layers is not None:
        m.layers = m.layers[: args.layers]
    m.vocab_size = args.vocab
    m.tok_embeddings.num_embeddings = args.vocab
    m.lm_head.out_features = args.vocab
    config.model_spec = spec
    ce = CrossEntropyLoss.Config(global_vocab_size=args.vocab)
    config.loss = ChunkedLossWrapper.Config(loss_fn=ce) if loss_kind == "chunked" else ce
    if loss_kind == "logitless":
        config.override.imports = ["logitless.integrations.torchtitan.logitless_loss"]
    config.parallelism = dataclasses.replace(config.parallelism, data_parallel_shard_degree=args.dp,
                                             tensor_parallel_degree=args.tp, spmd_backend=args.spmd_backend)
    config.training = dataclasses.replace(config.training, local_batch_size=args.batch, seq_len=args.seq,
                                          steps=args.steps, disable_cuda_graphs=True)
    config.optimizer = default_adamw(lr=args.lr)
    if device == "cpu":
        config.optimizer.implementation = "foreach"   # "fused" is CUDA only
    if parallel_dims is None:
        parallel_dims = ParallelDims.from_config(config.parallelism, world)
    dist_utils.set_spmd_backend(config.parallelism.spmd_backend)
    model_config = spec.model
    model_config.update_from_config(config=config)
    if config.override.imports:
        apply_overrides(config.override, config)
    with torch.device("meta"), utils.set_default_dtype(TORCH_DTYPE_MAP[config.training.dtype]):
        model = model_config.build()
    loss_fn = config.loss.build(compile_config=config.compile)
    with tempfile.TemporaryDirectory() as tmp:
        model = spec.parallelize_fn(model, parallel_dims=parallel_dims, training=config.training,
                                    parallelism=config.parallelism, compile_config=config.compile,
                                    ac_config=None, dump_folder=tmp)
    if device == "cpu":
        for mod in model.modules():   # gloo has no PREMUL_SUM: a plain SUM (torchtitan's factor is 1.0)
            if isinstance(mod, FSDPModule):
                mod.set_force_sum_reduction_for_comms(True)
    model.to_empty(device=device)
    torch.manual_seed(1234)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()
    if device == "cpu":   # FlexAttention has no CPU backward: train the final norm and the head
        for name, prm in model.named_parameters():
            if not name.startswith(("norm.", "lm_head.")):
                prm.requires_grad_(False)
    if isinstance(loss_fn, ChunkedLossWrapper):   # the trainer's wiring
        loss_fn.set_lm_head(model.lm_head)
        model._skip_lm_head = True
    optimizers = config.optimizer.build(model_parts=[model])
    return types.SimpleNamespace(
        config=config, model_config=model_config, model_parts=[model], parallel_dims=parallel_dims,
        loss_fn=loss_fn, ntokens_seen=0, optimizers=optimizers, device=torch.device(device),
        train_context=dist_utils.get_spmd_context(parallel_dims=parallel_dims, spmd_typechecking=False))


def titan_step(tr, tokens, labels, gvt):
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.trainer import Trainer

    tr.optimizers.zero_grad()
    positions = torch.arange(tokens.shape[1], device=tokens.device).expand(tokens.shape[0], -1).contiguous()
    inputs, labels, extra = Trainer.post_dataloading_process(tr, {"input": tokens, "positions": positions}, labels)
    loss = Trainer._forward_backward_body(tr, inputs, labels, gvt, extra)
    dist_utils.clip_grad_norm_([p for p in tr.model_parts[0].parameters()], tr.config.training.max_norm,
                               foreach=True)
    tr.optimizers.step()
    return loss.detach()


def run_titan(args, rank, world, device):
    import torchtitan

    data_rank = rank // args.tp
    data = [(t.to(device), lab.to(device)) for t, lab in batches(args, data_rank)]
    result, pdims = {}, None
    for kind in args.losses.split(","):
        tr = titan_trainer(args, kind, world, device, pdims)
        pdims = tr.parallel_dims
        result[kind] = measure(args, device, lambda i, tr=tr: _titan_loss_mean(tr, data[i % len(data)], args))
        tr = None
    return {"torchtitan": torchtitan.__version__, "losses": result}


def _titan_loss_mean(tr, batch, args):
    tokens, labels = batch
    gvt = (labels != -100).sum()
    if args.dp > 1:
        gvt = gvt.clone()
        dist.all_reduce(gvt, group=tr.parallel_dims.get_mesh("batch").get_group())
    loss = titan_step(tr, tokens, labels, gvt)      # this rank's sum / global count
    if args.dp > 1:
        dist.all_reduce(loss, group=tr.parallel_dims.get_mesh("batch").get_group())
    return loss


# ---- plain PyTorch (torchtitan unavailable) --------------------------------------------

class _Block(torch.nn.Module):
    def __init__(self, dim, heads, hidden):
        super().__init__()
        self.n1, self.n2 = torch.nn.RMSNorm(dim), torch.nn.RMSNorm(dim)
        self.qkv = torch.nn.Linear(dim, 3 * dim, bias=False)
        self.o = torch.nn.Linear(dim, dim, bias=False)
        self.w13 = torch.nn.Linear(dim, 2 * hidden, bias=False)
        self.w2 = torch.nn.Linear(hidden, dim, bias=False)
        self.heads = heads

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(self.n1(x)).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, s, d))
        g, u = self.w13(self.n2(x)).chunk(2, -1)
        return x + self.w2(torch.nn.functional.silu(g) * u)


class _Llama(torch.nn.Module):
    def __init__(self, vocab, dim=256, layers=6, heads=16, hidden=768):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, dim)
        self.layers = torch.nn.ModuleList(_Block(dim, heads, hidden) for _ in range(layers))
        self.norm = torch.nn.RMSNorm(dim)
        self.head = torch.nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens):
        h = self.emb(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.norm(h)


def run_plain(args, rank, world, device, why):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method
    from torch.distributed.tensor import DTensor, Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, loss_parallel, parallelize_module

    import logitless

    data = [(t.to(device), lab.to(device)) for t, lab in batches(args, rank // args.tp)]
    result = {}
    for kind in args.losses.split(","):
        if kind == "chunked":
            continue
        torch.manual_seed(1234)
        model = _Llama(args.vocab, layers=args.layers or 6).to(device)
        head = model.head
        if args.tp > 1:
            mesh = init_device_mesh(device, (args.tp,), mesh_dim_names=("tp",))
            parallelize_module(head, mesh, ColwiseParallel(use_local_output=False))

        def head_loss(self, h, labels):
            if kind == "logitless":
                w = self.weight
                if args.tp > 1:
                    h = DTensor.from_local(h, w.device_mesh, [Replicate()])
                return logitless.linear_cross_entropy(h, w, labels, reduction="sum")
            logits = self(h)
            return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum")

        head.loss = types.MethodType(head_loss, head)
        if args.dp > 1:
            mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            for layer in model.layers:
                fully_shard(layer, mp_policy=mp)
            fully_shard([model.norm, head], mp_policy=mp, reshard_after_forward=False)
            if kind == "logitless":   # the head's weight unsharded around the loss (docs/torch.md)
                register_fsdp_forward_method(head, "loss")
            fully_shard(model, mp_policy=mp)
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, fused=device == "cuda")

        def step(i, model=model, opt=opt, head=head, kind=kind):
            tokens, labels = data[i % len(data)]
            opt.zero_grad(set_to_none=True)
            ctx = loss_parallel() if args.tp > 1 and kind != "logitless" else contextlib.nullcontext()
            with ctx, torch.autocast(device, torch.bfloat16, enabled=args.dp == 1):
                loss = head.loss(model(tokens), labels) / labels.numel()
                loss.backward()
            if isinstance(loss, DTensor):
                loss = loss.full_tensor()
            torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if not isinstance(p, DTensor)]
                                           if args.tp > 1 else model.parameters(), 1.0)
            opt.step()
            loss = loss.detach().float()
            if args.dp > 1:
                loss = loss / args.dp
                dist.all_reduce(loss)
            return loss

        result[kind] = measure(args, device, step)
        model = opt = None
    return {"torchtitan": f"unavailable: {why}", "losses": result}


# ---- timing ---------------------------------------------------------------------------

def measure(args, device, step):
    curve, times = [], []
    for i in range(args.steps):
        if i == args.warmup and device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        sync(device)
        t0 = time.perf_counter()
        loss = step(i)
        sync(device)
        times.append(time.perf_counter() - t0)
        curve.append(float(loss))
    timed = times[args.warmup:] or times
    return {"loss_curve": curve, "median_step_s": statistics.median(timed),
            "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None}


def main():
    args = parse()
    rank, world = init_dist(args.device)
    if args.dp * args.tp != world:
        raise SystemExit(f"--dp {args.dp} x --tp {args.tp} must equal the world size {world}")
    why = None
    if args.impl != "plain":
        try:
            import torchtitan.trainer  # noqa: F401

            import logitless.integrations.torchtitan  # noqa: F401
        except Exception as e:   # torchtitan missing, or written against a newer torch
            if args.impl == "torchtitan":
                raise
            why = f"{type(e).__name__}: {e}"
    else:
        why = "--impl plain"
    out = run_titan(args, rank, world, args.device) if why is None else run_plain(args, rank, world,
                                                                                     args.device, why)
    mode = "1gpu" if world == 1 else (f"fsdp{args.dp}" if args.tp == 1 else f"tp{args.tp}")
    losses = out["losses"]
    if "titan" in losses and "logitless" in losses:
        a, b = losses["titan"]["loss_curve"], losses["logitless"]["loss_curve"]
        out["max_abs_loss_diff"] = max(abs(x - y) for x, y in zip(a, b))
        out["loss_drop_titan"] = a[0] - a[-1]
    out.update(mode=mode, world=world, args=vars(args), torch=torch.__version__, python=platform.python_version(),
               device=torch.cuda.get_device_name() if args.device == "cuda" else "cpu")
    if rank == 0:
        d = os.environ.get("OUT", "./out")
        os.makedirs(d, exist_ok=True)
        impl = "torchtitan" if why is None else "plain"
        path = os.path.join(d, f"torchtitan_steps-{impl}-{mode}-{args.device}.json")
        with open(path, "w") as f:
            json.dump(out, f, indent=1)
        for k, v in losses.items():
            print(f"{mode} {k:10s} loss {v['loss_curve'][0]:.4f} -> {v['loss_curve'][-1]:.4f}  "
                  f"median step {v['median_step_s'] * 1e3:.1f} ms  peak {v['peak_mem_gib']} GiB")
        print("wrote", path)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
