"""Vocab-parallel (tensor-parallel) linear_cross_entropy: 2 and 3 processes.

Each rank holds a contiguous block of rows of the full LM-head weight (uneven blocks,
an empty one, padded vocabularies); x and the targets are the same on every rank.
Loss, stats and gradients are compared with the float64 reference on the full weight
(``assert_close_to_ref``, torch in the same dtype as the yardstick) and with the
single-process op; the loss must be bitwise identical on every rank.

Over gloo on the CPU; over NCCL (one GPU per rank) when CUDA has a GPU per rank. Each test
is one spawn that runs many cases (process start-up dominates on the CPU).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import logitless
from logitless.ops.linear_cross_entropy.reference import linear_cross_entropy_reference
from tests._distributed import (
    DIST_MARKS,
    NCCL,
    TRITON_RANKS,
    blocks,
    cases_worker,
    check_vocab_parallel_errors,
    head_inputs,
    same_on_every_rank,
    spawn,
)
from tests.helpers import assert_close_to_ref

pytestmark = DIST_MARKS


def _check_case(rank, device, rows, case):
    """One case: the op with this rank's block vs the reference and the one-process op."""
    pg = dist.group.WORLD
    dtype = case.get("dtype", torch.float64)
    shape = case.get("shape", (11,))
    h = case.get("h", 13)
    v_rows = sum(rows)
    v_real = case.get("vocab_size") or v_rows
    x, w, b, t, cw = head_inputs(case.get("seed", 0), shape, h, v_rows, v_real, dtype, device,
                                  bias=case.get("bias", False), cw=case.get("cw", False),
                             ignore=case.get("ignore_index", -100))
    kw = {k: case[k] for k in ("reduction", "label_smoothing", "softcap", "z_loss", "shift", "ignore_index",
                               "batch_invariant") if k in case}
    stats = case.get("stats", False)
    backend = case.get("backend", "torch")
    mine = blocks(rows, rank)
    xl = x.clone().requires_grad_()
    wl = w[mine].clone().requires_grad_()
    bl = b[mine].clone().requires_grad_() if b is not None else None
    out = logitless.linear_cross_entropy(
        xl, wl, t, bl, class_weight=cw, return_stats=stats, backend=backend, process_group=pg,
        vocab_size=case.get("vocab_size"), partial_dx=case.get("partial_dx", False), **kw)
    loss, st = out if stats else (out, None)
    # The one-process op (same dtype) and the float64 reference, on the real rows.
    real = slice(0, v_real)
    xs = x.clone().requires_grad_()
    ws = w[real].clone().requires_grad_()
    bs = b[real].clone().requires_grad_() if b is not None else None
    out1 = logitless.linear_cross_entropy(xs, ws, t, bs, class_weight=cw, return_stats=stats, backend=backend, **kw)
    loss1, st1 = out1 if stats else (out1, None)
    xr = x.double().clone().requires_grad_()
    wr = w[real].double().clone().requires_grad_()
    br = b[real].double().clone().requires_grad_() if b is not None else None
    ref, ref_lse, ref_correct = linear_cross_entropy_reference(
        xr, wr, t, br, class_weight=None if cw is None else cw.double(),
        **{k: v for k, v in kw.items() if k != "batch_invariant"})
    name = case["name"]
    same_on_every_rank(f"{name}: loss", loss.detach())
    assert_close_to_ref(f"{name}: loss", loss, loss1, ref, dtype)
    if stats:
        assert_close_to_ref(f"{name}: lse", st.lse, st1.lse, ref_lse, dtype)
        assert torch.equal(st.correct, st1.correct), f"{name}: correct"
        assert torch.equal(st.argmax, st1.argmax), f"{name}: argmax"
        assert torch.equal(st.correct.cpu(), ref_correct.cpu()), f"{name}: correct vs reference"
        assert int(st.num_tokens) == int(st1.num_tokens)
    if loss.numel() == 0:
        return
    seed = torch.Generator().manual_seed(5)
    up = torch.randn(loss.shape, generator=seed, dtype=torch.float64)
    (loss * up.to(device=device, dtype=loss.dtype)).sum().backward()
    (loss1 * up.to(device=device, dtype=loss1.dtype)).sum().backward()
    (ref * up.to(device)).sum().backward()
    dx = xl.grad
    if case.get("partial_dx"):
        dx = dx.double()
        dist.all_reduce(dx)
        dx = dx.to(dtype)
    else:
        same_on_every_rank(f"{name}: dx", dx)
    assert_close_to_ref(f"{name}: dx", dx, xs.grad, xr.grad, dtype)
    real_mine = slice(mine.start, min(mine.stop, v_real))
    n_real = max(0, real_mine.stop - real_mine.start)
    local = slice(mine.start - real_mine.start, mine.start - real_mine.start + n_real) if n_real else slice(0, 0)
    assert_close_to_ref(f"{name}: dw", wl.grad[:n_real], ws.grad[real_mine], wr.grad[real_mine], dtype)
    assert torch.all(wl.grad[n_real:] == 0), f"{name}: padding rows got a gradient"
    del local
    if b is not None:
        assert_close_to_ref(f"{name}: db", bl.grad[:n_real], bs.grad[real_mine], br.grad[real_mine], dtype)
        assert torch.all(bl.grad[n_real:] == 0)


