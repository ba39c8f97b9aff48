"""Cost model of linear_jsd's Triton strategies: predicted time and memory of each
candidate, and the choice (``choose_jsd``; ``jsd_kl_fused_faster`` for the KL limits'
fused forward). Built on the shared device classes and kernel-time terms of
``logitless.planning.cost_model``; called by this op's planner (``planning``).

Strategies of linear_jsd's Triton backend (``planning.linear_jsd_strategy``):

- ``recompute``: forward per chunk of ``token_chunk`` rows, cuBLAS writes both heads'
  fp32 logits (8 R V bytes), the row statistics read them twice; backward per
  4096-column chunk, the fused two-head dz kernel recomputes both tiles, cuBLAS dW and
  dx (fp32 dx accumulator). 6 GEMMs. Memory: max(forward chunk, backward 4 N H_s +
  one dz chunk): the two are never alive together.
- ``grad_in_forward``: the same forward chunks, then (upstream gradient known up to
  grad_output: "mean"/"sum") dz of the chunk from the fp32 logits (one read of both,
  one write in the input dtype), dx rows = dz W_s, dW_s += dz^T x_s (fp32 accumulator
  4 V H_s unless one chunk covers every token or the weight is fp32); backward scales.
  4 GEMMs. Memory beyond the inputs and the gradients returned (as for every plan): the
  chunk's 8 R V + s R V bytes + the accumulator's (4 - s) V H_s beyond the dW it
  becomes; at least 4 V H_s (the backward's cast, dW alive beside it).
- ``keep``: the same forward chunks also write dz of the first ``keep_cols`` columns
  (every token; the upstream gradient up to grad_output, in the input dtype) from the
  fp32 logits; the backward's dW of those columns (from x's rows times grad_output) and
  dx (fp32, then times grad_output) are two cuBLAS GEMMs, the other columns are recomputed
  as ``recompute``'s. With every column kept: 4 GEMMs, no fp32 dW accumulator (dW is one
  GEMM over all tokens). Memory: s N keep_cols + max(forward chunk 8 R V, the backward's
  fp32 dx, scaled x and recomputed chunk).

Candidates are a fixed family per shape (token chunks on powers of two and N), filtered
by memory: the chosen predicted time never rises as the budget grows (tests check it).
"""

from __future__ import annotations

import functools
import math
from dataclasses import replace

from logitless.planning.cost_model import (
    DEFAULT,
    Candidate,
    accumulated_output_bytes,
    backward_fixed_s,
    gemm_rate,
    gemm_s,
    wave_eff,
)


def _jsd_chunk_forward_s(dev, m, hs, ht, v, itemsize, stat_reads) -> float:
    """One forward chunk of m rows: two fp32-output logits GEMMs and the statistics'
    reads (``stat_reads`` passes over both fp32 chunks, split-row kernels at bandwidth)."""
    if dev.jsd_stream_bw is not None:
        dev = replace(dev, hbm_bw=dev.jsd_stream_bw)
    t = gemm_s(dev, m, v, hs, itemsize, out_itemsize=4) + gemm_s(dev, m, v, ht, itemsize, out_itemsize=4)
    return t + stat_reads * 8.0 * m * v / dev.hbm_bw + 3 * dev.launch_s


def jsd_forward_s(dev, n, hs, ht, v, itemsize, token_chunk, stat_reads=2) -> float:
    chunks = math.ceil(n / token_chunk)
    t = 0.0
    for i in range(chunks):
        t += _jsd_chunk_forward_s(dev, min(token_chunk, n - i * token_chunk), hs, ht, v, itemsize, stat_reads)
    return t + dev.fixed_fwd_s + dev.fixed_per_token_s * n


def jsd_kl_forward_s(dev, n, hs, ht, v, itemsize) -> float:
    """The KL limits' fused forward (``jsd_kl_forward_kernel``): both heads' GEMM FLOPs
    at ``jsd_kl_forward`` x cuBLAS' rate (``jsd_kl_forward_l2miss`` when both x's exceed
    L2: each vocabulary block re-reads its rows' x tiles), the merge launch and the
    per-call terms."""
    flops = 2.0 * n * v * (hs + ht)
    factor = dev.jsd_kl_forward if n * (hs + ht) * itemsize <= dev.l2_bytes else dev.jsd_kl_forward_l2miss
    t = factor * flops / (gemm_rate(dev, itemsize) * wave_eff(dev, n, v, 128, 128))
    return t + 2 * dev.launch_s + dev.fixed_fwd_s + dev.fixed_per_token_s * n


def jsd_kl_fused_faster(dev, n, hs, ht, v, itemsize, token_chunk) -> bool:
    """For the KL limits: is the fused forward predicted faster than the chunked one at
    ``token_chunk`` rows per chunk (its statistics read each fp32 chunk once)? Yes where
    the chunks' GEMMs are weight-read-bound (small hidden sizes: 2048 <- 2048 measured
    0.66x the chunked forward, 896 <- 3584 0.69x, f+b 0.83-0.84x); no at wide heads
    (4096 <- 8192: 0.99-1.01x at 4096 tokens, 1.06-1.10x at 16384; H100, 4 stages)."""
    return jsd_kl_forward_s(dev, n, hs, ht, v, itemsize) < jsd_forward_s(dev, n, hs, ht, v, itemsize, token_chunk,
                                                                        stat_reads=1)


