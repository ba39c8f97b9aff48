"""FP8 head (issue 39, item 3): can an FP8 LM head meet the targets? Two measurements.

(a) Accuracy (CPU: small shapes; GPU: 1024 x 4096 x 32003 and, one seed, 8192 x 4096 x
128256). From bf16 inputs x
(N, H) and W (V, H), the mean cross-entropy and its gradients dX, dW in float64 are the
reference; against it: torch bf16 (bf16 logits, F.cross_entropy on them in fp32, autograd's
bf16 backward), logitless' bf16 op, and FP8 emulations. An emulation quantises each GEMM's
operands exactly as a kernel would (``quantise``: amax per block / the format's max, the
cast by ``torch.float8_*``; blocks along the contraction dimension), dequantises them and
multiplies in fp32 (exact products, fp32 sums: the best case of a kernel that promotes its
partial sums to fp32, as DeepGEMM does every 128; cuBLAS' fast accumulation only adds error):

- ``block``: x in 1 x 128 tiles (per token), W in 128 x 128 blocks (the same blocks serve the
  forward and dX = dZ W), dZ = g (softmax - onehot) in 1 x 128 tiles along V for dX and in
  128 x 1 tiles along the tokens for dW = dZ^T X (X then in 128 x 1 tiles too);
- ``row``: one scale per row of each operand along the whole contraction dimension
  (torch._scaled_mm's rowwise recipe);
- dZ in e4m3 or e5m2 (the forward's operands always e4m3); ``pow2``: scales rounded up to
  powers of two (MX-style); ``fp8-backward-only``: the forward exact (the bf16 op's loss),
  only dX and dW from FP8 operands.

Data: ``random`` (x ~ N(0, 1) like an RMS-normed hidden state, W ~ N(0, 1/H), uniform
targets); ``peaked`` (16 rows of W scaled by 8, so a few tokens dominate; targets sampled
from the model's own softmax); ``aligned`` (trained-LM-like: each x has a component along
its target's row, z_target ~ log V, loss ~ 1). Reported per case: |loss - ref|, the RMS of
the per-token loss errors, and relative gradient errors ||d - ref|| / ||ref|| (``rms``) and
max |d - ref| / max |ref| (``max``), each the mean over seeds.

(b) Ceiling (GPU): torch._scaled_mm (e4m3; rowwise, rowwise with fast accumulation, and
blockwise 1x128 / 128x128 where this torch and cuBLAS take it on the device) for the head's
three GEMMs (logits x W^T, dX = dZ W, dW = dZ^T X in the layouts cuBLAS needs on sm90) at
8192 x 4096 x 128256 and 16384 x 4096 x 151936 against bf16 torch.matmul, the quantisation
passes (eager torch, and their bytes at the measured copy bandwidth: the floor of a fused
pass), logitless' bf16 op forward+backward, and the predicted FP8 f+b / bf16 op; and
torch._scaled_mm's output against the emulation's (``emulation_check``).

    python benchmarks/probe_fp8.py --out $OUT          # H100: (a) + (b), ~1.5 min
    python benchmarks/probe_fp8.py --out $OUT --only ceiling   # (b) alone
    python benchmarks/probe_fp8.py --cpu --out /tmp/fp8  # accuracy only, small shapes (~6 min, 2 cores)

Writes ``fp8-probe.json`` to --out.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _probe_common import probe_meta, write_json  # noqa: E402

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2

#: Block shapes (rows, columns) of each GEMM operand in its stored (N, H), (V, H), (N, V)
#: layout; -1 spans the whole dimension. Blocks run along the contraction dimension.
RECIPES = {
    "block": dict(x_fwd=(1, 128), w_fwd=(128, 128), dz_dx=(1, 128), w_dx=(128, 128), dz_dw=(128, 1), x_dw=(128, 1)),
    "row": dict(x_fwd=(1, -1), w_fwd=(1, -1), dz_dx=(1, -1), w_dx=(-1, 1), dz_dw=(-1, 1), x_dw=(-1, 1)),
}
#: The emulated variants: (recipe, dZ format, power-of-two scales, forward in FP8). The last
#: keeps the forward exact (the bf16 op's fp32 logits: its loss) and runs only the backward's
#: GEMMs (dX, dW) in FP8.
VARIANTS = {
    "fp8-block-e4m3": ("block", E4M3, False, True),
    "fp8-block-dz-e5m2": ("block", E5M2, False, True),
    "fp8-block-pow2": ("block", E4M3, True, True),
    "fp8-row-e4m3": ("row", E4M3, False, True),
    "fp8-row-dz-e5m2": ("row", E5M2, False, True),
    "fp8-backward-only": ("block", E4M3, False, False),
}
ANCHORS = {"8192x4096x128256": (8192, 4096, 128256), "16384x4096x151936": (16384, 4096, 151936)}


# --------------------------------------------------------------------------- quantisation
def _block(shape, block):
    return tuple(s if b in (-1, None) else b for s, b in zip(shape, block))


def quantise(t: torch.Tensor, block, fmt=E4M3, pow2: bool = False):
    """(q, scales): q = t / scale in ``fmt`` (same shape as t), one fp32 scale per block of
    ``block`` = (rows, columns) (-1: the whole dimension; ragged edge blocks allowed), scale =
    amax(|block|) / fmt's max (1 for an all-zero block; rounded up to a power of two with
    ``pow2``). Dequantised: q * scale, ``dequantise``."""
    m, k = t.shape
    br, bc = _block(t.shape, block)
    mp, kp = -(-m // br) * br, -(-k // bc) * bc
    tp = F.pad(t.float(), (0, kp - k, 0, mp - m)).view(mp // br, br, kp // bc, bc)  # the one fp32 copy
    fmax = torch.finfo(fmt).max
    amax = torch.maximum(tp.amax(dim=(1, 3)), -tp.amin(dim=(1, 3)))
    scale = torch.where(amax > 0, amax / fmax, torch.ones_like(amax))
    if pow2:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    q = tp.div_(scale[:, None, :, None]).clamp_(-fmax, fmax).to(fmt)
    return q.view(mp, kp)[:m, :k], scale


def dequantise(q: torch.Tensor, scale: torch.Tensor, block) -> torch.Tensor:
    """fp32 q * scale, each block's scale broadcast over it."""
    m, k = q.shape
    br, bc = _block(q.shape, block)
    out = q.float()
    if m % br == 0 and k % bc == 0:
        return out.view(m // br, br, k // bc, bc).mul_(scale[:, None, :, None]).view(m, k)
    return out.mul_(scale.repeat_interleave(br, 0)[:m].repeat_interleave(bc, 1)[:, :k])


def fake_quant(t, block, fmt=E4M3, pow2=False):
    """t rounded through ``fmt`` with per-block scales, back in fp32."""
    return dequantise(*quantise(t, block, fmt, pow2), block)


# --------------------------------------------------------------------------- the head
def head(x, w, t, fq=None, dtype=torch.float64):
    """Mean cross-entropy of x @ w.T and its gradients (loss, per-token losses, dX, dW) in
    ``dtype``. ``fq(name, tensor)`` rounds each GEMM operand (names as in RECIPES), None: none."""
    fq = fq or (lambda name, a: a)
    n = x.shape[0]
    x, w = x.to(dtype), w.to(dtype)
    z = fq("x_fwd", x) @ fq("w_fwd", w).T
    lse = torch.logsumexp(z, dim=1)
    per_token = lse - z.gather(1, t[:, None])[:, 0]
    dz = torch.exp(z - lse[:, None])
    del z
    dz[torch.arange(n, device=x.device), t] -= 1
    dz /= n
    dx = fq("dz_dx", dz) @ fq("w_dx", w)
    dw = fq("dz_dw", dz).T @ fq("x_dw", x)
    return per_token.mean(), per_token, dx, dw


def fp8_head(x, w, t, recipe="block", dz_fmt=E4M3, pow2=False, forward=True):
    """The emulated FP8 head: operands fake-quantised per RECIPES[recipe], fp32 GEMMs
    (``forward=False``: the forward's operands left as they are)."""
    blocks = RECIPES[recipe]

    def fq(name, a):
        if not forward and name.endswith("fwd"):
            return a.float()
        return fake_quant(a, blocks[name], dz_fmt if name.startswith("dz") else E4M3, pow2)
    return head(x, w, t, fq, torch.float32)


def torch_bf16_head(x, w, t):
    """What torch computes: bf16 logits, F.cross_entropy on them in fp32, autograd's backward."""
    xb, wb = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    z = xb @ wb.T
    per_token = F.cross_entropy(z.float(), t, reduction="none")
    loss = per_token.mean()
    loss.backward()
    return loss.detach(), per_token.detach(), xb.grad, wb.grad


def logitless_head(x, w, t):
    """logitless.linear_cross_entropy (bf16 in, fp32 logits statistics)."""
    import logitless

    xb, wb = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    loss = logitless.linear_cross_entropy(xb, wb, t)
    loss.backward()
    with torch.no_grad():  # its per-token losses
        per_token = logitless.linear_cross_entropy(x, w, t, reduction="none")
    return loss.detach(), per_token, xb.grad, wb.grad


def make_data(kind, n, h, v, seed, device="cpu"):
    """bf16 (x, w, targets) of ``kind`` (random, peaked, aligned: see the module docstring)."""
    g = torch.Generator(device=device).manual_seed(seed)
    w = torch.randn(v, h, generator=g, device=device) / math.sqrt(h)
    x = torch.randn(n, h, generator=g, device=device)
    if kind == "peaked":
        rows = torch.randperm(v, generator=g, device=device)[:16]
        w[rows] *= 8
        xb, wb = x.bfloat16(), w.bfloat16()
        probs = torch.softmax(xb.double() @ wb.double().T, dim=1)
        t = torch.multinomial(probs, 1, generator=g)[:, 0]
        del probs
        return xb, wb, t
    t = torch.randint(0, v, (n,), generator=g, device=device)
    if kind == "aligned":
        c = math.log(v) / math.sqrt(h)
        wt = w[t] / w[t].norm(dim=1, keepdim=True)
        x = math.sqrt(1 - c * c) * x + c * math.sqrt(h) * wt
    elif kind != "random":
        raise ValueError(f"unknown data kind {kind!r}: random, peaked or aligned")
    return x.bfloat16(), w.bfloat16(), t


def errors(got, ref):
    """|loss - ref|, per-token loss RMS error, dX and dW relative errors (rms, max)."""
    loss, per_token, dx, dw = (a.double() for a in got)
    rloss, rper, rdx, rdw = ref

    def rel(a, r):
        d = (a - r)
        return dict(rms=(d.norm() / r.norm()).item(), max=(d.abs().max() / r.abs().max()).item())
    return dict(loss=abs(loss - rloss).item(), token_rms=(per_token - rper).pow(2).mean().sqrt().item(),
                dx=rel(dx, rdx), dw=rel(dw, rdw))


def accuracy_case(kind, n, h, v, seeds, device, methods=None):
    """{method: errors averaged over seeds} and the reference loss, for one data kind and shape."""
    methods = methods or ["torch-bf16", "logitless-bf16", *VARIANTS]
    runs = {m: [] for m in methods}
    ref_losses = []
    for seed in seeds:
        x, w, t = make_data(kind, n, h, v, seed, device)
        ref = head(x, w, t)
        ref_losses.append(ref[0].item())
        for m in methods:
            if m == "torch-bf16":
                got = torch_bf16_head(x, w, t)
            elif m == "logitless-bf16":
                got = logitless_head(x, w, t)
            else:
                got = fp8_head(x, w, t, *VARIANTS[m])
            runs[m].append(errors(got, ref))
            del got
        del ref, x, w, t
    mean = statistics.fmean
    out = {m: dict(loss=mean(r["loss"] for r in rs), token_rms=mean(r["token_rms"] for r in rs),
                   dx=dict(rms=mean(r["dx"]["rms"] for r in rs), max=mean(r["dx"]["max"] for r in rs)),
                   dw=dict(rms=mean(r["dw"]["rms"] for r in rs), max=mean(r["dw"]["max"] for r in rs)))
           for m, rs in runs.items()}
    return dict(kind=kind, shape=[n, h, v], seeds=list(seeds), ref_loss=mean(ref_losses), errors=out,
                verdict=verdict(out))


def verdict(errs):
    """Per FP8 variant: loss error and per-token loss error / torch bf16's (<= 1: the target met)."""
    base = errs["torch-bf16"]
    return {m: dict(loss_ratio=e["loss"] / max(base["loss"], 1e-300),
                    token_ratio=e["token_rms"] / max(base["token_rms"], 1e-300))
            for m, e in errs.items() if m.startswith("fp8")}


# --------------------------------------------------------------------------- GPU timing
def _cuda_time(fn, reps, warmup=2):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def _sm90_operands(n, h, v, dev):
    """The head's three GEMMs as (name, a, b, b's block recipe): a row-major (M, K), b
    column-major (K, N'), as cuBLAS' FP8 GEMM needs them on sm90; bf16 here. W (the b of the
    logits and of dX) takes 128 x 128 blocks, X (the b of dW) 1 x 128 tiles along the tokens."""
    x = torch.randn(n, h, device=dev, dtype=torch.bfloat16)
    w = (torch.randn(v, h, device=dev, dtype=torch.bfloat16) / math.sqrt(h))
    dz = torch.randn(n, v, device=dev, dtype=torch.bfloat16) * 1e-4
    return [("logits", x, w.T, (128, 128)),                         # (N, H) x (H, V)
            ("dx", dz, w.T.contiguous().T, (128, 128)),             # (N, V) x (V, H): W^T stored
            ("dw", dz.T.contiguous(), x.T.contiguous().T, (1, 128))]  # (V, N) x (N, H): dZ^T, X^T stored


def _scaled_operands(a, b, recipe, b_block=(128, 128)):
    """fp8 a, b and their scales in the layouts torch._scaled_mm takes (a: (M, K) row-major,
    b: (K, N) column-major): ``row`` (one scale per row of a, per column of b) or ``block``
    (a in 1 x 128 tiles, b in ``b_block``: 128 x 128 or 1 x 128 along K)."""
    if recipe == "row":
        qa, sa = quantise(a, (1, -1))
        qbt, sbt = quantise(b.T, (1, -1))        # b^T's rows are b's columns
        return qa, sa.contiguous(), qbt.T, sbt.T.contiguous()
    qa, sa = quantise(a, (1, 128))              # scale_a (M, K/128), outer-dim-major
    sa = sa.T.contiguous().T
    qbt, sbt = quantise(b.T, b_block)
    if b_block == (128, 128):                   # scale_b (K/128, N/128): the .T of a row-major one
        return qa, sa, qbt.T, sbt.T
    return qa, sa, qbt.T, sbt.T.contiguous()    # 1 x 128: scale_b (K/128, N) row-major


def _time_scaled_mm(a, b, recipe, fast, b_block, reps):
    """(ms or None, what was timed, errors) of torch._scaled_mm on a @ b quantised per recipe.
    Where this torch/cuBLAS refuses a blockwise layout, the same GEMM is timed with K
    zero-padded to a multiple of 512 (16-byte aligned scale rows: K = V = 128256 gives 1002
    scales a row), then, for dW, with 128 x 128 blocks on X."""
    tries = [(b_block, 0)]
    if recipe == "block":
        kp = -a.shape[1] % 512
        tries += [(b_block, kp)] * (kp > 0)
        if b_block != (128, 128):
            tries += [((128, 128), 0)] + [((128, 128), kp)] * (kp > 0)
    errors = []
    for bb, kp in tries:
        ops = None
        try:
            ops = _scaled_operands(F.pad(a, (0, kp)) if kp else a, F.pad(b.T, (0, kp)).T if kp else b, recipe, bb)
            fn = lambda: torch._scaled_mm(ops[0], ops[2], ops[1], ops[3],  # noqa: E731
                                          out_dtype=torch.bfloat16, use_fast_accum=fast)
            fn()
            return _cuda_time(fn, reps), dict(b_block=list(bb), k_padded_by=kp), errors
        except Exception as exc:  # a layout this torch/cuBLAS does not take: say which
            errors.append(f"b_block={list(bb)} k_padded_by={kp}: {type(exc).__name__}: {str(exc)[:300]}")
        finally:
            del ops
    return None, None, errors


def gemm_ceiling(n, h, v, dev, reps):
    """bf16 matmul and torch._scaled_mm (row, row + fast accumulation, block) per GEMM, in ms;
    ``*_errors``: the layouts refused on the way (``fp8_block_timed``: what was timed)."""
    rows = []
    for name, a, b, b_block in _sm90_operands(n, h, v, dev):
        row = dict(gemm=name, m=a.shape[0], k=a.shape[1], n=b.shape[1])
        row["bf16_ms"] = _cuda_time(lambda: torch.mm(a, b), reps)
        for label, recipe, fast in (("fp8_row", "row", False), ("fp8_row_fast", "row", True),
                                    ("fp8_block", "block", False)):
            ms, timed, errors = _time_scaled_mm(a, b, recipe, fast, b_block, reps)
            row[f"{label}_ms"] = ms
            if recipe == "block":
                row["fp8_block_timed"] = timed
            if errors:
                row[f"{label}_errors"] = errors
        for recipe in ("row", "block"):
            ms = row.get(f"fp8_{recipe}_ms")
            row[f"fp8_{recipe}_speedup"] = row["bf16_ms"] / ms if ms else None
        rows.append(row)
        del a, b
        torch.cuda.empty_cache()
    return rows


#: The shape at which torch._scaled_mm is compared with the emulation.
EMULATION_SHAPE = (1024, 4096, 8192)


def emulation_check(dev):
    """torch._scaled_mm (block, row) against the emulation (fp32 GEMM of dequantised operands)."""
    n, h, v = EMULATION_SHAPE
    x = torch.randn(n, h, device=dev).bfloat16()
    w = (torch.randn(v, h, device=dev) / math.sqrt(h)).bfloat16()
    emu = {"row": fake_quant(x, (1, -1)) @ fake_quant(w, (1, -1)).T,
           "block": fake_quant(x, (1, 128)) @ fake_quant(w, (128, 128)).T}
    out = {}
    for recipe, ref in emu.items():
        try:
            qa, sa, qb, sb = _scaled_operands(x, w.T, recipe)
            try:
                got, out_dtype = torch._scaled_mm(qa, qb, sa, sb, out_dtype=torch.float32), "float32"
            except Exception:  # fp32 output not taken with this recipe: bf16 (its rounding included)
                got, out_dtype = torch._scaled_mm(qa, qb, sa, sb, out_dtype=torch.bfloat16).float(), "bfloat16"
            out[recipe] = dict(out_dtype=out_dtype, max_abs_diff=(got - ref).abs().max().item(),
                               ref_max=ref.abs().max().item())
        except Exception as exc:
            out[recipe] = dict(error=f"{type(exc).__name__}: {str(exc)[:300]}")
    return out


def quant_passes(n, h, v, dev, reps, chunk=4096):
    """Eager torch times of the quantisation passes, with their bytes at copy bandwidth."""
    buf = torch.empty(min(1 << 29, v * h), device=dev, dtype=torch.bfloat16)
    copy_ms = _cuda_time(lambda: buf.clone(), reps)
    bw = 2 * buf.numel() * 2 / (copy_ms * 1e-3)   # bytes/s, read + write
    del buf
    x = torch.randn(n, h, device=dev, dtype=torch.bfloat16)
    w = torch.randn(v, h, device=dev, dtype=torch.bfloat16)
    dz = torch.randn(n, chunk, device=dev, dtype=torch.bfloat16)
    # (name, fn, bytes moved by a fused pass (read bf16, write fp8 per layout), times per call)
    passes = [("x 1x128 + 128x1", lambda: (quantise(x, (1, 128)), quantise(x.T, (1, 128))), n * h * 4, 1),
              ("W 128x128 (+ its transpose)", lambda: quantise(w, (128, 128)), v * h * 4, 1),
              (f"dZ chunk (N, {chunk}) 1x128 + 128x1", lambda: (quantise(dz, (1, 128)), quantise(dz.T, (1, 128))),
               n * chunk * 4, v / chunk)]
    rows = []
    for name, fn, nbytes, times in passes:
        ms = _cuda_time(fn, max(3, reps // 2), warmup=1)
        rows.append(dict(name=name, eager_ms=ms * times, floor_ms=nbytes * times / bw * 1e3, per_call=times))
    return dict(copy_bandwidth_GBps=bw / 1e9, passes=rows)


def bf16_op(n, h, v, dev, reps):
    """logitless.linear_cross_entropy (default plan and budget): (forward, forward+backward) in ms."""
    import logitless

    x = torch.randn(n, h, device=dev, dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(v, h, device=dev) / math.sqrt(h)).bfloat16().requires_grad_()
    t = torch.randint(0, v, (n,), device=dev)

    def fb():
        x.grad = w.grad = None
        logitless.linear_cross_entropy(x, w, t).backward()

    def fwd():
        with torch.no_grad():
            logitless.linear_cross_entropy(x, w, t)
    return _cuda_time(fwd, reps), _cuda_time(fb, reps)


def predicted(gemms, quant_floor_ms, op_fwd_ms, op_fb_ms):
    """FP8 f+b from the measured GEMMs (per recipe): three GEMMs (logits kept or fused), four
    (logits recomputed), and the backward-only hybrid (the bf16 op's forward, then recompute,
    dX and dW in FP8); each plus the quantisation passes at copy bandwidth, and / the bf16 op."""
    out = {}
    for recipe in ("block", "row"):
        times = [g.get(f"fp8_{recipe}_ms") for g in gemms]
        if not all(times):
            continue
        three = sum(times) + quant_floor_ms
        plans = dict(three_gemms=three, four_gemms=three + times[0], backward_only=op_fwd_ms + three)
        out[recipe] = {k: dict(ms=ms, vs_bf16_op=ms / op_fb_ms) for k, ms in plans.items()}
    return out


def ceiling_row(name, n, h, v, dev, reps, **quant_kw):
    """One anchor's GEMMs, quantisation passes, bf16 op and predicted FP8 f+b."""
    gemms = gemm_ceiling(n, h, v, dev, reps)
    quant = quant_passes(n, h, v, dev, reps, **quant_kw)
    op_fwd, op_fb = bf16_op(n, h, v, dev, max(3, reps // 2))
    floor = sum(p["floor_ms"] for p in quant["passes"])
    return dict(shape=name, gemms=gemms, quant=quant, bf16_op_fwd_ms=op_fwd, bf16_op_fb_ms=op_fb,
                predicted=predicted(gemms, floor, op_fwd, op_fb))


#: The methods of the accuracy rows at the anchor (the GPU run's time).
ANCHOR_METHODS = ["torch-bf16", "logitless-bf16", "fp8-block-e4m3", "fp8-row-e4m3", "fp8-backward-only"]
#: The GPU's accuracy cases: (shape, every seed or one, methods (None: all)).
GPU_ACCURACY = [((1024, 4096, 32003), True, None), ((8192, 4096, 128256), False, ANCHOR_METHODS)]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--cpu", action="store_true", help="accuracy only, small shapes (no GPU needed)")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--only", choices=["accuracy", "ceiling"], help="one of the two parts (GPU)")
    ap.add_argument("--cpu-shapes", default="512,1024,8191;256,4096,2053", help="N,H,V;... for the CPU accuracy")
    args = ap.parse_args(argv)
    gpu = torch.cuda.is_available() and not args.cpu
    dev = "cuda" if gpu else "cpu"
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False        # the emulation's fp32 GEMMs stay fp32
    try:
        _run(args, gpu, dev)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32


def _run(args, gpu, dev):
    out = dict(meta=probe_meta(), accuracy=[], ceiling=[])
    path = os.path.join(args.out, "fp8-probe.json")
    t0 = time.time()
    if args.only == "ceiling":
        cases = []
    elif gpu:
        cases = [(shape, range(args.seeds if all_seeds else 1), methods) for shape, all_seeds, methods in GPU_ACCURACY]
    else:
        cases = [(tuple(int(s) for s in sh.split(",")), range(args.seeds), None) for sh in args.cpu_shapes.split(";")]
    for shape, seeds, methods in cases:
        for kind in ("random", "peaked", "aligned"):
            out["accuracy"].append(accuracy_case(kind, *shape, seeds, dev, methods))
            print(kind, shape, {m: round(r["loss_ratio"], 1) for m, r in out["accuracy"][-1]["verdict"].items()},
                  f"{time.time() - t0:.0f}s", flush=True)
            write_json(path, out)
            if gpu:
                torch.cuda.empty_cache()
    if gpu and args.only != "accuracy":
        out["emulation_check"] = emulation_check(dev)
        for name, (n, h, v) in ANCHORS.items():
            row = ceiling_row(name, n, h, v, dev, args.reps)
            out["ceiling"].append(row)
            print(name, dict(op_fb_ms=round(row["bf16_op_fb_ms"], 2), **{f"{r}/{k}": round(p["vs_bf16_op"], 3)
                  for r, d in row["predicted"].items() for k, p in d.items()}), f"{time.time() - t0:.0f}s", flush=True)
            write_json(path, out)
            torch.cuda.empty_cache()
    out["wall_s"] = time.time() - t0
    write_json(path, out)
    print("wrote", path)


if __name__ == "__main__":
    main()