#: (name, options) run by both world sizes; fp64 on the torch backend must match the
#: float64 reference to fp64 rounding, fp32 as well as the one-process op does.
CASES = [
    dict(name="mean"),
    dict(name="sum-every-option", reduction="sum", bias=True, cw=True, label_smoothing=0.1, z_loss=1e-3,
         softcap=3.0),
    dict(name="none-shift-3d", reduction="none", shift=True, shape=(2, 5), bias=True),
    dict(name="stats-fp32", dtype=torch.float32, stats=True, z_loss=1e-4, cw=True),
    dict(name="stats-smoothing-softcap", stats=True, label_smoothing=0.2, softcap=2.0),
    dict(name="mean-cw-smoothing", cw=True, label_smoothing=0.3, ignore_index=-1),
    dict(name="partial-dx", partial_dx=True, bias=True, z_loss=1e-3),
    dict(name="one-token", shape=(1,), stats=True),
    dict(name="empty", shape=(0,), reduction="sum"),
    dict(name="bf16", dtype=torch.bfloat16, shape=(9,), h=16, bias=True),
]


def test_world3_unevenblocks():
    """V = 37 over 3 ranks as torch's Shard(0) splits it (13, 13, 11): every case; with an
    empty rank (20, 0, 17): a few."""
    spawn(cases_worker, 3, _check_case, [[13, 13, 11], [20, 0, 17]], CASES,
           ("sum-every-option", "stats-fp32", "partial-dx", "none-shift-3d"))


def test_world2_padded_vocab():
    """Megatron-style padding: 40 rows (20 + 20), 37 real classes (rank 1 holds 3 padding
    rows, which must neither enter the softmax nor get a gradient); and 44 rows of which
    rank 1's all are padding."""
    cases = [dict(c, vocab_size=37) for c in CASES if c["name"] in ("sum-every-option", "stats-fp32", "partial-dx")]
    spawn(cases_worker, 2, _check_case, [[20, 20], [37, 7]], cases)


def _errors_worker(rank, world, device):
    pg = dist.group.WORLD
    x = torch.randn(4, 8, device=device)
    w = torch.randn(5 + rank, 8, device=device)
    t = torch.tensor([0, 3, 10, -100], device=device)
    check_vocab_parallel_errors(logitless.linear_cross_entropy, x, w, t, pg, device)
    with pytest.raises(ValueError, match="class_weight"):
        logitless.linear_cross_entropy(x, w, t, process_group=pg, class_weight=torch.ones(5 + rank, device=device))
    # The module form passes the group on.
    t_ok = torch.tensor([0, 3, 9, -100], device=device)
    module = logitless.LinearCrossEntropyLoss(process_group=pg, z_loss=1e-3)
    assert torch.equal(module(x, w, t_ok), logitless.linear_cross_entropy(x, w, t_ok, process_group=pg, z_loss=1e-3))


