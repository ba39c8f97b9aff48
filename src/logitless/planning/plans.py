"""Plans of the fused linear ops, shared by linear_cross_entropy and linear_log_probs
(and the pieces linear_jsd's own planner builds on): the PyTorch backends' tiles
(``torch_plan``), the Triton launch plan (``triton_plan``: splits, kept columns,
recomputed chunks, the TF32 scratch), the TF32 route (``tf32_choice``), the kernels'
program order (``kernel_options``), the strategy (``lce_strategy``) and the plan of one
call (``linear_plan``).

Everything here decides *how* (not *what*) is computed, so tuning never touches the
math or the kernels. What a plan reads of the device is its ``device.DeviceFacts``
(``device`` arguments: a torch device or the facts themselves), and each device runs the
one rule its planning model names (``DeviceFacts.gpu``). Where each decision is made,
these and every other: the map in ``planning/__init__.py``'s docstring.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Optional

from logitless.planning import device as _device
from logitless.planning import rocm as _rocm
from logitless.planning.memo import memoised
from logitless.planning.overrides import current as _overrides
from logitless.planning.tiles import (
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


def clamp(v: int, lo: int, hi: int) -> int:
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

    token_chunk = clamp(num_tokens, 1, 2048)
    vocab_chunk = clamp(cols_for(token_chunk), 1, vocab)
    if vocab_chunk < min(vocab, 256) and token_chunk > 1:
        # A tiny budget: trade rows for columns so that each matmul stays reasonable.
        vocab_chunk = min(vocab, 256)
        tokens = (budget - vocab_chunk * col_bytes) // (tiles * vocab_chunk * itemsize + row)
        token_chunk = clamp(tokens, 1, num_tokens)
    return TorchPlan(token_chunk=token_chunk, vocab_chunk=vocab_chunk)


# --------------------------------------------------------------------------- Triton


def num_sms(device) -> int:
    """Multiprocessors the plans assume on ``device`` (its ``DeviceFacts.sms``: a GPU's
    own, a few on the interpreter)."""
    return _device.facts(device).sms


def wave_blocks_per_split(row_blocks: int, vocab_blocks: int, device) -> int:
    """Column blocks per split of a forward over ``vocab_blocks`` blocks of the vocabulary
    (of a W chunk, with TF32 scratch) so that with ``row_blocks`` row blocks there are
    about WAVES programs per SM: with ~2 waves of long programs the forward ran at
    1.5-1.9x a GEMM, and many programs per SM make the last wave a small fraction of the
    work (docs/design.md). linear_cross_entropy's and linear_log_probs' forward
    (``triton_plan``) and linear_jsd's fused KL forward split by it."""
    want = math.ceil(WAVES * num_sms(device) / max(1, row_blocks))
    return math.ceil(vocab_blocks / clamp(want, 1, vocab_blocks))


