"""Cost model of linear_cross_entropy's strategies: predicted time, memory, choice.
The device classes (``DeviceModel``) and kernel-time terms (``gemm_s``, ...) are shared:
linear_jsd prices its own strategies with them (``ops.linear_jsd.cost_model``).

For a shape (N tokens, H hidden, V vocabulary), an input itemsize s, a memory budget
and a device class, every candidate plan gets a predicted time from three terms,

    time = sum over its kernels of max(FLOPs / (rate * wave efficiency), bytes / bandwidth)
           + launches * LAUNCH + FIXED

and a memory need (bytes beyond inputs, outputs and gradients, counted as
``plans.triton_plan`` allocates them). The planner (``choose``) returns the fastest
candidate whose memory fits the budget, or the least-memory candidate when none fits.

Strategies (``Candidate.strategy``):

- ``keep``: the forward keeps exp(z - m) for every column; backward = one elementwise
  pass + dW + dx: 3 GEMMs. Memory N * V * (s + 4 / block_v).
- ``partial``: keep the first ``keep_cols`` columns, recompute the others in chunks of
  ``vocab_chunk`` columns (fused GEMM + softmax-gradient kernel), dx accumulated in an
  fp32 (N, H) buffer: 3 + (V - keep_cols) / V GEMMs. Memory: kept columns + 4 N H + one
  dz chunk N * vocab_chunk * s, unless the backward owns the kept columns and the chunk
  fits in them (it is laid there once their dz is spent: ``launch.dz_buffer``).
  ``keep_cols = 0`` is "recompute everything".
- ``grad_in_forward``: token chunks of ``token_chunk`` rows; for each, the forward keeps
  the chunk's logits over the whole vocabulary, turns them into dz with the loss's
  upstream gradient taken as 1 (possible for "mean" and "sum": the denominator of
  "mean" depends on the targets only), dx_chunk = dz W, dW += dz^T x_chunk in fp32;
  the backward only scales dx, dW (and db) by grad_output. 3 GEMMs, but one fp32
  read-modify-write of dW (8 V H bytes) per chunk after the first. Memory: the chunk's
  kept logits + an fp32 dW accumulator (4 V H) unless one chunk covers every token or
  the weight (so dW) is fp32 already, budgeted beyond the dW it becomes
  (``accumulated_output_bytes``). Not for reduction="none".
- ``forward``: no gradient wanted: the fused forward alone.

Why a choice is never slower as the budget grows (by construction): the candidates of
a shape are a fixed finite family that does not depend on the budget (keep_cols on a
grid of 1/64ths of the vocabulary, token chunks on powers of two); the budget only
filters them by their memory need. A larger budget filters fewer out, so the minimum
predicted time can only fall; below the least memory need the least-memory candidate
is used whatever the budget (``minimum``: the budget is raised to its need, as the
greedy plan did), and it is itself a candidate. ``tests/test_cost_model.py``
checks it on every suite shape.

The plan depends on the shape, dtype, budget and device class only: never on a
timing taken at run time (same inputs -> same plan -> bitwise the same results).

Constants: measured on one H100 SXM (docs/design.md, "Planner and cost
model"); H200 has the H100's tensor cores and 1.43x its memory bandwidth (not yet
measured: the GPU script prints predicted vs measured so it can be refitted).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace
from typing import Optional

STRATEGIES = ("keep", "partial", "grad_in_forward", "forward")
#: Kept-column candidates of "partial": multiples of 1/KEEP_STEPS of the vocabulary.
KEEP_STEPS = 64


@dataclass(frozen=True)
class DeviceModel:
    """Throughputs of one device class (rates in FLOP/s, bandwidths in bytes/s)."""

    name: str
    sms: int
    #: cuBLAS bf16/fp16 GEMM rate at large shapes (H100: 700-800 TFLOP/s measured, the
    #: six anchor shapes' unit GEMMs: 4.3-17 TFLOP in 5.4-24.6 ms).
    gemm_flops_16: float = 760e12
    #: fp32 inputs: tf32 tensor cores ("high"/"medium" precision) at about half rate.
    gemm_flops_32: float = 380e12
    #: Device-to-device copy (read + write) of the bench: 3.0 TB/s on H100.
    hbm_bw: float = 3.0e12
    #: Extra time of the forward's kept-tile stores: +0.76 ms for 1 GB (llama) = 1.3 TB/s.
    keep_store_bw: float = 1.3e12
    #: kept_dlogits pass (read + write of the kept columns): 2 GB in 0.78 ms = 2.6 TB/s.
    kept_pass_bw: float = 2.6e12
    #: fp32 dx/dW accumulator read-modify-write through addmm (partly in L2): 0.86 ms for
    #: 28 passes of 8 N H = 134 MB at llama = 4.4 TB/s.
    acc_bw: float = 4.4e12
    #: Fused kernels relative to cuBLAS on the same FLOPs (TMA, 128x256x64 tiles):
    #: forward 1.06-1.23x (profile 6.54 ms vs GEMM ~5.6), dlogits 1.16x.
    fused_forward: float = 1.12
    fused_dlogits: float = 1.16
    #: linear_jsd's fused KL-limit forward (two 128 x 128 logits tiles per block, two K
    #: loops, 4 stages) over cuBLAS on its FLOPs: 1.29-1.31x where both x's fit in L2
    #: (N (H_s + H_t) itemsize <= ``l2_bytes``: 4096 x (2048 + 2048), 4096 x (896 + 3584)),
    #: ``jsd_kl_forward_l2miss`` 1.38-1.52x where they do not (4096 and 16384 x (4096 +
    #: 8192)); H100 (docs/design.md).
    jsd_kl_forward: float = 1.30
    jsd_kl_forward_l2miss: float = 1.45
    #: linear_jsd's chunked forward (a few hundred rows per chunk: its fp32-output GEMMs
    #: stream both weights once per chunk, then the statistics read the chunks): the
    #: bandwidth those streams reach (None: ``hbm_bw``). H200: 3.4 TB/s, not its copy
    #: rate: 2048 <- 2048, V 151936 went 13.5 -> 11.4 ms from the H100 (1.19x, not 1.43x;
    #: docs/design.md).
    jsd_stream_bw: Optional[float] = None
    #: L2 bytes: a dz chunk larger than ~60% of it is re-read from HBM by dW and dx
    #: (11k-column chunks ran 5% slower: docs/design.md "Backward").
    l2_bytes: float = 50e6
    launch_s: float = 6e-6
    #: Per-call overhead of the O(N) torch ops (split merge, coefficients, casts):
    #: the end-to-end bench is 1-2 ms above the kernels' sum at 4096 tokens.
    fixed_fwd_s: float = 0.05e-3
    fixed_s: float = 0.15e-3
    fixed_per_token_s: float = 6e-8
    # fp32 at matmul precision "high" (TF32): the fused kernels' time over one cuBLAS
    # TF32 GEMM of the same FLOPs (``predict_tf32``), by where the operands are rounded.
    #: rounded in the kernels' registers ("tf32-round": off the TMA -> wgmma path):
    #: forward 25.1 ms = 2.155x a 11.66 ms GEMM at 4096 x 4096 x 128256 (docs/design.md "fp32 inputs").
    tf32_fwd_in_kernel: float = 2.10
    #: pre-rounded operands (scratch buffers, TMA), 128 x 256 tiles (no gradient):
    #: 12.6 ms with W whole = 1.081x, less the rounding passes (0.127x + x).
    tf32_fwd_prerounded: float = 0.95
    #: pre-rounded, the gradient's 128 x 128 tiles: 14.23 ms = 1.221x, less the rounding.
    tf32_fwd_prerounded_narrow: float = 1.09
    #: the dlogits kernel on recomputed columns, rounding in registers / pre-rounded
    #: (fitted to the forward+backward rows: ``benchmarks/results/`` tf32plan, docs/design.md).
    tf32_dlogits_in_kernel: float = 2.3
    tf32_dlogits_prerounded: float = 1.4
    #: fp32 kept columns (128 x 128 tiles): the forward's store and the backward's pass
    #: over them, fitted with the rest (the 16-bit rates above over-predict fp32 by ~10%
    #: at 4 GiB, where every column is kept).
    tf32_keep_store_bw: float = 0.7e12
    tf32_kept_pass_bw: float = 1.3e12
    #: one rounding pass (read + write fp32): 1.478 ms for 2.1 GB of W (W.clone() 1.389 ms).
    round_bw: float = 2.85e12
    #: each W chunk rounded beside a launch of the pre-rounded path (forward launch or
    #: recomputed chunk): the rounding launch, its host time, a partly idle tail wave.
    tf32_chunk_s: float = 100e-6
    #: per call and pass (forward; backward when it recomputes) of the pre-rounded path:
    #: the x rounding launch, scratch allocation, descriptors built per chunk on the host.
    tf32_prerounded_fixed_s: float = 0.2e-3

    #: Doublings of the recomputed chunk width allowed past the L2 rule below (0: the
    #: shipped family, chunks while the dz chunk fits ~60% of L2; 2: also 2x and 4x that
    #: width, e.g. 8192 and 16384 columns at 4096 tokens). The wider chunks' time counts
    #: dW and dx re-reading dz from HBM; they save accumulator passes and launches, most
    #: at small H (benchmarks/probe_regret.py measures them; the refit,
    #: benchmarks/fit_cost_model.py, says whether to turn them on).
    wide_chunks: int = 0
    #: HBM bytes per dz byte when a chunk exceeds ~60% of L2 (dW and dx each re-read
    #: it: 2; a separate constant so that the refit can size it from wide-chunk timings).
    l2_reread: float = 2.0
    #: Weight of the wave-quantisation loss of cuBLAS GEMMs (``gemm_s``: efficiency **
    #: gemm_wave; 1: 128 x 256 tiles as now). The profile of gemma3-4b's 4096-column chunks
    #: ran dW at one GEMM's speed where 128 x 256 tiles predict 81% busy SMs:
    #: cuBLAS picks other tiles. A fitted constant (benchmarks/fit_cost_model.py).
    gemm_wave: float = 1.0
    #: The planning rule of a device with this model (``device.DeviceFacts``): False, a
    #: GPU's (tile tables, tuned tiles, the cost model's kept columns and chunks); True,
    #: the CPU interpreter's (its small tiles, the greedy kept columns and chunks that
    #: exercise every kernel path at tiny shapes: ``INTERPRETER``).
    interpreter: bool = False


#: wide_chunks=2: the planner regret probe (``benchmarks/probe_regret.py``) measured 4096-column
#: chunks 2-11% slower than 8192-16384-column ones at 256 MiB on 7 of 9 shapes (mean regret 5.0% -> 1.8%).
H100 = DeviceModel("H100", sms=132, wide_chunks=2)
#: H200: the H100's tensor cores, 1.43x its copy bandwidth. The linear_jsd fields are
#: measured (the KL fused forward's L2-miss factor falls with the bandwidth,
#: 1.31 vs 1.45; the chunked forward's streams reach 3.4 TB/s); the others scale by the
#: bandwidth, not refitted.
H200 = replace(H100, name="H200", hbm_bw=4.3e12, keep_store_bw=1.8e12, kept_pass_bw=3.7e12, acc_bw=6.0e12,
               jsd_kl_forward_l2miss=1.31, jsd_stream_bw=3.4e12)
#: AMD Instinct MI300X (gfx942, CDNA3; chosen by ``torch.cuda.get_device_properties(d).
#: gcnArchName`` under ROCm: ``planning.rocm.arch``). AMD's data sheet: 304 CUs, 1307.4
#: TFLOP/s peak dense bf16/fp16, 653.7 TFLOP/s TF32 (xf32), 163.4 TFLOP/s fp32 matrix,
#: 5.3 TB/s HBM3, 4 MB L2 per XCD (8 XCDs) and a 256 MB Infinity Cache. Not measured
#: here (no AMD GPU): the GEMM rate is taken at half the peak (public hipBLASLt bf16
#: GEMMs reach ~45-55% of it at large shapes), the copy rate at 75% of the peak, the
#: other bandwidths scaled from the H100's by the copy rate; the fused-kernel factors
#: are the H100's (the kernels lose TMA/wgmma and gain nothing: a guess to refit with
#: ``benchmarks/fit_cost_model.py`` on the hardware). ``l2_bytes``: the Infinity Cache
#: (a dz chunk re-read by the dW and dx GEMMs stays there, not in the 4 MB L2s).
MI300X = replace(H100, name="MI300X", sms=304, gemm_flops_16=650e12, gemm_flops_32=325e12, hbm_bw=4.0e12,
                 keep_store_bw=1.7e12, kept_pass_bw=3.5e12, acc_bw=5.9e12, round_bw=3.8e12,
                 l2_bytes=256e6, wide_chunks=0)
#: AMD Instinct MI355X (gfx950, CDNA4). AMD's data sheet: 256 CUs, 2516.6 TFLOP/s peak
#: dense bf16/fp16 (MI350X 2306.9), 157.3 TFLOP/s fp32 matrix and no TF32 (fp32 at
#: "high" runs fp32 MFMAs: ``gemm_flops_32`` at that rate), 8 TB/s HBM3E, 256 MB
#: Infinity Cache, 160 KiB LDS per CU. Same assumptions as MI300X (half the GEMM peak,
#: 75% of the copy peak), not measured.
MI355X = replace(MI300X, name="MI355X", sms=256, gemm_flops_16=1250e12, gemm_flops_32=80e12, hbm_bw=6.0e12,
                 keep_store_bw=2.6e12, kept_pass_bw=5.2e12, acc_bw=8.8e12, round_bw=5.7e12)
#: Any other GPU: H100's constants (the choice is relative, so ratios matter more than
#: absolute rates).
DEFAULT = H100
#: The CPU interpreter's planning model (``device.facts`` of any device that is not CUDA):
#: the interpreter's rule, the strategy and TF32 choices priced with DEFAULT's constants
#: (its plans are only for tests).
INTERPRETER = replace(DEFAULT, name="interpreter", interpreter=True)
DEVICE_MODELS = {"H100": H100, "H200": H200, "MI300X": MI300X, "MI355X": MI355X}
#: AMD architectures (``gcnArchName``) -> device class; other AMD GPUs get DEFAULT.
ROCM_ARCH_CLASSES = {"gfx942": "MI300X", "gfx950": "MI355X"}


def device_class(name: str) -> str:
    """"NVIDIA H100 80GB HBM3" -> "H100"; unknown names -> "default"."""
    up = name.upper()
    for key in ("H200", "H100", "GH200"):
        if key in up:
            return "H200" if key == "GH200" else key
    return "default"


def device_model(device=None) -> DeviceModel:
    """The class of a CUDA device (by AMD architecture under ROCm, else by name), DEFAULT
    for unknown GPUs and other devices. The planners read it once per device, as its
    ``device.DeviceFacts.model`` (INTERPRETER off CUDA)."""
    if device is None or getattr(device, "type", "cpu") != "cuda":
        return DEFAULT
    from logitless.planning import rocm

    amd = rocm.arch(device)
    if amd is not None:  # ROCm: by architecture (names vary: "AMD Instinct MI300X", "AMD Radeon Graphics")
        return DEVICE_MODELS.get(ROCM_ARCH_CLASSES.get(amd, ""), DEFAULT)
    import torch

    return DEVICE_MODELS.get(device_class(torch.cuda.get_device_name(device)), DEFAULT)


@dataclass(frozen=True)
class Candidate:
    strategy: str
    keep_cols: int = 0  # partial / keep
    vocab_chunk: int = 0  # partial: recomputed columns per chunk
    token_chunk: int = 0  # grad_in_forward: tokens per chunk
    memory: int = 0  # bytes beyond inputs, outputs and gradients
    time_s: float = 0.0  # predicted forward + backward (forward alone for "forward")
    fwd_s: float = 0.0  # predicted forward

    @property
    def ms(self) -> float:
        return self.time_s * 1e3

    @property
    def label(self) -> str:
        if self.strategy == "partial":
            return f"partial(keep={self.keep_cols},chunk={self.vocab_chunk})"
        if self.strategy == "grad_in_forward":
            return f"grad_in_forward(tokens={self.token_chunk})"
        return self.strategy


# --------------------------------------------------------------------------- kernel times


def gemm_rate(dev: DeviceModel, itemsize: int) -> float:
    """cuBLAS' GEMM rate (FLOP/s) for inputs of ``itemsize`` bytes."""
    return dev.gemm_flops_32 if itemsize >= 4 else dev.gemm_flops_16