def _merge_worker(rank, world, device):
    """``distributed.merge_shards`` on rows split over the ranks (the glue other ops use):
    lse's, plain sums, expectations under the row's softmax (an entropy term), maxima;
    a rank without columns; rows of -inf; ``merge_argmax``."""
    from logitless.distributed import merge_argmax, merge_shards

    pg = dist.group.WORLD
    rows = [9, 0] if world == 2 else [9, 0, 5]
    g = torch.Generator().manual_seed(3)
    z = torch.randn(4, sum(rows), generator=g, dtype=torch.float64)
    z[3] = float("-inf")
    z[2, 4] = z[2, 7] = z[2].max() + 1  # a tie: the first index wins
    z = z.to(device)
    cols = blocks(rows, rank)
    zl = z[:, cols]
    lse_l = torch.logsumexp(zl, dim=1) if zl.shape[1] else torch.full((4,), float("-inf"), dtype=z.dtype,
                                                                         device=device)
    p_l = torch.exp(zl - lse_l[:, None]) if zl.shape[1] else zl
    mean_l = torch.nan_to_num((p_l * torch.nan_to_num(zl, neginf=0.0)).sum(dim=1)) if zl.shape[1] else \
        torch.full((4,), float("nan"), dtype=z.dtype, device=device)
    best_l = zl.max(dim=1).values if zl.shape[1] else torch.full((4,), float("-inf"), dtype=z.dtype, device=device)
    arg_l = (zl.argmax(dim=1) if zl.shape[1] else torch.zeros(4, dtype=torch.int64, device=device)) + cols.start
    merged = merge_shards(pg, [lse_l], sums=[zl.clamp_min(-1e9).sum(dim=1)], means=[(mean_l, 0)], maxes=[best_l])
    lse = torch.logsumexp(z, dim=1)
    torch.testing.assert_close(merged.lse[0], lse)
    torch.testing.assert_close(merged.sums[0], z.clamp_min(-1e9).sum(dim=1))
    p = torch.exp(z[:3] - lse[:3, None])
    torch.testing.assert_close(merged.means[0][:3], (p * z[:3]).sum(dim=1))
    torch.testing.assert_close(merged.maxes[0], z.max(dim=1).values)
    argmax = merge_argmax(pg, best_l, arg_l, merged.maxes[0])
    assert torch.equal(argmax[:3], z[:3].argmax(dim=1)), (argmax, z.argmax(dim=1))


def test_errors():
    spawn(_errors_worker, 2)


def test_merge_shards():
    """The merge collectives alone, 3 ranks (one without columns)."""
    spawn(_merge_worker, 3)


