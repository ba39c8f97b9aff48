"""Vocab-parallel linear_jsd: both heads split over 2 or 3 processes (gloo on the CPU,
NCCL with >= 2 GPUs), against the float64 reference on the full heads and the
one-process op. The spawn machinery is tests/_distributed.py's."""

from __future__ import annotations

import contextlib
import os
from unittest import mock

import pytest
import torch
import torch.distributed as dist

import logitless
from logitless.ops.linear_jsd.reference import linear_jsd_reference
from logitless.planning.overrides import override
from tests._distributed import DIST_MARKS, NCCL, blocks, same_on_every_rank, spawn
from tests.helpers import assert_close_to_ref

pytestmark = DIST_MARKS

CASES = [
    dict(name="mixture"),
    dict(name="forward-kl-hard-labels", beta=0.0, hard_label_weight=0.5, bias=True, reduction="sum"),
    dict(name="reverse-kl-temperature", beta=1.0, temperature=2.0, reduction="none", shift=True, shape=(2, 4)),
    dict(name="softcaps-partial-dx", beta=0.3, student_softcap=3.0, teacher_softcap=4.0, partial_dx=True),
    dict(name="fp32-hard-labels", dtype=torch.float32, beta=0.7, hard_label_weight=1.0),
    dict(name="empty", shape=(0,), reduction="sum"),
    # the KL limits merge each rank's own divergence (no second pass): ignore_index -1 is
    # also the local id of a target that another rank holds
    dict(name="forward-kl-ignore-minus-one", beta=0.0, hard_label_weight=0.7, ignore_index=-1, temperature=0.7,
         shape=(3, 5)),
]


def _path(case):
    """The forward's path under TP: at the KL limits the merge of each rank's divergence
    (the second pass over the columns, which 0 < beta < 1 takes, fails the test if it runs)."""
    from logitless.ops.linear_jsd import torch_backend, triton_backend

    stack = contextlib.ExitStack()
    if case.get("fused"):  # the Triton backend's fused KL-limit forward on each rank's columns
        stack.enter_context(override(jsd_fused_forward=True))
    if case.get("beta") in (0.0, 1.0):
        for backend in (torch_backend.TorchBackend, triton_backend.TritonBackend):
            stack.enter_context(mock.patch.object(backend, "column_sums", side_effect=AssertionError(
                "second pass over the columns at a KL limit")))
    return stack


