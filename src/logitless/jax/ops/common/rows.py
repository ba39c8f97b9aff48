"""What the JAX ops whose statistics need full rows share (linear_jsd: the mixture's
divergence needs both heads' log-sum-exps before any column's term; linear_topk_kl:
the same pass that finds the tail's log-sum-exp gives the unit gradient): the forward
runs over chunks of rows with every column of them, and may keep the leading columns
of each token's d(logits) for the backward (``planning.rows_plan``).

    forward   for each chunk of rows (``chunks.chunk_loop``): the heads' fp32 logits of
              the chunk's full (local) rows, their statistics merged over the vocabulary
              devices (``VocabMerge``: one MAX and one SUM per merge), the per-token
              terms, and with ``keep`` columns, dz of those columns for the upstream
              gradient 1 (in the input dtype; written into a (tokens, keep) buffer)
    backward  the kept columns: two GEMMs (``kept_gradients``: dx = g (dz @ W_kept),
              dW_kept = dz^T (g x)); the others: recomputed tiles (``recompute_gradients``:
              the op's ``dz_tile`` gives each (rows x columns) tile's fp32 dz, then
              dx += dz @ W_tile and dW_tile += dz^T x, as linear_cross_entropy's "xla"
              backward)

With every column kept the forward and the backward together are the GEMM floor (the
heads' logits, dx, dW); no (tokens x vocab) tensor exists beyond what the budget holds.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp
from jax import lax

from logitless.jax.ops.common.chunks import chunk_loop, put, take, uninitialised
from logitless.jax.ops.common.contract import Backend, BackendTable, vh_shape
from logitless.jax.planning import RowsPlan, XlaPlan, rows_plan
from logitless.jax.sharding import sum_over, to_varying, varying, vocab_offset

F32 = jnp.float32

#: Contracting dimensions by weight layout ("vh": a w tile is (v, H); "hv": (H, v)):
#: z = x @ w^T, dx = dz @ w, dw = dz^T @ x ("vh") or x^T @ dz ("hv").
Z_DIMS = {"vh": (((1,), (1,)), ((), ())), "hv": (((1,), (0,)), ((), ()))}
DX_DIMS = {"vh": (((1,), (0,)), ((), ())), "hv": (((1,), (1,)), ((), ()))}
W_AXIS = {"vh": 0, "hv": 1}


@dataclass(frozen=True)
class RowsConfig:
    """The Config of a full-rows op's backend (its ``plan_rows``): the forward's chunks
    without a backward (``plain``: nothing kept) and with one (``grad``: the kept
    columns), and the kind's Config (``XlaConfig``, ``TritonConfig``, ...) that recomputes
    the columns not kept, planned with the budget the kept ones leave."""

    plain: RowsPlan
    grad: RowsPlan
    recompute: Any

    @property
    def weight_layout(self) -> str:
        return self.recompute.weight_layout


def plan_rows(backend, x2d_shape, w_shape, dtype, *, budget: int, weight_layout: str, arrays: int = 1,
              heads: int = 1, keep: bool = True, kept_copies: int = 1) -> RowsConfig:
    """``backend``'s RowsConfig for x (N, H) and a weight of ``w_shape`` (V, H) with
    ``arrays`` fp32 arrays of a forward chunk's full rows (``planning.rows_plan``) and
    ``heads`` heads whose logits the recomputed tiles hold: the kind's ``plan`` sizes them
    with the budget the kept dz leaves (divided among the heads; at least a quarter of
    the budget). ``keep``: the differentiated forward may keep columns (False: none);
    ``kept_copies``: buffers of that size per kept column (2: the dz written beside what
    the forward kept, not over it)."""
    n, _ = x2d_shape
    v = w_shape[0]
    isz = jnp.dtype(dtype).itemsize
    kisz = isz * kept_copies  # rows_plan's itemsize sizes only the kept columns
    plain = rows_plan(n, v, isz, budget, arrays=arrays)
    grad = rows_plan(n, v, kisz, budget, arrays=arrays, keep=True) if keep else plain
    left = max(budget - n * grad.keep * kisz, budget // 4) // heads
    return RowsConfig(plain, grad, backend.plan(tuple(x2d_shape), tuple(w_shape), dtype, budget=left,
                                                weight_layout=weight_layout))


class RowsBackend(Backend, Protocol):
    """What a full-rows op's backend adds to ``Backend`` for its planning (the op's
    Protocol adds its typed ``forward``/``backward``)."""

    def plan_call(self, x2d_shape: tuple, w_shape: tuple, dtype: Any, *, budget: int,
                  weight_layout: str = "vh") -> RowsConfig:
        """The call's ``RowsConfig`` (``plan_rows``: the kind's ``plan`` sizes the recomputed columns)."""
        ...


def local_backend(table: BackendTable, name: str, x_shape: tuple, w_shape: tuple, dtype, *, budget: int,
                  weight_layout: str):
    """(backend, RowsConfig) for per-device shapes (``w_shape`` in ``weight_layout``):
    backend ``name`` of ``table``, or "xla" where it refuses them; one Config per shapes
    (``_local_plan``), shared by the forward's and the backward's partitions."""
    vh = vh_shape(w_shape, weight_layout)
    backend = table[name]
    if backend.unsupported(tuple(x_shape), vh, dtype, softcap=None, has_bias=False) is not None:
        backend = table["xla"]
    return backend, _local_plan(backend, tuple(x_shape), vh, dtype, budget, weight_layout)


@functools.lru_cache(maxsize=256)
def _local_plan(backend, x_shape: tuple, w_shape: tuple, dtype, budget: int, weight_layout: str) -> RowsConfig:
    return backend.plan_call(x_shape, w_shape, dtype, budget=budget, weight_layout=weight_layout)


def acc_dtype(dtype):
    """The statistics' and accumulators' dtype: fp32, fp64 for fp64 inputs."""
    return jnp.promote_types(dtype, F32)


def logits(x, w, layout: str):
    """x @ w^T in fp32 (fp64 for fp64 inputs) for x (n, H) and w (v, H) ("vh") or (H, v) ("hv")."""
    return lax.dot_general(x, w, Z_DIMS[layout], preferred_element_type=acc_dtype(x.dtype))


class VocabMerge(NamedTuple):
    """How a chunk's per-token statistics of this device's columns become those of every
    column: over the mesh ``axes`` that split the vocabulary (inside shard_map, or per
    device of a partitioned jit); nothing without axes."""

    axes: tuple = ()

    def offset(self, local_v: int):
        """The first global class of this device's columns."""
        return vocab_offset(self.axes, local_v)

    def lse(self, *lses):
        """The log-sum-exps over all devices' columns of per-device ones (each (rows,)):
        one MAX and one SUM for all of them."""
        if not self.axes:
            return lses
        stacked = jnp.stack(lses)
        m = lax.pmax(stacked, self.axes)
        m = jnp.where(jnp.isfinite(m), m, 0.0)
        s = sum_over(jnp.exp(stacked - m), self.axes)
        out = m + jnp.log(s)
        return tuple(out[i] for i in range(len(lses)))

    def sum(self, *parts):
        """Sums over the devices (one SUM for all of them; each part (rows,) or (rows, k))."""
        if not self.axes:
            return parts
        flat = [p.reshape(p.shape[0], -1) for p in parts]
        sizes = [f.shape[1] for f in flat]
        total = sum_over(jnp.concatenate(flat, axis=1), self.axes)
        out, i = [], 0
        for p, k in zip(parts, sizes):
            out.append(total[:, i:i + k].reshape(p.shape))
            i += k
        return tuple(out)