def wave_eff(dev: DeviceModel, m: int, n: int, bm: int = 128, bn: int = 256) -> float:
    """Fraction of the SMs busy, averaged over waves of (bm x bn) output tiles."""
    tiles = math.ceil(m / bm) * math.ceil(n / bn)
    waves = tiles / dev.sms
    return min(1.0, waves / math.ceil(waves)) if waves < 8 else 1.0


def gemm_s(dev: DeviceModel, m: int, n: int, k: int, itemsize: int, out_itemsize: int = None) -> float:
    """cuBLAS (m x k) @ (k x n): max(compute, memory) + one launch."""
    if m == 0 or n == 0 or k == 0:
        return dev.launch_s
    out_itemsize = itemsize if out_itemsize is None else out_itemsize
    flops = 2.0 * m * n * k
    bytes_ = itemsize * (m * k + n * k) + out_itemsize * m * n
    eff = wave_eff(dev, m, n) ** dev.gemm_wave
    return max(flops / (gemm_rate(dev, itemsize) * eff), bytes_ / dev.hbm_bw) + dev.launch_s


def fused_forward_s(dev, n, h, v, itemsize) -> float:
    """forward_stats_kernel: the GEMM's FLOPs (split over the vocabulary so waves are
    full: tiles.WAVES) and reads, no logits written."""
    flops = 2.0 * n * h * v
    bytes_ = itemsize * (n * h + v * h * math.ceil(n / 128))  # W once per row block (L2 absorbs most)
    return max(dev.fused_forward * flops / gemm_rate(dev, itemsize), bytes_ / (4 * dev.hbm_bw)) + dev.launch_s


