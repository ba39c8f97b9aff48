"""TRL distillation loss step, TRL's own against ``logitless.integrations.trl.patch_gkd``.

    PYTHONPATH=src python benchmarks/trl_gkd_bench.py --out DIR [--smoke] [--beta 0.5]

For GKDTrainer (trl.experimental.gkd: full logits of both models) and DistillationTrainer
(TRL's chunked hidden-state loss), one loss step = the trainer's loss function + backward
on fixed synthetic inputs, student Llama (hidden 2048) and teacher Llama (hidden 4096), 2
decoder layers each (the LM head is what differs), vocab 128256, bf16, batch 4 x 1024
tokens, the first half of each row prompt (-100 / masked). Reports ms per step (median of
reps), peak memory above the resident weights+inputs, the loss, and for GKD the loss of an
fp32 reference (TRL's generalized_jsd_loss on fp32 logits of the same bf16 hidden states).
``--smoke``: tiny sizes on the CPU (checks the script, numbers meaningless).
Writes trl_gkd.json and trl_gkd.md to --out.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
import warnings

import torch

warnings.filterwarnings("ignore")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")


def tokenizer(padding_side):
    import tokenizers
    import transformers
    vocab = {"<pad>": 0, "<unk>": 1, "<eos>": 2, **{f"w{i}": i + 3 for i in range(20)}}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    out = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>",
                                               eos_token="<eos>", padding_side=padding_side)
    out.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    return out


def llama(seed, hidden, vocab, layers, dtype, device):
    import transformers
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                                   num_hidden_layers=layers, num_attention_heads=max(hidden // 128, 2),
                                   num_key_value_heads=max(hidden // 512, 1), max_position_embeddings=4096,
                                   pad_token_id=0, eos_token_id=2, bos_token_id=2)
    with torch.device(device):  # initialised on the GPU: fast
        return transformers.LlamaForCausalLM(cfg).to(dtype=dtype)


def measure(fn, params, device, reps):
    """ms per call of fn() + backward (median), peak bytes above the memory before."""
    def once():
        loss = fn()
        loss.backward()
        for p in params:
            p.grad = None
        return loss.detach()

    once()
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    times, loss = [], None
    for _ in range(reps):
        t0 = time.perf_counter()
        loss = once()
        if cuda:
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    peak = (torch.cuda.max_memory_allocated() - base) if cuda else None
    return statistics.median(times), peak, float(loss)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/out"))
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--only", default="gkd,distillation")
    ap.add_argument("--beta", type=float, default=0.5,
                    help="both trainers' beta (0 / 1: the KL limits, whose bf16 forward may take the fused kernel)")
    a = ap.parse_args()
    import transformers
    import trl
    from trl import DistillationConfig, DistillationTrainer
    from trl.experimental.gkd import GKDConfig, GKDTrainer

    import logitless.integrations.trl as lt_trl

    device = torch.device("cuda" if torch.cuda.is_available() and not a.smoke else "cpu")
    if a.smoke:
        b, length, hs, ht, vocab, layers, dtype, reps = 2, 16, 32, 48, 101, 1, torch.float32, 2
    else:
        b, length, hs, ht, vocab, layers, dtype, reps = 4, 1024, 2048, 4096, 128256, 2, torch.bfloat16, a.reps
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (b, length), generator=g).to(device)
    mask = torch.ones_like(ids)
    half = length // 2
    labels = ids.clone()
    labels[:, :half] = -100
    completion_mask = mask[:, half:].clone()
    completion_mask[0, -length // 8:] = 0  # one row ends early
    rows, tmp = [], tempfile.mkdtemp()
    common = dict(per_device_train_batch_size=b, report_to="none", save_strategy="no", use_cpu=device.type == "cpu",
                  bf16=False, fp16=False, seed=0, dataloader_num_workers=0)
    import datasets
    chat = datasets.Dataset.from_list([{"messages": [{"role": "user", "content": "w1"},
                                                     {"role": "assistant", "content": "w2"}]}] * 4)
    prompts = datasets.Dataset.from_list([{"prompt": "w1 w2"}] * 4)

    def row(trainer_name, impl, ms, peak, loss, **extra):
        r = dict(trainer=trainer_name, impl=impl, ms=round(ms, 2),
                 peak_mib=None if peak is None else round(peak / 2**20), loss=loss, **extra)
        rows.append(r)
        print(json.dumps(r), flush=True)

    # one student and one teacher for every case (the patches leave other calls unchanged)
    student, teacher = llama(1, hs, vocab, layers, dtype, device), llama(2, ht, vocab, layers, dtype, device)
    if "gkd" in a.only:
        for patched in (False, True):
            try:
                args = GKDConfig(output_dir=f"{tmp}/gkd", lmbda=0.0, beta=a.beta, **common)
                tr = GKDTrainer(model=student, teacher_model=teacher, args=args, train_dataset=chat,
                                processing_class=tokenizer("right"))
                if patched:
                    lt_trl.patch_gkd(tr)
                inputs = {"input_ids": ids, "attention_mask": mask, "labels": labels}
                ms, peak, loss = measure(lambda: tr.compute_loss(tr.model, inputs), list(tr.model.parameters()),
                                         device, reps)
                extra = {}
                if not patched:  # fp32 reference on the same bf16 hidden states
                    with torch.no_grad():
                        h_s = student.model(input_ids=ids, attention_mask=mask).last_hidden_state[:, :-1]
                        h_t = teacher.model(input_ids=ids, attention_mask=mask).last_hidden_state[:, :-1]
                        zs = h_s.float() @ student.lm_head.weight.float().T
                        zt = h_t.float() @ teacher.lm_head.weight.float().T
                        extra["ref_fp32"] = float(GKDTrainer.generalized_jsd_loss(zs, zt, labels[:, 1:], beta=a.beta))
                        del zs, zt
                row("GKDTrainer", "logitless" if patched else "trl", ms, peak, loss, **extra)
                del tr
            except Exception as exc:  # noqa: BLE001 - a failing case must not stop the others
                row("GKDTrainer", "logitless" if patched else "trl", float("nan"), None, None,
                    error=f"{type(exc).__name__}: {exc}"[:300])
            if device.type == "cuda":
                torch.cuda.empty_cache()
    if "distillation" in a.only:
        for patched in (False, True):
            try:
                args = DistillationConfig(output_dir=f"{tmp}/dist", beta=a.beta, temperature=1.0,
                                          max_completion_length=length - half, **common)
                tr = DistillationTrainer(model=student, teacher_model=teacher, args=args, train_dataset=prompts,
                                         processing_class=tokenizer("left"))
                if patched:
                    lt_trl.patch_gkd(tr)
                inputs = {"prompt_ids": ids[:, :half], "prompt_mask": mask[:, :half], "completion_ids": ids[:, half:],
                          "completion_mask": completion_mask}
                unwrapped = tr.accelerator.unwrap_model(tr.model)
                ms, peak, loss = measure(lambda: tr._compute_loss(unwrapped, inputs, None)[0],
                                         list(tr.model.parameters()), device, reps)
                row("DistillationTrainer", "logitless" if patched else "trl", ms, peak, loss)
                del tr, unwrapped
            except Exception as exc:  # noqa: BLE001
                row("DistillationTrainer", "logitless" if patched else "trl", float("nan"), None, None,
                    error=f"{type(exc).__name__}: {exc}"[:300])
            if device.type == "cuda":
                torch.cuda.empty_cache()

    meta = dict(device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu", torch=torch.__version__,
                transformers=transformers.__version__, trl=trl.__version__,
                date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                command=" ".join([os.path.basename(sys.executable)] + sys.argv),
                shape=dict(batch=b, length=length, student_hidden=hs, teacher_hidden=ht, vocab=vocab, layers=layers,
                           dtype=str(dtype), beta=a.beta))
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "trl_gkd.json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    lines = [f"TRL distillation loss step (loss fn + backward), {meta['device']}, {meta['date']}, "
             f"torch {meta['torch']}, trl {meta['trl']}; shape {meta['shape']}", "",
             "| trainer | impl | ms/step | peak MiB | loss | fp32 ref |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['trainer']} | {r['impl']} | {r['ms']} | {r['peak_mib']} | {r['loss']} | "
                     f"{r.get('ref_fp32', r.get('error', ''))} |")
    with open(os.path.join(a.out, "trl_gkd.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