def _dtensor_worker(rank, world, device):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor

    mesh = init_device_mesh(device.type, (world,))
    x, w, b, t, cw = head_inputs(3, (2, 6), 12, 37, 37, torch.float64, device, bias=True, cw=True)
    kw = dict(z_loss=1e-3, label_smoothing=0.1, shift=True)
    xr, wr, br = (u.clone().requires_grad_() for u in (x, w, b))
    ref = linear_cross_entropy_reference(xr, wr, t, br, class_weight=cw, **kw)[0]
    ref.backward()
    for x_place in (Replicate(), Shard(1), Shard(0)):
        xd = distribute_tensor(x, mesh, [x_place]).requires_grad_()
        wd = distribute_tensor(w, mesh, [Shard(0)]).requires_grad_()
        bd = distribute_tensor(b, mesh, [Shard(0)]).requires_grad_()
        loss = logitless.linear_cross_entropy(xd, wd, t, bd, class_weight=cw, **kw)
        loss.backward()
        name = f"x {x_place}"
        assert_close_to_ref(f"{name}: loss", loss, None, ref, torch.float64)
        assert tuple(wd.grad.placements) == (Shard(0),) and tuple(bd.grad.placements) == (Shard(0),), name
        assert tuple(xd.grad.placements) in ((x_place,), (Partial(),)), (name, xd.grad.placements)
        assert_close_to_ref(f"{name}: dx", xd.grad.full_tensor(), None, xr.grad, torch.float64)
        assert_close_to_ref(f"{name}: dw", wd.grad.full_tensor(), None, wr.grad, torch.float64)
        assert_close_to_ref(f"{name}: db", bd.grad.full_tensor(), None, br.grad, torch.float64)
    # partial_dx with a Replicate() x: the gradient is Partial(), its full value the same.
    xd = distribute_tensor(x, mesh, [Replicate()]).requires_grad_()
    wd = distribute_tensor(w, mesh, [Shard(0)]).requires_grad_()
    logitless.linear_cross_entropy(xd, wd, t, partial_dx=True).backward()
    xr2, wr2 = x.clone().requires_grad_(), w.clone().requires_grad_()
    linear_cross_entropy_reference(xr2, wr2, t)[0].backward()
    assert_close_to_ref("partial dx", xd.grad.full_tensor(), None, xr2.grad, torch.float64)
    # Under torch.compile(fullgraph=True): DTensor unwrapping traces without a graph break.
    xr3, wr3 = x.clone().requires_grad_(), w.clone().requires_grad_()
    ref3 = linear_cross_entropy_reference(xr3, wr3, t, z_loss=1e-3)[0]
    ref3.backward()
    for x_place in (Replicate(), Shard(1)):
        torch._dynamo.reset()
        xd = distribute_tensor(x, mesh, [x_place]).requires_grad_()
        wd = distribute_tensor(w, mesh, [Shard(0)]).requires_grad_()
        compiled = torch.compile(lambda a, b, c: logitless.linear_cross_entropy(a, b, c, z_loss=1e-3),
                                 fullgraph=True, backend="aot_eager")
        loss = compiled(xd, wd, t)
        loss.backward()
        assert_close_to_ref(f"compiled {x_place}: loss", loss, None, ref3, torch.float64)
        assert_close_to_ref(f"compiled {x_place}: dx", xd.grad.full_tensor(), None, xr3.grad, torch.float64)
        assert_close_to_ref(f"compiled {x_place}: dw", wd.grad.full_tensor(), None, wr3.grad, torch.float64)
    wd = distribute_tensor(w, mesh, [Shard(0)]).requires_grad_()
    # FSDP's layout (a Shard(0) weight, a plain x) keeps its clear error; a hidden-dim shard is refused.
    with pytest.raises(TypeError, match="register_fsdp_forward_method"):
        logitless.linear_cross_entropy(x, wd, t)
    with pytest.raises(TypeError, match="hidden dimension"):
        logitless.linear_cross_entropy(distribute_tensor(x, mesh, [Shard(2)]), wd, t)
    with pytest.raises(TypeError, match="Shard\\(0\\)"):
        logitless.linear_cross_entropy(xd, distribute_tensor(w, mesh, [Replicate()]), t)
    with pytest.raises(ValueError, match="not both"):
        logitless.linear_cross_entropy(xd, wd, t, process_group=dist.group.WORLD)


def test_dtensor():
    pytest.importorskip("torch.distributed.tensor", reason="DTensor needs torch >= 2.4")
    spawn(_dtensor_worker, 2)


def _compile_worker(rank, world, device):
    pg = dist.group.WORLD
    x, w, _, t, _ = head_inputs(4, (7,), 10, 23, 23, torch.float32, device)
    mine = blocks([12, 11], rank)
    counts = torch._dynamo.utils.counters
    counts.clear()

    def loss_fn(x, w, t):
        return logitless.linear_cross_entropy(x, w, t, process_group=pg, z_loss=1e-3)

    compiled = torch.compile(loss_fn, fullgraph=True, backend="aot_eager")
    xl, wl = x.clone().requires_grad_(), w[mine].clone().requires_grad_()
    loss = compiled(xl, wl, t)
    loss.backward()
    xe, we = x.clone().requires_grad_(), w[mine].clone().requires_grad_()
    eager = loss_fn(xe, we, t)
    eager.backward()
    assert torch.equal(loss, eager)
    assert torch.equal(xl.grad, xe.grad) and torch.equal(wl.grad, we.grad)
    assert not counts["graph_break"], dict(counts["graph_break"])


def test_compile_fullgraph():
    spawn(_compile_worker, 2)


def _triton_worker(rank, world, device):
    for case in (dict(name="triton", dtype=torch.float32, backend="triton", shape=(6,), h=16, bias=True,
                      z_loss=1e-3, stats=True),
                 dict(name="triton-padded-smoothing", dtype=torch.float32, backend="triton", shape=(5,), h=16,
                      vocab_size=30, label_smoothing=0.1, cw=True)):
        _check_case(rank, device, [17, 16], case)