def varying_like(carry, *refs):
    """Loop carries (a pytree) typed as varying over the manual axes of ``refs`` (inside
    ``jax.shard_map`` with check_vma a carry's type must not change in the loop)."""
    leaves = jax.tree_util.tree_leaves(refs)
    axes = tuple(sorted(frozenset().union(*(varying(r) for r in leaves))))
    if not axes:
        return carry
    return jax.tree_util.tree_map(lambda c: to_varying(c, axes), carry)


def kept_gradients(dz, x2d, w, g, *, layout: str) -> tuple[int, Any, Any]:
    """(start, dx, dW) a backward begins with, from the kept dz (N, keep) of upstream
    gradient 1 (None: nothing kept) and the scalar upstream gradient ``g``: two GEMMs,
    dx = g (dz @ W[:keep]) accumulated in fp32 (``acc_dtype``), dW[:keep] = dz^T (g x) (g
    folded into x: one rounding of g x, none when g is 1) in w's dtype and layout, its
    other columns uninitialised: the recomputed columns [start, V) write them (start = keep).
    dz may have more rows than x (a kernel's padded rows, zero there)."""
    vaxis = W_AXIS[layout]
    acc = acc_dtype(x2d.dtype)
    dw = uninitialised(w.shape, w.dtype)
    n = x2d.shape[0]
    if dz is None:
        return 0, jnp.zeros(x2d.shape, acc), dw
    keep = dz.shape[1]
    wk = lax.slice_in_dim(w, 0, keep, axis=vaxis)
    dx = lax.dot_general(dz, wk, DX_DIMS[layout], preferred_element_type=acc)[:n] * g
    if dz.shape[0] != n:
        x2d = jnp.pad(x2d, ((0, dz.shape[0] - n), (0, 0)))
    xg = (x2d.astype(acc) * g).astype(x2d.dtype)
    pair = (dz, xg) if layout == "vh" else (xg, dz)
    dwk = lax.dot_general(*pair, (((0,), (0,)), ((), ())), preferred_element_type=w.dtype)
    return keep, dx, put(dw, dwk, 0, vaxis)