def fused_dlogits_s(dev, n, h, cols, itemsize) -> float:
    """dlogits_kernel over `cols` recomputed columns: a GEMM + the dz write."""
    if cols <= 0:
        return 0.0
    flops = 2.0 * n * h * cols
    return max(dev.fused_dlogits * flops / (gemm_rate(dev, itemsize) * wave_eff(dev, n, cols)),
               itemsize * n * cols / dev.hbm_bw) + dev.launch_s


# --------------------------------------------------------------------------- strategies


def backward_fixed_s(dev, n) -> float:
    """Backward's O(N) torch ops (coefficients, casts) and launch gaps."""
    return dev.fixed_s + dev.fixed_per_token_s * n


def _keep_bytes(n, cols, itemsize, block_v) -> int:
    """Memory charged for kept columns: the logits' own size in the input dtype, so that
    a budget of the logits' size keeps them all (README). Not charged: the row padding
    to 16 bytes and the fp32 max per (token, block_v columns), < 1% of it in bf16."""
    return n * cols * itemsize


def accumulated_output_bytes(elements: int, itemsize: int, beside: int) -> int:
    """Memory of a gradient-in-forward plan whose fp32 accumulator of ``elements`` becomes
    a returned gradient of ``itemsize`` bytes an element, beside ``beside`` bytes of chunk
    buffers alive with it. A plan's memory is its peak beyond the inputs and the gradients
    it returns (what the bench's peak extra measures): the accumulator costs (4 - itemsize)
    bytes an element beyond the gradient it becomes while the chunk lives, and all 4 at the
    backward's cast (the gradient alive beside it, the chunk gone)."""
    return max(beside + (4 - itemsize) * elements, 4 * elements)