def _recomputed_columns_s(dev, n, hs, ht, cols, itemsize, vocab_chunk, kept) -> float:
    """The backward's recomputed columns (``cols`` of them, in chunks of ``vocab_chunk``):
    the fused two-head dz kernel (both heads' GEMM FLOPs, measured ~1.4x cuBLAS on the
    same FLOPs at 4096 x 4096 <- 8192, docs/design.md "Distillation"; or the dz write),
    each chunk's dW and dx GEMMs, and the fp32 dx accumulator's traffic when dx has more
    than one part (``kept``: the kept columns' GEMMs are one more)."""
    if cols <= 0:
        return 0.0
    flops = 2.0 * n * cols * (hs + ht)
    t = max(1.4 * flops / (gemm_rate(dev, itemsize) * wave_eff(dev, n, vocab_chunk, 128, 128)),
            itemsize * n * cols / dev.hbm_bw)
    chunks = math.ceil(cols / vocab_chunk)
    full, tail = divmod(cols, vocab_chunk)
    per = gemm_s(dev, vocab_chunk, hs, n, itemsize) + gemm_s(dev, n, hs, vocab_chunk, itemsize, out_itemsize=0)
    t += full * per + 4 * chunks * dev.launch_s
    if tail:
        t += gemm_s(dev, tail, hs, n, itemsize) + gemm_s(dev, n, hs, tail, itemsize, out_itemsize=0)
    parts = chunks + (1 if kept else 0)
    if parts > 1:
        t += parts * 8.0 * n * hs / dev.acc_bw + 6.0 * n * hs / dev.hbm_bw
    return t


def predict_jsd_recompute(dev, n, hs, ht, v, itemsize, token_chunk, vocab_chunk=4096,
                          fused_forward=False) -> Candidate:
    """``fused_forward``: the KL limits' one-kernel forward (no fp32 logit chunks: the
    token chunk is then every token and costs no memory)."""
    if fused_forward:
        token_chunk = n
        fwd = jsd_kl_forward_s(dev, n, hs, ht, v, itemsize)
    else:
        fwd = jsd_forward_s(dev, n, hs, ht, v, itemsize, token_chunk)
    bwd = _recomputed_columns_s(dev, n, hs, ht, v, itemsize, vocab_chunk, kept=False) + backward_fixed_s(dev, n)
    chunks = math.ceil(v / vocab_chunk)
    acc = 4 * n * hs if chunks > 1 and itemsize != 4 else 0
    fwd_memory = 0 if fused_forward else 8 * min(token_chunk, n) * v
    memory = max(fwd_memory, acc + itemsize * n * min(vocab_chunk, v))
    return Candidate("recompute", token_chunk=min(token_chunk, n), vocab_chunk=vocab_chunk, memory=memory,
                     time_s=fwd + bwd, fwd_s=fwd)


def predict_jsd_keep(dev, n, hs, ht, v, itemsize, token_chunk, keep_cols, vocab_chunk=4096) -> Candidate:
    """The ``keep`` strategy (module docstring): forward chunks of ``token_chunk`` rows that
    also write dz of the first ``keep_cols`` columns; the backward runs their two GEMMs
    (grad_output on x's rows and the fp32 dx) and recomputes the other columns in chunks
    of ``vocab_chunk``."""
    m = min(token_chunk, n)
    full, tail = divmod(n, m)
    bdev = replace(dev, hbm_bw=dev.jsd_stream_bw) if dev.jsd_stream_bw is not None else dev

    def chunk_s(r):  # the chunk's logits and statistics, then its kept columns' dz
        return (_jsd_chunk_forward_s(dev, r, hs, ht, v, itemsize, 2)
                + (8.0 + itemsize) * r * keep_cols / bdev.hbm_bw + dev.launch_s)

    fwd = full * chunk_s(m) + (chunk_s(tail) if tail else 0.0) + dev.fixed_fwd_s + dev.fixed_per_token_s * n
    rest = v - keep_cols
    bwd = (3.0 * (4 + itemsize) * n * hs / dev.hbm_bw + 3 * dev.launch_s  # x * grad_output; dx's scale, cast
           + gemm_s(dev, keep_cols, hs, n, itemsize)  # dW of the kept columns
           + gemm_s(dev, n, hs, keep_cols, itemsize, out_itemsize=4)  # dx, fp32
           + _recomputed_columns_s(dev, n, hs, ht, rest, itemsize, vocab_chunk, kept=True)
           + backward_fixed_s(dev, n))
    backward_memory = (4 + itemsize) * n * hs + (itemsize * n * min(vocab_chunk, rest) if rest else 0)
    memory = itemsize * n * keep_cols + max(8 * m * v, backward_memory)
    return Candidate("keep", keep_cols=keep_cols, vocab_chunk=vocab_chunk, token_chunk=m, memory=memory,
                     time_s=fwd + bwd, fwd_s=fwd)