def recompute_gradients(x2d, w, start: int, plan: XlaPlan, dz_tile: Callable, *, layout: str, dx, dw, refs=()):
    """dx and dW with the columns [start, V) added, recomputed tile by tile: for each
    column chunk of ``plan.vocab_chunk`` and row chunk of ``plan.token_chunk``,
    ``dz_tile(r0, nr, c0, vc)`` -> the tile's fp32 dz (c0: the local column), then
    dx[rows] += dz @ W[cols] and dW[cols] += dz^T x[rows] (fp32 per column chunk, cast
    once and written into ``dw``). ``dx`` (N, H) in ``acc_dtype``; ``dw`` in w's dtype and layout,
    its columns below ``start`` already written. ``refs``: the arrays the tiles read
    (their shard_map types type the carries)."""
    n, h = x2d.shape
    vaxis = W_AXIS[layout]
    vocab = w.shape[vaxis]
    acc = acc_dtype(x2d.dtype)
    if start >= vocab:
        return dx, dw

    def col_step(c0, vc, carry):
        dx, dw = carry
        wj = take(w, c0, vc, vaxis)

        def row_step(r0, nr, carry):
            dx, dwj = carry
            xr = take(x2d, r0, nr)
            dz = dz_tile(r0, nr, c0, vc).astype(x2d.dtype)
            dx = put(dx, take(dx, r0, nr) + lax.dot_general(dz, wj, DX_DIMS[layout], preferred_element_type=acc), r0)
            pair = (dz, xr) if layout == "vh" else (xr, dz)
            return dx, dwj + lax.dot_general(*pair, (((0,), (0,)), ((), ())), preferred_element_type=acc)

        dwj = jnp.zeros((vc, h) if layout == "vh" else (h, vc), acc)
        (dwj,) = varying_like((dwj,), x2d, w, *refs)
        dx, dwj = chunk_loop(n, plan.token_chunk, row_step, (dx, dwj))
        return dx, put(dw, dwj.astype(w.dtype), c0, vaxis)

    dx, dw = varying_like((dx, dw), x2d, w, *refs)
    return chunk_loop(vocab - start, plan.vocab_chunk, lambda c0, vc, c: col_step(start + c0, vc, c), (dx, dw))


def chunk_gradients(x2d, w, start: int, chunk: int, dz_of: Callable, *, layout: str, dx, dw, refs=()):
    """dx and dW with the columns [start, V) added from dz chunks that a kernel writes:
    for each chunk of ``chunk`` columns (a fori_loop; the last, shorter one its own static
    step) ``dz_of(c0, width)`` -> (N, width) dz in x's dtype (c0 the local column), then
    dx += dz @ W[chunk] (fp32) and dW[chunk] = dz^T x (fp32 accumulation in the GEMM,
    written in w's dtype). ``dx`` (N, H) in ``acc_dtype``; ``dw`` in w's dtype and
    layout, its columns below ``start`` already written."""
    vaxis = W_AXIS[layout]
    vocab = w.shape[vaxis]
    acc = acc_dtype(x2d.dtype)
    if start >= vocab:
        return dx, dw

    def step(c0, width, carry):
        dx, dw = carry
        dz = dz_of(c0, width)
        wc = take(w, c0, width, vaxis)
        dx = dx + lax.dot_general(dz, wc, DX_DIMS[layout], preferred_element_type=acc)
        pair = (dz, x2d) if layout == "vh" else (x2d, dz)
        dwc = lax.dot_general(*pair, (((0,), (0,)), ((), ())), preferred_element_type=w.dtype)
        return dx, put(dw, dwc, c0, vaxis)

    dx, dw = varying_like((dx, dw), x2d, w, *refs)
    return chunk_loop(vocab - start, chunk, lambda c0, width, c: step(start + c0, width, c), (dx, dw))