def predict_forward(dev, n, h, v, itemsize) -> Candidate:
    t = fused_forward_s(dev, n, h, v, itemsize) + dev.fixed_fwd_s
    return Candidate("forward", memory=0, time_s=t, fwd_s=t)


def unowned_dz_bytes(col: int, v: int, acc: int, min_chunk: int) -> int:
    """Bytes of the kept columns' dz where the backward cannot write it over them (the
    custom ops): whole (``col`` bytes per column, ``v`` columns), or in chunks of at least
    ``min_chunk`` columns beside the fp32 dx accumulator (``acc`` bytes;
    ``plans._kept_dz_chunk``), whichever is less. The GPU rule (``predict_keep``) and the
    interpreter's (``plans._greedy_columns``) both count it so."""
    return min(col * v, acc + col * min(min_chunk, v))


def predict_keep(dev, n, h, v, itemsize, block_v=256, kept_owned=True, min_chunk=4096) -> Candidate:
    """Keep every column. ``kept_owned=False`` (the custom ops: the backward cannot write dz
    over the kept columns): its memory also holds their dz (``unowned_dz_bytes``)."""
    kb = n * v * itemsize
    fwd = fused_forward_s(dev, n, h, v, itemsize) + kb / dev.keep_store_bw + dev.fixed_fwd_s
    bwd = (2 * kb / dev.kept_pass_bw + dev.launch_s
           + gemm_s(dev, v, h, n, itemsize)  # dW = dz^T x
           + gemm_s(dev, n, h, v, itemsize)  # dx = dz W
           + backward_fixed_s(dev, n))
    memory = _keep_bytes(n, v, itemsize, block_v)
    if not kept_owned:
        memory += unowned_dz_bytes(itemsize * n, v, 4 * n * h if itemsize != 4 else 0, min_chunk)
    return Candidate("keep", keep_cols=v, vocab_chunk=v, memory=memory, time_s=fwd + bwd, fwd_s=fwd)


