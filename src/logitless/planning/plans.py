"""Heuristics in one place: memory budget, chunk sizes, Triton block sizes.

Everything that decides *how* (not *what*) is computed lives here, so that tuning
never touches the math or the kernels.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Optional

from logitless.options import DEFAULT_MEMORY_BUDGET  # noqa: F401  (re-exported for the planners' users)
from logitless.planning import rocm as _rocm
from logitless.planning.memo import memoised
from logitless.planning.overrides import current as _overrides
from logitless.planning.overrides import what_ifs as _what_ifs
from logitless.planning.tiles import (  # noqa: F401  (re-exported: the tables and the plan live there)
    CUDA_TILES,
    CUDA_TILES_TF32,
    INTERPRETER_TILES,
    MIN_CHUNK,
    PERSISTENT_MIN_ROW_BLOCKS,
    WAVES,
    CutePlan,
    TritonPlan,
    forward_blocks_per_split,
    group_rows_for,
)


def _clamp(v: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, v))


# --------------------------------------------------------------------------- PyTorch


@dataclass(frozen=True)
class TorchPlan:
    """Tiles of the PyTorch backend: each tile of logits is token_chunk x vocab_chunk."""

    token_chunk: int
    vocab_chunk: int


#: Bytes per token of a chunk besides its tiles: the running per-row statistics
#: (max, sum, target logit, smoothing sum, argmax and their per-tile temporaries).
TORCH_ROW_OVERHEAD = 128


def torch_plan(
    num_tokens: int, vocab: int, hidden: int, itemsize: int, budget: int, *,
    tiles: int = 1, row_bytes: int = 0, col_bytes: int = 0,
) -> TorchPlan:
    """Largest tiles whose temporaries fit the budget. A token_chunk x vocab_chunk
    step of the PyTorch backend holds, besides O(N + V) per-token and per-class vectors:

        tiles * token_chunk * vocab_chunk * itemsize   the logit tiles (compute dtype)
      + token_chunk * (row_bytes + TORCH_ROW_OVERHEAD)  e.g. the upcast chunk of x
      + vocab_chunk * col_bytes                        e.g. the upcast chunk of W, dW's
                                                       fp32 accumulator

    (the backend says what its steps hold; ``hidden`` is for callers' byte counts). The
    backward's fp32 dx accumulator (tokens x hidden, for 16-bit inputs) is not a
    per-step temporary and is not counted: it is bounded by the size of x, never by
    tokens x vocab. When even one row by min(V, 256) columns exceeds the budget, that
    minimum is used.
    """
    row = row_bytes + TORCH_ROW_OVERHEAD

    def cols_for(tokens: int) -> int:
        return (budget - tokens * row) // (tiles * tokens * itemsize + col_bytes)

    token_chunk = _clamp(num_tokens, 1, 2048)
    vocab_chunk = _clamp(cols_for(token_chunk), 1, vocab)
    if vocab_chunk < min(vocab, 256) and token_chunk > 1:
        # A tiny budget: trade rows for columns so that each matmul stays reasonable.
        vocab_chunk = min(vocab, 256)
        tokens = (budget - vocab_chunk * col_bytes) // (tiles * vocab_chunk * itemsize + row)
        token_chunk = _clamp(tokens, 1, num_tokens)
    return TorchPlan(token_chunk=token_chunk, vocab_chunk=vocab_chunk)


# --------------------------------------------------------------------------- Triton


def num_sms(device) -> int:
    """Multiprocessors of ``device`` (a what-if's, if set; a few on the interpreter)."""
    forced = _what_ifs().num_sms
    if forced is not None:
        return forced
    import torch

    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # the interpreter on CPU: few programs keep it quick


@memoised
def triton_plan(
    num_tokens: int, vocab: int, hidden: int, itemsize: int, budget: int, device,
    tiles=None, keep_allowed: bool = False, prerounded: bool = False, backward: bool = False,
) -> TritonPlan:
    """Launch plan for the shape and budget; ``tiles`` overrides the tile table.
    ``keep_allowed``: a backward will follow and may use columns kept by the forward.

    ``prerounded`` (fp32 at matmul precision "high", ``launch.tf32_prerounded``): the
    operands may be rounded to TF32 into scratch buffers first. Whether they are is the
    planner's choice (``tf32_choice``: the cost model prices this pre-rounded plan
    against the in-kernel one and takes the cheaper), unless
    ``override(tf32_preround=True)`` forces it; the in-kernel plan is the plan of
    ``prerounded=False`` (``w_chunk == 0``: the kernels round in registers). Forward and
    backward of one call make the same choice (both price the forward's plans)."""
    if prerounded and itemsize == 4 and _overrides().tf32_preround is None:
        prerounded = tf32_choice(num_tokens, vocab, hidden, budget, device, tiles,
                                 keep_allowed or backward).prerounded
    return _triton_plan(num_tokens, vocab, hidden, itemsize, budget, device, tiles, keep_allowed, prerounded,
                        backward)


def _triton_plan(
    num_tokens: int, vocab: int, hidden: int, itemsize: int, budget: int, device,
    tiles=None, keep_allowed: bool = False, prerounded: bool = False, backward: bool = False,
) -> TritonPlan:
    """``triton_plan`` with ``prerounded`` decided.

    ``prerounded``: the operands are rounded to TF32
    into scratch buffers that count against the budget: x whole (4 N H bytes, while at
    most half the budget; else an x-sized temporary beside it, as the fp32 dx
    accumulator of 16-bit inputs) and W in
    chunks (4 H bytes per row): ``w_chunk`` rows per forward launch (what the budget
    leaves after x and the kept columns, at least the backward's chunk floor), and
    per recomputed backward chunk its vocab_chunk rows, budgeted with its dz columns.
    The forward's splits are then sized by the W chunk (enough programs per launch).
    ``backward``: the plan of a backward (pre-rounded tiles: the gradient's, as with
    ``keep_allowed``; nothing else changes)."""
    if tiles is None:
        tiles = _tiles(num_tokens, vocab, hidden, itemsize, device, prerounded, keep_allowed or backward)
    block_n, block_v, block_h, num_warps, num_stages = tiles
    row_blocks = math.ceil(num_tokens / block_n)
    vocab_blocks = math.ceil(vocab / block_v)
    # Scratch of the pre-rounded operands: x (taken off the budget while it is at most
    # half of it; larger, an x-sized temporary as the 16-bit dx accumulator), W rows.
    w_col = 4 * hidden if prerounded else 0
    if prerounded and 4 * num_tokens * hidden <= budget // 2:
        budget -= 4 * num_tokens * hidden
    # Many programs per SM so that the last wave is a small fraction of the work (with
    # ~2 waves of long programs the forward ran at 1.5-1.9x a GEMM: docs/design.md).
    want = math.ceil(WAVES * num_sms(device) / max(1, row_blocks))
    blocks_per_split = math.ceil(vocab_blocks / _clamp(want, 1, vocab_blocks))
    if device.type == "cuda" and itemsize == 2:
        blocks_per_split = forward_blocks_per_split(row_blocks, vocab_blocks, math.ceil(hidden / block_h),
                                                    num_sms(device), blocks_per_split)
    vocab_splits = math.ceil(vocab_blocks / blocks_per_split)

    # Backward. Kept columns cost itemsize + 4/block_v bytes per token each and save a
    # recomputed GEMM; recomputed ones need an fp32 (tokens x hidden) dx accumulator
    # and a chunk of dz. Keep everything if the budget holds it, else keep what the
    # budget leaves after the accumulator and one chunk of MIN_CHUNK columns.
    padded_vocab = vocab_blocks * block_v
    per_col = num_tokens * (itemsize + 4 / block_v)
    # The fp32 dx accumulator is dx itself for fp32 inputs (nothing extra to budget).
    acc = 4 * num_tokens * hidden if itemsize != 4 else 0
    # Never more than a quarter of the vocabulary: small vocabularies still get chunks.
    quarter = max(block_v, padded_vocab // 4 // block_v * block_v)
    min_cols = min(MIN_CHUNK if device.type == "cuda" else 2 * block_v, quarter)
    # Wider recomputed chunks mean fewer passes over the fp32 dx accumulator, but a
    # 4096-column chunk of dz (32 MiB at 4096 tokens) stays in L2 between the kernel
    # that writes it and the two matmuls that read it; ~11k columns ran 5% slower
    # (docs/design.md). What the budget has left goes to kept columns instead.
    chunk_col = itemsize * num_tokens + w_col  # a recomputed column: dz (+ its row of W)
    keep_cols = 0
    if keep_allowed:
        if budget >= per_col * vocab + w_col * min_cols:
            keep_cols = vocab
        else:
            left = budget - acc - chunk_col * min_cols
            keep_cols = _clamp(int(left // per_col) // block_v * block_v, 0, padded_vocab)
    left = budget - acc - per_col * keep_cols
    cols = int(max(left, 0) // max(1, chunk_col))
    # Below MIN_CHUNK columns the fp32 accumulator's read-modify-write dominates each
    # dx matmul (64 MiB budget at 4096 tokens ran at 7x three GEMMs): use the floor.
    vocab_chunk = _clamp(cols // block_v * block_v, min_cols, padded_vocab)
    if device.type == "cuda":  # GPUs: the cost model's choice
        keep_cols, vocab_chunk = _model_columns(
            num_tokens, vocab, hidden, itemsize, budget - w_col * min_cols, device, block_v, min_cols,
            keep_allowed)
        if prerounded:  # the model does not know the W chunk: shrink to the budget
            keep_cols, vocab_chunk = _fit_w_chunk(keep_cols, vocab_chunk, per_col, chunk_col, budget,
                                                  block_v, min_cols, vocab)
    if device.type == "cuda" and keep_cols >= vocab and vocab % ODD_V_ALIGN:
        # cuBLAS ran the kept columns' dx GEMM 8x slower with K = V odd (gpt2's 50257:
        # 41 ms against 5 ms, docs/design.md): keep whole tiles, recompute the ragged tail.
        keep_cols = vocab // block_v * block_v
        vocab_chunk = _clamp(vocab_chunk, block_v, padded_vocab)
    w_chunk = 0
    if prerounded:
        w_chunk, vocab_splits = _forward_w_chunk(
            budget - per_col * keep_cols, w_col, block_v, vocab_blocks, row_blocks, device, min_cols)
    plan = TritonPlan(
        block_n=block_n,
        block_v=block_v,
        block_h=block_h,
        num_warps=num_warps,
        num_stages=num_stages,
        vocab_splits=vocab_splits,
        vocab_chunk=vocab_chunk,
        keep_cols=keep_cols,
        **kernel_options(num_tokens, block_n, block_v, device),
        w_chunk=w_chunk,
    )
    plan = _rocm.adapt_plan(plan, device)  # AMD GPUs: no TMA
    reshape = _what_ifs().plan
    return reshape(plan) if reshape is not None else plan


@dataclass(frozen=True)
class TF32Choice:
    """The planner's choice for fp32 at matmul precision "high" (``tf32_choice``): the
    pre-rounded and in-kernel plans of a call, their predicted times
    (``cost_model.Candidate``: ``fwd_s``, ``time_s`` = forward + backward when a
    backward follows) and which one runs."""

    prerounded: bool
    pre_plan: TritonPlan
    in_kernel_plan: TritonPlan
    pre: object  # cost_model.Candidate
    in_kernel: object

    @property
    def plan(self) -> TritonPlan:
        return self.pre_plan if self.prerounded else self.in_kernel_plan


@memoised
def tf32_choice(num_tokens: int, vocab: int, hidden: int, budget: int, device, tiles=None,
                grad: bool = True) -> TF32Choice:
    """Pre-rounded or in-kernel rounding for fp32 inputs at "high", by the cost model
    (``cost_model.predict_tf32``): both plans are made for the call as its forward sees
    it (``keep_allowed=grad``: a backward follows) and priced on the forward alone, or
    forward + backward with ``grad``; the cheaper wins (ties: pre-rounded). The price
    of the pre-rounded plan counts its rounding passes (x once per pass, W whole in the
    forward's chunks and the recomputed columns' rows in the backward), a launch and
    ``tf32_chunk_s`` per W chunk, and what its scratch takes from the budget: fewer
    kept columns, so more columns recomputed chunk by chunk. The backward asks with
    ``grad=True`` too (``triton_plan(..., backward=True)``), so both passes of a call
    take the same path. Deterministic: shape, budget and device class only.

    ``override(tf32_preround=True/False)`` bypasses this (``triton_plan``)."""
    from logitless.planning import cost_model as _cost_model

    dev = _device_model(device)
    plans, prices = {}, {}
    for pre in (True, False):
        p = _triton_plan(num_tokens, vocab, hidden, 4, budget, device, tiles, keep_allowed=grad, prerounded=pre)
        plans[pre] = p
        prices[pre] = _cost_model.predict_tf32(
            dev, num_tokens, hidden, vocab, prerounded=pre, keep_cols=p.keep_cols, vocab_chunk=p.vocab_chunk,
            w_chunk=p.w_chunk, block_v=p.block_v, grad=grad)
    chosen = prices[True].time_s <= prices[False].time_s
    return TF32Choice(prerounded=chosen, pre_plan=plans[True], in_kernel_plan=plans[False], pre=prices[True],
                      in_kernel=prices[False])


def _fit_w_chunk(keep_cols, vocab_chunk, per_col, chunk_col, budget, block_v, min_cols, vocab):
    """(keep_cols, vocab_chunk) shrunk until kept columns + one recomputed chunk (dz and
    its rounded rows of W) fit ``budget``: the chunk first, down to min_cols, then the
    kept columns (whole tiles)."""
    if keep_cols >= vocab:
        return keep_cols, vocab_chunk
    fit = int(max(0, budget - per_col * keep_cols) // max(1, chunk_col)) // block_v * block_v
    vocab_chunk = max(min(vocab_chunk, fit), min_cols)
    if per_col * keep_cols + chunk_col * vocab_chunk > budget:
        keep_cols = int(max(0, budget - chunk_col * vocab_chunk) // per_col) // block_v * block_v
    return keep_cols, vocab_chunk


def _forward_w_chunk(left, w_col, block_v, vocab_blocks, row_blocks, device, min_cols):
    """(w_chunk, vocab_splits) of a forward over W rounded to TF32 in chunks: the rows
    ``left`` bytes hold (at least min_cols, the backward's chunk floor: launches of
    enough programs), whole splits of blocks_per_split tiles, the splits sized as in
    ``triton_plan`` but over one chunk (WAVES programs per SM in each launch)."""
    floor = math.ceil(min_cols / block_v)
    chunk_blocks = _clamp(int(max(0, left) // max(1, w_col * block_v)), floor, vocab_blocks)
    want = math.ceil(WAVES * num_sms(device) / max(1, row_blocks))
    per_split = math.ceil(chunk_blocks / _clamp(want, 1, chunk_blocks))
    splits = math.ceil(vocab_blocks / per_split)
    if chunk_blocks < vocab_blocks:  # whole splits per launch (else all of W at once)
        chunk_blocks = max(chunk_blocks // per_split, math.ceil(floor / per_split)) * per_split
    return min(chunk_blocks, vocab_blocks) * block_v, splits


#: The GEMM kernels' scheduling options (``kernel_options``; docs/design.md "Forward kernel").
KERNEL_OPTIONS = dict(group=True, flatten=True, dz_tma=False, dlogits_programs=1)


def group_rows(block_n: int, block_v: int, device) -> int:
    """Row blocks per group of the GEMM kernels' program order. The programs resident
    at once (one per SM) cover G row blocks x SMs / G column tiles, so at each step they
    read G * block_n rows of x and (SMs / G) * block_v rows of W, H elements each: the
    L2 working set, least at G = sqrt(SMs * block_v / block_n) (16 on an H100 with
    128 x 256 tiles: 34 MB at H = 4096; "all rows" at 16k tokens needed 128 MB of x and
    ran the forward at 1.21-1.27x a GEMM, 1.02-1.05x grouped: docs/design.md "Forward kernel")."""
    return group_rows_for(num_sms(device), block_n, block_v)


def kernel_options(num_tokens: int, block_n: int, block_v: int, device) -> dict:
    """Program order and pipelining of the fused GEMM kernels (``TritonPlan.group_n``,
    ``flatten``, ``dz_tma``, ``dlogits_programs``). Results are the same bitwise
    whichever is chosen: only the order in which tiles run changes."""
    o = KERNEL_OPTIONS
    row_blocks = math.ceil(num_tokens / block_n)
    group_n = group_rows(block_n, block_v, device) if o["group"] else 0
    programs = o["dlogits_programs"] if row_blocks >= PERSISTENT_MIN_ROW_BLOCKS else 0
    return dict(group_n=int(group_n), flatten=bool(o["flatten"]), dz_tma=bool(o["dz_tma"]),
                dlogits_programs=int(programs))


def _tiles(num_tokens, vocab, hidden, itemsize, device, prerounded=False, keep=False):
    """Forced, tuned (this machine's cache) or shipped tiles (``tuned``), else the tables
    above; fp32 on pre-rounded operands: forced, tuned under their own key
    (``tuned.config_key(..., prerounded=True)``, plans with a backward) or
    ``CUDA_TILES_TF32``."""
    from logitless.planning import tuned as _tuned

    if prerounded:
        forced = _overrides().tiles
        if forced is not None:
            return forced
        if device.type != "cuda":
            return INTERPRETER_TILES
        # The tuner's pre-rounded entries (their own key: never the in-kernel path's
        # tiles, nor the reverse) are for plans with a backward, what the tuner times.
        found = _tuned.tiles_for(device, 4, num_tokens, hidden, vocab, prerounded=True) if keep else None
        return found or _rocm.tiles(device, 4) or CUDA_TILES_TF32[bool(keep)]
    found = _tuned.tiles_for(device, itemsize, num_tokens, hidden, vocab)
    if found is not None:
        return found
    if device.type != "cuda":
        return INTERPRETER_TILES
    return _rocm.tiles(device, itemsize) or CUDA_TILES[itemsize]  # AMD GPUs: planning.rocm's table


#: Kept columns (and gradient-in-forward, which keeps every column of a token chunk) need
#: a vocabulary that is a multiple of this on GPUs (see triton_plan).
ODD_V_ALIGN = 8

def _device_model(device):
    from logitless.planning import cost_model as _cost_model

    return _what_ifs().device_model or _cost_model.device_model(device)


def _model_columns(num_tokens, vocab, hidden, itemsize, budget, device, block_v, min_cols, keep_allowed):
    """(keep_cols, vocab_chunk) of the cost model's fastest keep/partial plan that fits."""
    from logitless.planning import cost_model as _cost_model

    c = _cost_model.choose(num_tokens, hidden, vocab, itemsize, budget, device_model=_device_model(device),
                           grad_in_forward=False, keep=keep_allowed, block_v=block_v, min_chunk=min_cols)
    padded = math.ceil(vocab / block_v) * block_v
    if c.strategy == "keep":
        return vocab, padded
    return c.keep_cols, _clamp(c.vocab_chunk, block_v, padded)


@memoised
def lce_strategy(num_tokens, vocab, hidden, itemsize, budget, device, *, need_grad=True,
                 grad_in_forward_ok=True, keep_allowed=True, weight_fp32=False):
    """The cost model's choice for linear_cross_entropy: a ``cost_model.Candidate``
    (strategy "keep" / "partial" / "grad_in_forward" / "forward", its chunking, memory
    and predicted time). Deterministic: shape, dtype, budget and device class only.

    ``grad_in_forward_ok``: the caller can compute the gradient in the forward (a
    reduction other than "none", kept columns allowed). On the CPU interpreter the
    gradient-in-forward strategy is only used when forced (``overrides``: strategy).
    """
    from logitless.planning import cost_model as _cost_model

    cuda = device.type == "cuda"
    block_v = _tiles(num_tokens, vocab, hidden, itemsize, device)[1]
    padded = math.ceil(vocab / block_v) * block_v
    quarter = max(block_v, padded // 4 // block_v * block_v)  # as in triton_plan
    min_chunk = min(MIN_CHUNK if cuda else 2 * block_v, quarter)
    forced = _overrides().strategy
    if forced is not None and need_grad:
        strategy, token_chunk = forced
        return _cost_model.Candidate(strategy, token_chunk=max(1, min(token_chunk or num_tokens, num_tokens)))
    if vocab % ODD_V_ALIGN:  # its per-chunk GEMMs over all V columns hit cuBLAS' slow odd-K path
        grad_in_forward_ok = False
    return _cost_model.choose(
        num_tokens, hidden, vocab, itemsize, budget, device_model=_device_model(device),
        need_grad=need_grad, grad_in_forward=grad_in_forward_ok and cuda, keep=keep_allowed,
        weight_fp32=weight_fp32, block_v=block_v, min_chunk=min_chunk)


@dataclass(frozen=True)
class LinearPlan:
    """The plan of one call of linear_cross_entropy or linear_log_probs on the Triton
    backend: decided once, in the forward custom op's implementation (the backend's
    ``plan``), and handed as is to the fake (kept shapes), the forward, the
    gradient-in-forward strategy and the backward (``ops.common.plan_codec`` where it
    crosses a custom op as a tensor).

    forward: the forward's launches; with ``keeps`` it keeps exp(z - m) of its first
        ``forward.keep_cols`` columns for the backward, which then runs on this plan.
    backward: the backward's plan when no kept column is there (the forward kept none,
        or a second backward after the first spent them): every column recomputed.
    keeps: the forward keeps columns (a gradient follows, dtype and options allow it,
        the budget holds some).
    grad_in_forward: tokens per chunk of the gradient-in-forward strategy (0: not
        used); ``chunk``: a chunk's plan (every column kept), ``tail``: the last,
        shorter chunk's (None when one size serves every chunk).
    cute, chunk_cute, tail_cute: the CuTe DSL forward's plan (``planning.cute``) of the
        forward, of a chunk and of the tail chunk, or None (the Triton kernel).
    """

    forward: TritonPlan
    backward: TritonPlan
    keeps: bool = False
    grad_in_forward: int = 0
    chunk: Optional[TritonPlan] = None
    tail: Optional[TritonPlan] = None
    cute: Optional[CutePlan] = None
    chunk_cute: Optional[CutePlan] = None
    tail_cute: Optional[CutePlan] = None


@memoised
def linear_plan(num_tokens: int, vocab: int, hidden: int, itemsize: int, budget: int, device, *,
                keep_allowed: bool, prerounded: bool, grad_in_forward: bool = False,
                weight_fp32: bool = False) -> LinearPlan:
    """The Triton part of a ``LinearPlan`` (the CuTe choice needs the tensors: the
    backends add it). ``keep_allowed``: a backward follows and the forward may keep
    columns; ``prerounded``: ``launch.tf32_prerounded`` of the dtype;
    ``grad_in_forward``: the caller allows that strategy (eager, a reduced loss, kept
    columns allowed), which ``lce_strategy`` then picks or not."""
    forward = triton_plan(num_tokens, vocab, hidden, itemsize, budget, device, keep_allowed=keep_allowed,
                          prerounded=prerounded)
    backward = triton_plan(num_tokens, vocab, hidden, itemsize, budget, device, keep_allowed=False,
                           prerounded=prerounded, backward=True)
    keeps = keep_allowed and forward.keep_cols > 0
    if grad_in_forward and num_tokens > 0:
        c = lce_strategy(num_tokens, vocab, hidden, itemsize, budget, device, need_grad=True,
                         grad_in_forward_ok=True, keep_allowed=True, weight_fp32=weight_fp32)
        if c.strategy == "grad_in_forward":
            chunk = min(c.token_chunk, num_tokens)
            tail = num_tokens % chunk

            def every_column(rows):  # (the in-kernel tf32 plan: the chunks' forward rounds in registers)
                p = triton_plan(rows, vocab, hidden, itemsize, budget, device, keep_allowed=True)
                return replace(p, keep_cols=vocab)

            return LinearPlan(forward, backward, keeps, grad_in_forward=chunk, chunk=every_column(chunk),
                              tail=every_column(tail) if tail else None)
    return LinearPlan(forward, backward, keeps)


# --------------------------------------------------------------------------- cross_entropy


def ce_torch_plan(num_tokens: int, vocab: int, itemsize: int, budget: int) -> int:
    """Rows per chunk of the PyTorch backend of cross_entropy.

    Each chunk holds about 4 (rows x V) temporaries in the compute dtype (the upcast
    copy, exp, the target mask and the soft-cap copy of the backward). One row is the
    least: the budget can never force a row to be split.
    """
    return _clamp(budget // max(1, 4 * vocab * itemsize), 1, max(1, num_tokens))


@dataclass(frozen=True)
class CETritonPlan:
    """Launch configuration of the Triton backend of cross_entropy.

    block_n x block_v: the tile of logits one program holds per step (block_n rows,
    streamed over the vocabulary in block_v-wide steps in the forward; one tile per
    program in the backward).
    """

    block_n: int
    block_v: int
    num_warps: int


def ce_triton_plan(num_tokens: int, vocab: int, itemsize: int, device) -> CETritonPlan:
    """About 16 KiB of logits per step; several rows per program when V is small."""
    if device.type == "cuda":
        tile, max_block_v, num_warps = 16384 // itemsize, 4096, 8
    else:  # TRITON_INTERPRET=1: small tiles, still exercising every mask
        tile, max_block_v, num_warps = 256, 64, 4
    block_v = min(max_block_v, 1 << max(0, vocab - 1).bit_length())
    rows = 1 << max(0, num_tokens - 1).bit_length()
    block_n = _clamp(tile // block_v, 1, rows)
    return CETritonPlan(block_n=block_n, block_v=block_v, num_warps=num_warps)


# --------------------------------------------------------------------------- distillation


@dataclass(frozen=True)
class JSDStatsPlan:
    """Launch of the distillation row statistics (``triton_lib.jsd_rows.row_stats``):
    block_n x block_v tiles (``ce_triton_plan``), each row split over ``splits``
    programs of ``blocks_per_split`` column blocks each (1: one program per row block)."""

    block_n: int
    block_v: int
    num_warps: int
    splits: int
    blocks_per_split: int


def jsd_stats_plan(num_tokens: int, vocab: int, itemsize: int, device) -> JSDStatsPlan:
    """Split rows when there are too few row blocks for ~WAVES programs per SM (a few
    hundred rows of a 128k+ vocabulary: linear_jsd's chunks), so the sweeps run at
    bandwidth instead of one long latency-bound program per row; no split (the single
    kernel, bitwise as before) when the row blocks alone fill the device."""
    t = ce_triton_plan(num_tokens, vocab, itemsize, device)
    row_blocks = math.ceil(max(1, num_tokens) / t.block_n)
    vocab_blocks = math.ceil(max(1, vocab) / t.block_v)
    programs = WAVES * num_sms(device)
    # at least WAVES / 2 row programs per SM already: one program per row block
    want = 1 if 2 * row_blocks >= programs else _clamp(math.ceil(programs / row_blocks), 1, vocab_blocks)
    per_split = math.ceil(vocab_blocks / want)
    return JSDStatsPlan(block_n=t.block_n, block_v=t.block_v, num_warps=t.num_warps,
                        splits=math.ceil(vocab_blocks / per_split), blocks_per_split=per_split)


def jsd_torch_rows(num_tokens: int, vocab: int, itemsize: int, budget: int) -> int:
    """Rows per chunk of the PyTorch backends of jsd / linear_jsd (full rows of both
    logits): about 12 (rows x V) temporaries in the compute dtype (both upcast logits,
    both log-probabilities, the mixture, products). One row is the least."""
    return _clamp(budget // max(1, 12 * vocab * itemsize), 1, max(1, num_tokens))


#: Tiles (block_n, block_v, block_h, num_warps, num_stages) of linear_jsd's backward
#: kernel and of the KL limits' fused forward, which hold a student and a teacher tile at
#: once (two fp32 accumulators: half of linear_cross_entropy's block_v keeps them in
#: registers). 16-bit: 4 stages (128 KiB of shared memory) measured f+b 1-4% faster than 3
#: at beta 0.5 and 8-10% at beta 1 (fused forward: 15-18% faster alone); 5 stages no better
#: (H100; docs/design.md).
JSD_CUDA_TILES = {2: (128, 128, 64, 8, 4), 4: (64, 128, 32, 8, 2)}


def jsd_forward_rows(num_tokens: int, vocab: int, budget: int, cuda: bool) -> int:
    """Tokens per chunk of linear_jsd's chunked forward (the Triton and Helion backends):
    both heads' fp32 logits of the chunk (8 V bytes a token) fill ``budget``."""
    rows = budget // max(1, 8 * vocab)
    if cuda and rows >= 16:
        # Multiples of 8, not of 128-row GEMM tiles: each chunk's two GEMMs read both
        # weights once (V (H_s + H_t) itemsize bytes), so at ~200 rows they are bound by
        # that read, not by FLOPs, and rounding 220 rows down to 128 (V = 151936, 256 MiB)
        # took 1.6x the weight traffic (32 chunks of 4096 tokens instead of 20 of 208);
        # 216 (multiples of 8, not 16) makes it 19 chunks (docs/design.md).
        rows = rows // 8 * 8
    return _clamp(rows, 1, max(1, num_tokens))


@dataclass(frozen=True)
class LinearJSDPlan:
    """How linear_jsd's Triton backend chunks its work.

    forward_rows: tokens per forward chunk; both heads' fp32 logits of the chunk
        (2 x rows x V x 4 bytes) are materialised by two cuBLAS GEMMs, then reduced to
        row statistics by the (bandwidth-bound) jsd forward kernel.
    vocab_chunk: columns of dz recomputed at once in the backward (a multiple of
        block_v), in the input dtype; dx accumulates in fp32 (tokens x H_student).
    tiles: a ``TritonPlan`` for the fused student+teacher logits tiles of the backward,
        and of the KL limits' fused forward (``tiles.vocab_splits``: its splits of the
        vocabulary, ``blocks_per_split`` blocks of block_v columns each).
    """

    forward_rows: int
    vocab_chunk: int
    tiles: TritonPlan
    blocks_per_split: int = 1


@memoised
def linear_jsd_plan(num_tokens: int, vocab: int, hidden_s: int, itemsize: int, budget: int,
                    device, *, hidden_t: int = 0, prerounded: bool = False) -> LinearJSDPlan:
    """``prerounded`` (fp32 at matmul precision "high", ``launch.tf32_prerounded``): the
    backward rounds both x's to TF32 once (4 N (H_s + H_t) bytes, taken off the budget
    while at most half of it) and each recomputed chunk's rows of both weights (4 (H_s +
    H_t) bytes per column, budgeted with the chunk's dz) into scratch buffers, as
    ``triton_plan`` does; ``tiles.w_chunk`` is then the chunk's rows (0: no scratch).
    The forward's logits are cuBLAS GEMMs, which round at "high" themselves."""
    cuda = device.type == "cuda"
    tiles = _overrides().tiles or (
        (_rocm.tiles(device, itemsize, jsd=True) or JSD_CUDA_TILES[itemsize]) if cuda else INTERPRETER_TILES)
    block_n, block_v, block_h, num_warps, num_stages = tiles
    rows = jsd_forward_rows(num_tokens, vocab, budget, cuda)
    padded_vocab = math.ceil(vocab / block_v) * block_v
    min_cols = min(MIN_CHUNK if cuda else 2 * block_v, max(block_v, padded_vocab // 4 // block_v * block_v))
    # linear_cross_entropy measured 4096-column chunks faster than wider ones (a 32 MiB
    # dz chunk at 4096 tokens stays in L2: docs/design.md); narrower only if the budget
    # after the fp32 dx accumulator says so, never below min_cols.
    w_col = 4 * (hidden_s + hidden_t) if prerounded else 0
    x_scratch = 4 * num_tokens * (hidden_s + hidden_t) if prerounded else 0
    if x_scratch and x_scratch <= budget // 2:
        budget -= x_scratch
    left = budget - 4 * num_tokens * hidden_s
    cols = int(max(left, 0) // max(1, itemsize * num_tokens + w_col))
    vocab_chunk = _clamp(min(cols, MIN_CHUNK) // block_v * block_v, min_cols, padded_vocab)
    # The KL limits' fused forward (``jsd_kl_forward_kernel``): splits of the vocabulary
    # for ~WAVES programs per SM, as linear_cross_entropy's forward.
    row_blocks = math.ceil(max(1, num_tokens) / block_n)
    vocab_blocks = math.ceil(max(1, vocab) / block_v)
    want = math.ceil(WAVES * num_sms(device) / row_blocks)
    blocks_per_split = math.ceil(vocab_blocks / _clamp(want, 1, vocab_blocks))
    plan = TritonPlan(block_n=block_n, block_v=block_v, block_h=block_h, num_warps=num_warps,
                      num_stages=num_stages, vocab_splits=math.ceil(vocab_blocks / blocks_per_split),
                      vocab_chunk=vocab_chunk,
                      **kernel_options(num_tokens, block_n, block_v, device),  # group_n is used
                      w_chunk=vocab_chunk if prerounded else 0)
    plan = _rocm.adapt_plan(plan, device)  # AMD GPUs: no TMA
    return LinearJSDPlan(forward_rows=rows, vocab_chunk=vocab_chunk, tiles=plan, blocks_per_split=blocks_per_split)


@memoised
def jsd_kl_fused(num_tokens: int, vocab: int, hidden_s: int, hidden_t: int, itemsize: int, budget: int,
                 device) -> bool:
    """For the KL limits on 16-bit inputs: does linear_jsd's forward take the fused kernel
    (``jsd_kl_forward_kernel``) rather than cuBLAS fp32 logit chunks of ``linear_jsd_plan``'s
    forward_rows? ``override(jsd_fused_forward=True/False)`` decides; by default the cost
    model (``cost_model.jsd_kl_fused_faster``)."""
    forced = _overrides().jsd_fused_forward
    if forced is not None:
        return forced
    rows = linear_jsd_plan(num_tokens, vocab, hidden_s, itemsize, budget, device).forward_rows
    from logitless.planning import cost_model as _cost_model

    return _cost_model.jsd_kl_fused_faster(_device_model(device), num_tokens, hidden_s, hidden_t, vocab, itemsize,
                                           rows)


def linear_jsd_strategy(num_tokens: int, vocab: int, hidden_s: int, hidden_t: int, itemsize: int, budget: int,
                        device, *, weight_fp32: bool = False, fused_forward: bool = False):
    """The cost model's choice for linear_jsd (``cost_model.choose_jsd``): a Candidate with
    strategy "recompute" (the default two-pass design) or "grad_in_forward" and its
    token chunk. The gradient-in-forward strategy is chosen on GPUs only (the CPU
    interpreter uses it when forced: ``override(strategy=("grad_in_forward", tokens))``),
    and only when the vocabulary is a multiple of ODD_V_ALIGN (cuBLAS' slow odd-K path)."""
    from logitless.planning import cost_model as _cost_model

    forced = _overrides().strategy
    if forced is not None:
        name, token_chunk = forced
        return _cost_model.Candidate(name, token_chunk=max(1, min(token_chunk or num_tokens, num_tokens)))
    gif_ok = device.type == "cuda" and vocab % ODD_V_ALIGN == 0
    return _cost_model.choose_jsd(num_tokens, hidden_s, hidden_t, vocab, itemsize, budget,
                                  device_model=_device_model(device), grad_in_forward=gif_ok,
                                  weight_fp32=weight_fp32, fused_forward=fused_forward)