def _case(rank, device, rows, case):
    pg = dist.group.WORLD
    dtype = case.get("dtype", torch.float64)
    shape = case.get("shape", (9,))
    hs, ht = 10, 14
    v_rows = sum(rows)
    v_real = case.get("vocab_size") or v_rows
    g = torch.Generator().manual_seed(case.get("seed", 1))
    to = dict(dtype=dtype, device=device)
    xs = torch.randn(*shape, hs, generator=g, dtype=torch.float64).to(**to)
    xt = torch.randn(*shape, ht, generator=g, dtype=torch.float64).to(**to)
    ws = (torch.randn(v_rows, hs, generator=g, dtype=torch.float64) * hs ** -0.5 * 2).to(**to)
    wt = (torch.randn(v_rows, ht, generator=g, dtype=torch.float64) * ht ** -0.5 * 2).to(**to)
    bs = (torch.randn(v_rows, generator=g, dtype=torch.float64) * 0.5).to(**to) if case.get("bias") else None
    bt = (torch.randn(v_rows, generator=g, dtype=torch.float64) * 0.5).to(**to) if case.get("bias") else None
    t = torch.randint(0, v_real, shape, generator=g)
    if t.numel() > 2:
        t.view(-1)[1] = case.get("ignore_index", -100)
    t = t.to(device)
    kw = {k: case[k] for k in ("beta", "temperature", "reduction", "student_softcap", "teacher_softcap",
                               "hard_label_weight", "shift", "ignore_index") if k in case}
    mine = blocks(rows, rank)
    real = slice(0, v_real)
    xl, wl = xs.clone().requires_grad_(), ws[mine].clone().requires_grad_()
    bl = bs[mine].clone().requires_grad_() if bs is not None else None
    with _path(case):
        loss = logitless.linear_jsd(xl, wl, xt, wt[mine], t, student_bias=bl,
                                    teacher_bias=None if bt is None else bt[mine],
                                    backend=case.get("backend", "torch"), process_group=pg,
                                    vocab_size=case.get("vocab_size"), partial_dx=case.get("partial_dx", False),
                                    **kw)
    x1, w1 = xs.clone().requires_grad_(), ws[real].clone().requires_grad_()
    b1 = bs[real].clone().requires_grad_() if bs is not None else None
    loss1 = logitless.linear_jsd(x1, w1, xt, wt[real], t, student_bias=b1,
                                 teacher_bias=None if bt is None else bt[real], backend=case.get("backend", "torch"),
                                 **kw)
    xr, wr = xs.double().clone().requires_grad_(), ws[real].double().clone().requires_grad_()
    br = bs[real].double().clone().requires_grad_() if bs is not None else None
    ref = linear_jsd_reference(xr, wr, xt, wt[real], t, student_bias=br,
                               teacher_bias=None if bt is None else bt[real], **kw)
    name = case["name"]
    same_on_every_rank(f"{name}: loss", loss.detach())
    assert_close_to_ref(f"{name}: loss", loss, loss1, ref, dtype)
    if loss.numel() == 0:
        return
    up = torch.randn(loss.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    (loss * up.to(device=device, dtype=loss.dtype)).sum().backward()
    (loss1 * up.to(device=device, dtype=loss1.dtype)).sum().backward()
    (ref * up.to(device)).sum().backward()
    dx = xl.grad
    if case.get("partial_dx"):
        dx = dx.double()
        dist.all_reduce(dx)
        dx = dx.to(dtype)
    assert_close_to_ref(f"{name}: dx", dx, x1.grad, xr.grad, dtype)
    real_mine = slice(mine.start, min(mine.stop, v_real))
    n_real = max(0, real_mine.stop - real_mine.start)
    assert_close_to_ref(f"{name}: dw", wl.grad[:n_real], w1.grad[real_mine], wr.grad[real_mine], dtype)
    assert torch.all(wl.grad[n_real:] == 0), f"{name}: padding rows got a gradient"
    if bs is not None:
        assert_close_to_ref(f"{name}: db", bl.grad[:n_real], b1.grad[real_mine], br.grad[real_mine], dtype)


def _worker(rank, world, device, rows_list, cases):
    for rows in rows_list:
        for case in cases:
            _case(rank, device, rows, case)


def test_jsd_world3_uneven():
    spawn(_worker, 3, [[11, 11, 9], [16, 0, 15]], CASES)


def _dtensor_case(rank, world, device):
    """DTensor heads: Shard(0) weights, a Replicate() student x and a Shard(1) teacher x."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh(device.type, (world,))
    g = torch.Generator().manual_seed(7)
    xs, xt = torch.randn(2, 4, 10, generator=g, dtype=torch.float64), torch.randn(2, 4, 14, generator=g,
                                                                                   dtype=torch.float64)
    ws, wt = torch.randn(23, 10, generator=g, dtype=torch.float64), torch.randn(23, 14, generator=g,
                                                                                 dtype=torch.float64)
    t = torch.randint(0, 23, (2, 4), generator=g)
    xs, xt, ws, wt, t = (u.to(device) for u in (xs, xt, ws, wt, t))
    kw = dict(beta=0.4, hard_label_weight=0.3, shift=True)
    xr, wr = xs.clone().requires_grad_(), ws.clone().requires_grad_()
    ref = linear_jsd_reference(xr, wr, xt, wt, t, **kw)
    ref.backward()
    xd = distribute_tensor(xs, mesh, [Replicate()]).requires_grad_()
    wd = distribute_tensor(ws, mesh, [Shard(0)]).requires_grad_()
    loss = logitless.linear_jsd(xd, wd, distribute_tensor(xt, mesh, [Shard(1)]),
                                distribute_tensor(wt, mesh, [Shard(0)]), t, backend="torch", **kw)
    loss.backward()
    assert_close_to_ref("dtensor jsd: loss", loss, None, ref, torch.float64)
    assert tuple(wd.grad.placements) == (Shard(0),)
    assert_close_to_ref("dtensor jsd: dx", xd.grad.full_tensor(), None, xr.grad, torch.float64)
    assert_close_to_ref("dtensor jsd: dw", wd.grad.full_tensor(), None, wr.grad, torch.float64)


def _compile_case(rank, device):
    """torch.compile(fullgraph=True) of the TP op (the merge at beta 0 with hard labels, and
    the mixture's two passes): no graph break, results bitwise those of eager."""
    pg = dist.group.WORLD
    g = torch.Generator().manual_seed(11)
    xs, xt = torch.randn(7, 10, generator=g), torch.randn(7, 14, generator=g)
    ws, wt = torch.randn(23, 10, generator=g), torch.randn(23, 14, generator=g)
    t = torch.randint(0, 23, (7,), generator=g)
    xs, xt, ws, wt, t = (u.to(device) for u in (xs, xt, ws, wt, t))
    mine = blocks([12, 11], rank)
    counts = torch._dynamo.utils.counters
    for kw in (dict(beta=0.0, hard_label_weight=0.5), dict(beta=0.4, temperature=0.8)):
        counts.clear()

        def loss_fn(x, w, kw=kw):
            return logitless.linear_jsd(x, w, xt, wt[mine], t, process_group=pg, backend="torch", **kw)

        compiled = torch.compile(loss_fn, fullgraph=True, backend="aot_eager")
        xc, wc = xs.clone().requires_grad_(), ws[mine].clone().requires_grad_()
        loss = compiled(xc, wc)
        loss.backward()
        xe, we = xs.clone().requires_grad_(), ws[mine].clone().requires_grad_()
        eager = loss_fn(xe, we)
        eager.backward()
        assert torch.equal(loss, eager), kw
        assert torch.equal(xc.grad, xe.grad) and torch.equal(wc.grad, we.grad), kw
        assert not counts["graph_break"], dict(counts["graph_break"])
        torch._dynamo.reset()


def _padded_and_dtensor(rank, world, device, rows_list, cases):
    _worker(rank, world, device, rows_list, cases)
    _dtensor_case(rank, world, device)
    _compile_case(rank, device)


def test_jsd_world2_padded_dtensor_and_compile():
    pytest.importorskip("torch.distributed.tensor", reason="DTensor needs torch >= 2.4")
    cases = [dict(c, vocab_size=27) for c in CASES if c["name"] in ("mixture", "forward-kl-hard-labels")]
    if NCCL or os.environ.get("TRITON_INTERPRET") == "1":  # the Triton backend (interpreter on the CPU)
        cases.append(dict(name="triton", dtype=torch.float32, backend="triton", beta=0.5, hard_label_weight=0.5,
                          student_softcap=3.0, shape=(5,), vocab_size=27))
        cases.append(dict(name="triton-bf16-mixture", dtype=torch.bfloat16, backend="triton", beta=0.3,
                          hard_label_weight=0.4, teacher_softcap=4.0, temperature=0.8, shape=(2, 3), vocab_size=27))
        cases.append(dict(name="triton-fused-forward-kl", dtype=torch.bfloat16, backend="triton", beta=0.0,
                          hard_label_weight=0.5, temperature=1.5, fused=True, shape=(6,), vocab_size=27))
    spawn(_padded_and_dtensor, 2, [[16, 16]], cases)