def predict_partial(dev, n, h, v, itemsize, keep_cols, vocab_chunk, block_v=256, kept_owned=False) -> Candidate:
    """Keep ``keep_cols`` columns, recompute the others in ``vocab_chunk``-wide chunks.
    ``kept_owned`` (the eager path: the backward writes the kept columns' dz over them):
    the recomputed chunks' dz is laid in the kept buffer when it fits, costing no memory."""
    rec = v - keep_cols
    kb = n * keep_cols * itemsize
    fwd = fused_forward_s(dev, n, h, v, itemsize) + kb / dev.keep_store_bw + dev.fixed_fwd_s
    bwd = fused_dlogits_s(dev, n, h, rec, itemsize) + (2 * kb / dev.kept_pass_bw if keep_cols else 0.0)
    # dW and dx per chunk: the chunk widths' GEMMs (wave efficiency of each width).
    widths = ([keep_cols] if keep_cols else []) + [vocab_chunk] * (rec // vocab_chunk) + (
        [rec % vocab_chunk] if rec % vocab_chunk else [])
    for c in widths:
        bwd += gemm_s(dev, c, h, n, itemsize) + gemm_s(dev, n, h, c, itemsize, out_itemsize=0)
        bwd += 3 * dev.launch_s  # db / slicing / the chunk's small ops
    if len(widths) > 1:
        bwd += len(widths) * 8.0 * n * h / dev.acc_bw + 6.0 * n * h / dev.hbm_bw  # fp32 dx passes + cast
    dz_chunk = itemsize * n * vocab_chunk
    if dz_chunk > 0.6 * dev.l2_bytes:  # dW and dx re-read the chunk from HBM
        bwd += dev.l2_reread * itemsize * n * rec / dev.hbm_bw
    bwd += backward_fixed_s(dev, n)
    # fp32 dx accumulator across chunks; fp32 inputs accumulate into dx itself.
    acc = 4 * n * h if len(widths) > 1 and itemsize != 4 else 0
    kb_mem = _keep_bytes(n, keep_cols, itemsize, block_v)
    in_kept = kept_owned and itemsize * n * min(vocab_chunk, rec) <= kb_mem
    memory = kb_mem + acc + (0 if in_kept else dz_chunk)
    return Candidate("partial", keep_cols=keep_cols, vocab_chunk=vocab_chunk, memory=memory,
                     time_s=fwd + bwd, fwd_s=fwd)