def keep_column_counts(v: int, align: int) -> list:
    """The kept-column counts of the ``keep`` family: every column when ``v`` is a multiple
    of ``align`` (cuBLAS' slow odd-K path otherwise: the kept part is whole multiples of it),
    and eighths of the vocabulary rounded down to multiples of 128 (one dz tile's width)."""
    counts = {v} if v % align == 0 else {v // 128 * 128}
    counts |= {v * j // 8 // 128 * 128 for j in range(1, 8)}
    return sorted(c for c in counts if c > 0)


def predict_jsd_grad_in_forward(dev, n, hs, ht, v, itemsize, token_chunk, weight_fp32=False) -> Candidate:
    chunks = math.ceil(n / token_chunk)
    t = 0.0
    for i in range(chunks):
        m = min(token_chunk, n - i * token_chunk)
        t += _jsd_chunk_forward_s(dev, m, hs, ht, v, itemsize, 2)
        t += (8.0 + itemsize) * m * v / dev.hbm_bw + dev.launch_s  # dz from both fp32 chunks
        t += gemm_s(dev, m, hs, v, itemsize)  # dx rows
        t += gemm_s(dev, v, hs, m, itemsize, out_itemsize=4 if chunks > 1 else itemsize)  # dW (+=)
        if chunks > 1 and i > 0:
            t += 8.0 * v * hs / dev.hbm_bw  # fp32 read-modify-write of the accumulator
        t += 4 * dev.launch_s + dev.fixed_s
    acc = 4 * v * hs if (chunks > 1 and not weight_fp32) else 0
    if acc:
        t += 6.0 * v * hs / dev.hbm_bw  # fp32 -> input dtype
    fwd = t + dev.fixed_fwd_s + dev.fixed_per_token_s * n
    bwd = 2.0 * itemsize * (n * hs + v * hs) / dev.hbm_bw + 2 * dev.launch_s  # scale by grad_output
    m = min(token_chunk, n)
    memory = (8 + itemsize) * m * v
    if acc:  # the accumulator becomes the returned dW
        memory = accumulated_output_bytes(v * hs, itemsize, memory)
    return Candidate("grad_in_forward", token_chunk=m, memory=memory, time_s=fwd + bwd, fwd_s=fwd)


def jsd_candidates(n, hs, ht, v, itemsize, *, device_model=DEFAULT, grad_in_forward=True, weight_fp32=False,
                   fused_forward=False, keep=False, align=8):
    """The fixed family of linear_jsd plans of a shape (independent of the budget);
    ``fused_forward``: the recompute plan's forward is the KL limits' fused kernel;
    ``keep``: with the ``keep`` plans (``keep_column_counts(v, align)`` columns)."""
    dev = device_model
    # multiples of 16 up to 1024 rows, then powers of two, and every token at once; the
    # recompute plan's forward chunks also in multiples of 8 (the chunk the plan takes
    # from the budget, ``planning.linear_jsd_plan``)
    sizes = {n} | {t for t in range(16, min(n, 1024) + 1, 16)}
    t = 2048
    while t < n:
        sizes.add(t)
        t *= 2
    if fused_forward:
        out = [predict_jsd_recompute(dev, n, hs, ht, v, itemsize, n, fused_forward=True)]
    else:
        rows = sizes | {t for t in range(8, min(n, 1024) + 1, 8)}
        out = [predict_jsd_recompute(dev, n, hs, ht, v, itemsize, t) for t in sorted(rows)]
    if grad_in_forward:
        out += [predict_jsd_grad_in_forward(dev, n, hs, ht, v, itemsize, t, weight_fp32)
                for t in sorted(sizes) if t >= min(n, 128)]
    if keep:
        out += [predict_jsd_keep(dev, n, hs, ht, v, itemsize, t, k)
                for k in keep_column_counts(v, align) for t in sorted(sizes) if t >= min(n, 128)]
    return out


@functools.lru_cache(maxsize=1024)
def choose_jsd(n, hs, ht, v, itemsize, budget, *, device_model=DEFAULT, grad_in_forward=True,
               weight_fp32=False, fused_forward=False, keep=False, align=8) -> Candidate:
    """The fastest predicted linear_jsd plan whose memory fits ``budget`` (raised to the
    least memory of the family, the recompute plan's floor). Ties: recompute first."""
    cands = jsd_candidates(n, hs, ht, v, itemsize, device_model=device_model, grad_in_forward=grad_in_forward,
                           weight_fp32=weight_fp32, fused_forward=fused_forward, keep=keep, align=align)
    budget = max(budget, min(c.memory for c in cands))
    return min((c for c in cands if c.memory <= budget), key=lambda c: c.time_s)