def min_chunk_cols(vocab: int, block_v: int, device) -> int:
    """The floor of a backward's recomputed chunk (columns): MIN_CHUNK on GPUs (below
    it the fp32 dx accumulator's read-modify-write dominates each dx matmul), two tiles
    on the interpreter, never more than a quarter of the vocabulary (small vocabularies
    still get chunks). ``triton_plan``, ``lce_strategy`` (the cost model's candidates)
    and linear_jsd's planner use it."""
    padded = math.ceil(vocab / block_v) * block_v
    quarter = max(block_v, padded // 4 // block_v * block_v)
    return min(MIN_CHUNK if _device.facts(device).gpu else 2 * block_v, quarter)


def forced_strategy(num_tokens: int):
    """The strategy ``override(strategy=(name, token_chunk))`` forces, as a
    ``cost_model.Candidate`` (token_chunk clamped to [1, num_tokens], 0 or None: every
    token), or None when none is forced (``lce_strategy``, linear_jsd's strategy)."""
    forced = _overrides().strategy
    if forced is None:
        return None
    from logitless.planning import cost_model as _cost_model

    name, token_chunk = forced
    return _cost_model.Candidate(name, token_chunk=max(1, min(token_chunk or num_tokens, num_tokens)))


@memoised
def triton_plan(
    num_tokens: int, vocab: int, hidden: int, itemsize: int, budget: int, device,
    tiles=None, keep_allowed: bool = False, prerounded: bool = False, backward: bool = False,
    kept_owned: bool = True,
) -> TritonPlan:
    """Launch plan for the shape and budget; ``tiles`` overrides the tile table.
    ``keep_allowed``: a backward will follow and may use columns kept by the forward.
    ``kept_owned``: that backward may write dz over the kept columns (eager); False through
    the custom ops (``glue.Owned``), where their dz needs memory of its own beside them
    (``kept_dz_chunk``): every column is then kept only where the budget holds that too.

    ``prerounded`` (fp32 at matmul precision "high", ``launch.tf32_prerounded``): the
    operands may be rounded to TF32 into scratch buffers first. Whether they are is the
    planner's choice (``tf32_choice``: the cost model prices this pre-rounded plan
    against the in-kernel one and takes the cheaper), unless
    ``override(tf32_preround=True)`` forces it; the in-kernel plan is the plan of
    ``prerounded=False`` (``w_chunk == 0``: the kernels round in registers). Forward and
    backward of one call make the same choice (both price the forward's plans)."""
    if prerounded and itemsize == 4 and _overrides().tf32_preround is None:
        prerounded = tf32_choice(num_tokens, vocab, hidden, budget, device, tiles,
                                 keep_allowed or backward, kept_owned).prerounded
    return _triton_plan(num_tokens, vocab, hidden, itemsize, budget, device, tiles, keep_allowed, prerounded,
                        backward, kept_owned)


def _triton_plan(
    num_tokens: int, vocab: int, hidden: int, itemsize: int, budget: int, device,
    tiles=None, keep_allowed: bool = False, prerounded: bool = False, backward: bool = False,
    kept_owned: bool = True,
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
    ``keep_allowed``; nothing else changes).

    Kept columns and the recomputed chunk's width follow the device's one rule
    (``DeviceFacts.gpu``): on GPUs the cost model's fastest keep / partial plan that fits
    (``_model_columns``), on the interpreter the greedy rule (``_greedy_columns``)."""
    facts = _device.facts(device)
    if tiles is None:
        tiles = _tiles(num_tokens, vocab, hidden, itemsize, facts, prerounded, keep_allowed or backward)
    block_n, block_v, block_h, num_warps, num_stages = tiles
    row_blocks = math.ceil(num_tokens / block_n)
    vocab_blocks = math.ceil(vocab / block_v)
    # Scratch of the pre-rounded operands: x (taken off the budget while it is at most
    # half of it; larger, an x-sized temporary as the 16-bit dx accumulator), W rows.
    w_col = 4 * hidden if prerounded else 0
    if prerounded and 4 * num_tokens * hidden <= budget // 2:
        budget -= 4 * num_tokens * hidden
    blocks_per_split = wave_blocks_per_split(row_blocks, vocab_blocks, facts)
    if facts.gpu and itemsize == 2:
        blocks_per_split = forward_blocks_per_split(row_blocks, vocab_blocks, math.ceil(hidden / block_h),
                                                    facts.sms, blocks_per_split)
    vocab_splits = math.ceil(vocab_blocks / blocks_per_split)

    # Backward. Kept columns cost itemsize + 4/block_v bytes per token each and save a
    # recomputed GEMM; recomputed ones need an fp32 (tokens x hidden) dx accumulator
    # (dx itself for fp32 inputs: nothing extra to budget) and a chunk of dz (+ its
    # rounded rows of W when pre-rounded).
    padded_vocab = vocab_blocks * block_v
    per_col = num_tokens * (itemsize + 4 / block_v)
    acc = 4 * num_tokens * hidden if itemsize != 4 else 0
    min_cols = min_chunk_cols(vocab, block_v, facts)
    chunk_col = itemsize * num_tokens + w_col  # a recomputed column: dz (+ its row of W)
    if facts.gpu:  # the cost model's choice
        keep_cols, vocab_chunk = _model_columns(
            num_tokens, vocab, hidden, itemsize, budget - w_col * min_cols, facts.model, block_v, min_cols,
            keep_allowed, kept_owned)
        if prerounded:  # the model does not know the W chunk: shrink to the budget
            keep_cols, vocab_chunk = _fit_w_chunk(keep_cols, vocab_chunk, per_col, chunk_col, budget,
                                                  block_v, min_cols, vocab)
        if keep_cols >= vocab and vocab % ODD_V_ALIGN:
            # cuBLAS ran the kept columns' dx GEMM 8x slower with K = V odd (gpt2's 50257:
            # 41 ms against 5 ms, docs/design.md): keep whole tiles, recompute the ragged tail.
            keep_cols = vocab // block_v * block_v
            vocab_chunk = clamp(vocab_chunk, block_v, padded_vocab)
    else:  # the interpreter
        keep_cols, vocab_chunk = _greedy_columns(vocab, budget, keep_allowed, per_col, acc, chunk_col, w_col,
                                                 min_cols, block_v, padded_vocab, num_tokens * itemsize, kept_owned)
    kept_dz_chunk = _kept_dz_chunk(num_tokens, vocab, itemsize, budget, keep_cols, vocab_chunk, per_col, acc,
                                   chunk_col, block_v, min_cols)
    w_chunk = 0
    if prerounded:
        w_chunk, vocab_splits = _forward_w_chunk(
            budget - per_col * keep_cols, w_col, block_v, vocab_blocks, row_blocks, facts, min_cols)
    plan = TritonPlan(
        block_n=block_n,
        block_v=block_v,
        block_h=block_h,
        num_warps=num_warps,
        num_stages=num_stages,
        vocab_splits=vocab_splits,
        vocab_chunk=vocab_chunk,
        keep_cols=keep_cols,
        **kernel_options(num_tokens, block_n, block_v, facts),
        w_chunk=w_chunk,
        kept_dz_chunk=kept_dz_chunk,
    )
    return _rocm.adapt_plan(plan, facts.arch)  # AMD GPUs: no TMA


def _kept_dz_chunk(num_tokens, vocab, itemsize, budget, keep_cols, vocab_chunk, per_col, acc, chunk_col,
                   block_v, min_cols):
    """``TritonPlan.kept_dz_chunk``: the columns of kept dz a backward that cannot write
    over the kept buffer (the custom ops, torch.compile) writes at a time, so that the kept
    columns and dz together stay within the budget: dz of all of them where the budget's
    rest holds it (0: one chunk, as in place), else chunks of what it leaves. With
    recomputed columns that rest is after the fp32 dx accumulator and the recomputed
    chunk's other scratch (its dz is the same buffer), and is at least ``vocab_chunk``
    columns; with every column kept, chunks need the accumulator too (at least ``min_cols``)."""
    if not keep_cols:
        return 0
    col = itemsize * num_tokens
    left = budget - per_col * keep_cols
    if keep_cols < vocab:
        left -= acc + (chunk_col - col) * vocab_chunk
        floor = vocab_chunk // block_v * block_v
    else:
        floor = min_cols
    if col * keep_cols <= left:
        return 0
    if keep_cols >= vocab:  # chunks of every kept column: beside the fp32 dx accumulator
        left -= acc
    step = max(block_v, floor, int(max(0, left) // col) // block_v * block_v)
    return 0 if step >= keep_cols else step


def _greedy_columns(vocab, budget, keep_allowed, per_col, acc, chunk_col, w_col, min_cols, block_v, padded_vocab,
                    col, kept_owned):
    """(keep_cols, vocab_chunk) of the interpreter's rule: keep every column if the budget
    holds them (not ``kept_owned``: and their dz, whole or ``min_cols`` columns beside the
    accumulator), else what it leaves after the dx accumulator and one chunk of ``min_cols``
    columns; the recomputed chunk is what is left then (at least ``min_cols``). At tiny
    shapes and budgets this gives kept columns, recomputed chunks and both at once, so the
    CPU tests reach every kernel path. ``col``: bytes of one column of dz."""
    from logitless.planning.cost_model import unowned_dz_bytes

    keep_cols = 0
    if keep_allowed:
        dz = 0 if kept_owned else unowned_dz_bytes(col, vocab, acc, min_cols)
        if budget >= per_col * vocab + w_col * min_cols + dz:
            keep_cols = vocab
        else:
            left = budget - acc - chunk_col * min_cols
            keep_cols = clamp(int(left // per_col) // block_v * block_v, 0, padded_vocab)
    left = budget - acc - per_col * keep_cols
    cols = int(max(left, 0) // max(1, chunk_col))
    return keep_cols, clamp(cols // block_v * block_v, min_cols, padded_vocab)


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
                grad: bool = True, kept_owned: bool = True) -> TF32Choice:
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

    dev = _device.facts(device).model
    plans, prices = {}, {}
    for pre in (True, False):
        p = _triton_plan(num_tokens, vocab, hidden, 4, budget, device, tiles, keep_allowed=grad, prerounded=pre,
                         kept_owned=kept_owned)
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
    enough programs), whole splits of blocks_per_split tiles, the splits sized by
    ``wave_blocks_per_split`` over one chunk (WAVES programs per SM in each launch)."""
    floor = math.ceil(min_cols / block_v)
    chunk_blocks = clamp(int(max(0, left) // max(1, w_col * block_v)), floor, vocab_blocks)
    per_split = wave_blocks_per_split(row_blocks, chunk_blocks, device)
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

    facts = _device.facts(device)
    if prerounded:
        forced = _overrides().tiles
        if forced is not None:
            return forced
        if not facts.gpu:
            return INTERPRETER_TILES
        # The tuner's pre-rounded entries (their own key: never the in-kernel path's
        # tiles, nor the reverse) are for plans with a backward, what the tuner times.
        found = _tuned.tiles_for(facts, 4, num_tokens, hidden, vocab, prerounded=True) if keep else None
        return found or _rocm.tiles(facts.arch, 4) or CUDA_TILES_TF32[bool(keep)]
    found = _tuned.tiles_for(facts, itemsize, num_tokens, hidden, vocab)
    if found is not None:
        return found
    if not facts.gpu:
        return INTERPRETER_TILES
    return _rocm.tiles(facts.arch, itemsize) or CUDA_TILES[itemsize]  # AMD GPUs: planning.rocm's table


#: Kept columns (and gradient-in-forward, which keeps every column of a token chunk) need
#: a vocabulary that is a multiple of this on GPUs (see triton_plan).
ODD_V_ALIGN = 8


def _model_columns(num_tokens, vocab, hidden, itemsize, budget, model, block_v, min_cols, keep_allowed,
                   kept_owned=True):
    """(keep_cols, vocab_chunk) of the cost model's fastest keep/partial plan that fits,
    priced with ``model`` (a ``cost_model.DeviceModel``)."""
    from logitless.planning import cost_model as _cost_model

    c = _cost_model.choose(num_tokens, hidden, vocab, itemsize, budget, device_model=model,
                           grad_in_forward=False, keep=keep_allowed, block_v=block_v, min_chunk=min_cols,
                           kept_owned=kept_owned)
    padded = math.ceil(vocab / block_v) * block_v
    if c.strategy == "keep":
        return vocab, padded
    return c.keep_cols, clamp(c.vocab_chunk, block_v, padded)


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

    facts = _device.facts(device)
    block_v = _tiles(num_tokens, vocab, hidden, itemsize, facts)[1]
    min_chunk = min_chunk_cols(vocab, block_v, facts)
    forced = forced_strategy(num_tokens) if need_grad else None
    if forced is not None:
        return forced
    if vocab % ODD_V_ALIGN:  # its per-chunk GEMMs over all V columns hit cuBLAS' slow odd-K path
        grad_in_forward_ok = False
    return _cost_model.choose(
        num_tokens, hidden, vocab, itemsize, budget, device_model=facts.model,
        need_grad=need_grad, grad_in_forward=grad_in_forward_ok and facts.gpu, keep=keep_allowed,
        weight_fp32=weight_fp32, block_v=block_v, min_chunk=min_chunk)


@dataclass(frozen=True)
class LinearPlan:
    """The plan of one call of linear_cross_entropy or linear_log_probs on the Triton
    backend: decided once, in the forward custom op's implementation (the backend's
    ``plan``), and handed as is to the fake (kept shapes), the forward, the
    gradient-in-forward strategy and the backward (the backward custom op plans it again:
    a pure, memoised function of the call).

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
                weight_fp32: bool = False, kept_owned: bool = True) -> LinearPlan:
    """The Triton part of a ``LinearPlan`` (the CuTe choice needs the tensors: the
    backends add it). ``keep_allowed``: a backward follows and the forward may keep
    columns; ``kept_owned``: that backward owns them (``triton_plan``); ``prerounded``:
    ``launch.tf32_prerounded`` of the dtype;
    ``grad_in_forward``: the caller allows that strategy (eager, a reduced loss, kept
    columns allowed), which ``lce_strategy`` then picks or not."""
    forward = triton_plan(num_tokens, vocab, hidden, itemsize, budget, device, keep_allowed=keep_allowed,
                          prerounded=prerounded, kept_owned=kept_owned)
    backward = triton_plan(num_tokens, vocab, hidden, itemsize, budget, device, keep_allowed=False,
                           prerounded=prerounded, backward=True, kept_owned=kept_owned)  # (the forward's tf32 choice)
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