@TRITON_RANKS
def test_triton_backend():
    spawn(_triton_worker, 2)


def _cuda_graph_worker(rank, world, device):
    """A TP forward+backward captured in a CUDA graph (NCCL collectives included) replays
    with new inputs and gives eager's loss and gradients bit for bit."""
    pg = dist.group.WORLD
    rows = [1501, 1499]
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(700, 136, device=device, dtype=torch.bfloat16, generator=g).requires_grad_()
    w = (torch.randn(sum(rows), 136, device=device, generator=g) * 0.1).to(torch.bfloat16)
    w = w[blocks(rows, rank)].clone().requires_grad_()
    t = torch.randint(0, sum(rows), (700,), device=device, generator=g)
    t[::7] = -100

    def step():
        x.grad = w.grad = None
        loss = logitless.linear_cross_entropy(x, w, t, z_loss=1e-4, process_group=pg)
        loss.backward()
        return loss

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up (kernels, NCCL communicator, layout) off the capture
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    x.grad = w.grad = None
    with torch.cuda.graph(graph):
        loss = logitless.linear_cross_entropy(x, w, t, z_loss=1e-4, process_group=pg)
        loss.backward()
    with torch.no_grad():
        x.copy_(torch.randn(x.shape, device=device, generator=g))
        t.copy_(torch.randint(0, sum(rows), (700,), device=device, generator=g))
    graph.replay()
    torch.cuda.synchronize()
    got = (loss.clone(), x.grad.clone(), w.grad.clone())
    expected = step()
    assert torch.equal(got[0], expected)
    assert torch.equal(got[1], x.grad) and torch.equal(got[2], w.grad)


@pytest.mark.skipif(not NCCL, reason="CUDA graphs of NCCL collectives need >= 2 GPUs")
def test_cuda_graph_capture():
    spawn(_cuda_graph_worker, 2)


#: batch_invariant=True over a vocab-parallel head: values, stats and gradients as the
#: reference's (``_check_case``), then a row's bits alone and inside other batches.
INVARIANT_CASES = [
    dict(name="invariant-every-option", batch_invariant=True, reduction="none", label_smoothing=0.1, z_loss=1e-3,
         softcap=3.0, bias=True, cw=True, stats=True, dtype=torch.float32),
    dict(name="invariant-mean-fp64", batch_invariant=True, shape=(2, 5), stats=True),
    dict(name="invariant-empty", batch_invariant=True, shape=(0,), reduction="sum", stats=True,
         dtype=torch.float32),
]


def _invariant_worker(rank, world, device, rows):
    cases_worker(rank, world, device, _check_case, [rows], INVARIANT_CASES)
    from logitless.ops.common import invariant
    from logitless.ops.linear_cross_entropy.api import BACKENDS

    pg = dist.group.WORLD
    n = invariant.rows(BACKENDS["torch"], device) + 9
    x, w, b, t, cw = head_inputs(4, (n,), 24, sum(rows), sum(rows), torch.float32, device, bias=True, cw=True)
    mine = blocks(rows, rank)
    seen = {}
    for order in ([0], [1, 0], [2, 1, 0, 3, 4], list(range(3, n)) + [2, 0, 1]):
        idx = torch.tensor(order, device=device)
        loss, st = logitless.linear_cross_entropy(x[idx], w[mine], t[idx], b[mine], class_weight=cw,
                                                  reduction="none", label_smoothing=0.1, z_loss=1e-3,
                                                  return_stats=True, process_group=pg, batch_invariant=True)
        for pos, row in enumerate(order):
            if row < 3:
                got = torch.stack([loss[pos], st.lse[pos], st.argmax[pos].double().float()])
                if row in seen:
                    assert torch.equal(seen[row].view(torch.int32), got.view(torch.int32)), (row, order[:4])
                else:
                    seen[row] = got
    assert set(seen) == {0, 1, 2}
    same_on_every_rank("invariant rows", torch.stack([seen[r] for r in range(3)]))


@pytest.mark.parametrize("rows", [[40, 33], [30, 0, 43]], ids=["world2", "world3-empty-rank"])
def test_batch_invariant(rows):
    spawn(_invariant_worker, len(rows), rows)