def predict_grad_in_forward(dev, n, h, v, itemsize, token_chunk, weight_fp32=False, block_v=256) -> Candidate:
    chunks = math.ceil(n / token_chunk)
    t = 0.0
    for i in range(chunks):
        m = min(token_chunk, n - i * token_chunk)
        kb = m * v * itemsize
        t += fused_forward_s(dev, m, h, v, itemsize) + kb / dev.keep_store_bw
        t += 2 * kb / dev.kept_pass_bw + dev.launch_s
        t += gemm_s(dev, m, h, v, itemsize)  # dx rows of the chunk
        t += gemm_s(dev, v, h, m, itemsize, out_itemsize=4 if chunks > 1 else itemsize)  # dW (+=)
        if chunks > 1 and i > 0:
            t += 8.0 * v * h / dev.hbm_bw  # fp32 read-modify-write of the accumulator
        t += 6 * dev.launch_s + dev.fixed_fwd_s + dev.fixed_s  # O(chunk) merges, coefficients
    acc = 4 * v * h if (chunks > 1 and not weight_fp32) else 0
    if acc:
        t += 6.0 * v * h / dev.hbm_bw  # fp32 -> input dtype
    fwd = t + dev.fixed_per_token_s * n
    bwd = (2.0 * itemsize * (n * h + v * h)) / dev.hbm_bw + 2 * dev.launch_s  # scale by grad_output
    memory = _keep_bytes(min(token_chunk, n), v, itemsize, block_v)
    if acc:
        memory = accumulated_output_bytes(v * h, itemsize, memory)
    return Candidate("grad_in_forward", token_chunk=min(token_chunk, n), memory=memory,
                     time_s=fwd + bwd, fwd_s=fwd)


# --------------------------------------------------------------------------- the planner


def _wide_widths(dev, first, padded) -> set:
    """Chunk widths past the L2 rule: ``dev.wide_chunks`` doublings from ``first`` (the
    first width the rule left out), below the padded vocabulary."""
    return {first << i for i in range(dev.wide_chunks) if (first << i) < padded}



def candidates(n, h, v, itemsize, *, device_model=DEFAULT, block_v=256, min_chunk=4096,
               grad_in_forward=True, weight_fp32=False, keep=True, kept_owned=True):
    """The fixed family of candidate plans of a shape (independent of the budget).
    ``kept_owned``: ``predict_keep``'s and ``predict_partial``'s (the backward writes dz
    over the kept columns: a partial plan's recomputed chunks reuse them; not owned, its
    kept dz goes through its chunk buffer)."""
    dev = device_model
    padded = math.ceil(v / block_v) * block_v
    out = []
    if keep:
        out.append(predict_keep(dev, n, h, v, itemsize, block_v, kept_owned, min_chunk))
    # Recomputed chunk widths: the L2-resident floor, and wider ones while the dz chunk
    # stays under ~60% of L2 (few-token shapes: fewer launches and accumulator passes).
    widths = {min(min_chunk, padded)}
    c = min_chunk * 2
    while c < padded and itemsize * n * c <= 0.6 * dev.l2_bytes:
        widths.add(c)
        c *= 2
    widths |= _wide_widths(dev, c, padded)
    # kept columns: 64ths of the vocabulary (multiples of block_v), 0 included
    keeps = sorted({(v * i // KEEP_STEPS) // block_v * block_v for i in range(KEEP_STEPS)} if keep else {0})
    for k in keeps:
        # and, beside kept columns, the whole remainder in one chunk when it is wider
        one = {padded - k} if 0 < k and padded - k > max(widths) else set()
        for w in sorted(widths | one):
            if k < v:
                out.append(predict_partial(dev, n, h, v, itemsize, k, w, block_v, kept_owned))
    if grad_in_forward:
        t = 512
        sizes = set()
        while t < n:
            sizes.add(t)
            t *= 2
        sizes.add(n)
        for t in sorted(sizes):
            out.append(predict_grad_in_forward(dev, n, h, v, itemsize, t, weight_fp32, block_v))
    return out


@functools.lru_cache(maxsize=4096)
def choose(n, h, v, itemsize, budget, *, device_model=DEFAULT, need_grad=True, grad_in_forward=True,
           weight_fp32=False, keep=True, block_v=256, min_chunk=4096, kept_owned=True) -> Candidate:
    """The fastest predicted candidate whose memory fits ``budget``.

    The floor: the budget is raised to the memory of the documented minimum plan
    (recompute every column in ``min_chunk``-wide chunks with an fp32 dx accumulator),
    which is always a candidate. So a tiny budget gets that plan (or anything as
    small and faster), and the feasible set only grows with the budget. Ties go to
    the earlier candidate (keep, partial, grad_in_forward): deterministic."""
    if not need_grad:
        return predict_forward(device_model, n, h, v, itemsize)
    cands = candidates(n, h, v, itemsize, device_model=device_model, block_v=block_v, min_chunk=min_chunk,
                       grad_in_forward=grad_in_forward, weight_fp32=weight_fp32, keep=keep,
                       kept_owned=kept_owned)
    floor = minimum(n, h, v, itemsize, device_model=device_model, block_v=block_v, min_chunk=min_chunk)
    budget = max(budget, floor.memory)
    return min((c for c in cands if c.memory <= budget), key=lambda c: c.time_s)


def minimum(n, h, v, itemsize, *, device_model=DEFAULT, block_v=256, min_chunk=4096) -> Candidate:
    """The least-memory plan of the greedy planner: no kept column, chunks of
    min(min_chunk, padded V) columns (README: 4 N H + N * 4096 * s bytes)."""
    padded = math.ceil(v / block_v) * block_v
    return predict_partial(device_model, n, h, v, itemsize, 0, min(min_chunk, padded), block_v)


def predict_all(n, h, v, itemsize, budget, *, device_model=DEFAULT, **kw) -> dict:
    """Best fitting candidate of each strategy (None where none fits), for reports."""
    out = {}
    for c in candidates(n, h, v, itemsize, device_model=device_model, **kw):
        if c.memory <= budget and (out.get(c.strategy) is None or c.time_s < out[c.strategy].time_s):
            out[c.strategy] = c
    out["forward"] = predict_forward(device_model, n, h, v, itemsize)
    return out


# --------------------------------------------------------------------------- fp32 at "high"
#
# fp32 inputs at matmul precision "high" run one TF32 product per multiply-add, on
# operands rounded to TF32 either in the kernels' registers (the "in-kernel" plan) or
# beforehand into scratch buffers (the "pre-rounded" plan: x once per call and again in
# the backward, W in chunks of ``w_chunk`` rows per forward launch and per recomputed
# backward chunk; ``plans.triton_plan``). Pre-rounded kernels load TF32-exact operands by
# TMA and run about twice as fast, but the scratch (4 N H + 4 H per W row) comes off the
# memory budget, so near the logits' size the plan keeps fewer columns and recomputes
# the others chunk by chunk. ``predict_tf32`` prices a plan of either kind from its
# columns; ``plans.triton_plan`` takes the cheaper (``override(tf32_preround=...)``
# forces one). Results are bitwise the same either way: only the time differs.


def predict_tf32(dev: DeviceModel, n: int, h: int, v: int, *, prerounded: bool, keep_cols: int,
                 vocab_chunk: int, w_chunk: int, block_v: int, grad: bool) -> Candidate:
    """Predicted forward (and, with ``grad``, forward + backward) time of an fp32 plan at
    "high": the 16-bit model's terms (``predict_forward`` / ``predict_keep`` /
    ``predict_partial``: kept-column store and pass, cuBLAS dW and dx per chunk, fp32 dx
    accumulation) with the fused kernels' factors of the TF32 path, plus for the
    pre-rounded plan its rounding passes, each one read and one write at ``round_bw``:

        forward   x (8 N H bytes) once + all of W (8 V H) in ceil(V / w_chunk) chunks
        backward  x once more + the W rows of the recomputed columns (8 H (V - kept)),
                  one chunk per recomputed chunk

    and ``tf32_chunk_s`` per rounded W chunk. ``keep_cols``, ``vocab_chunk``,
    ``w_chunk`` and ``block_v`` are the plan's (``tiles.TritonPlan``)."""
    if prerounded:
        fwd_f = dev.tf32_fwd_prerounded if block_v >= 256 else dev.tf32_fwd_prerounded_narrow
        dl_f = dev.tf32_dlogits_prerounded
    else:
        fwd_f, dl_f = dev.tf32_fwd_in_kernel, dev.tf32_dlogits_in_kernel
    d = replace(dev, fused_forward=fwd_f, fused_dlogits=dl_f, keep_store_bw=dev.tf32_keep_store_bw,
                kept_pass_bw=dev.tf32_kept_pass_bw)
    if not grad:
        c = predict_forward(d, n, h, v, 4)
    elif keep_cols >= v:
        c = predict_keep(d, n, h, v, 4, block_v)
    else:
        c = predict_partial(d, n, h, v, 4, keep_cols, max(block_v, vocab_chunk), block_v)
    fwd, total = c.fwd_s, c.time_s
    label = "pre-rounded" if prerounded else "in-kernel"
    if prerounded and n and v:
        chunks = math.ceil(v / max(1, w_chunk)) if w_chunk < v else 1
        extra = 8.0 * h * (n + v) / dev.round_bw + (chunks + 1) * dev.launch_s
        extra += chunks * dev.tf32_chunk_s + (chunks - 1) * dev.launch_s  # a forward launch per chunk
        extra += dev.tf32_prerounded_fixed_s
        fwd += extra
        total += extra
        rec = v - min(keep_cols, v) if grad else 0
        if rec > 0:
            rec_chunks = math.ceil(rec / max(block_v, vocab_chunk))
            total += 8.0 * h * (n + rec) / dev.round_bw + (rec_chunks + 1) * dev.launch_s
            total += rec_chunks * dev.tf32_chunk_s + dev.tf32_prerounded_fixed_s
    return Candidate(label, keep_cols=keep_cols, vocab_chunk=vocab_chunk, memory=c.memory,
                     time_s=total if grad else fwd, fwd_s=fwd)
