"""Vocab-parallel (tensor-parallel) linear_topk_kl: 2 and 3 processes.

Each rank holds a contiguous block of rows of the full LM-head weight (uneven blocks, an
empty one); hidden, the teacher's (global) ids and log-probs and the targets are the same
on every rank. The loss and the gradients (hidden's full one, this rank's rows of the
weight and bias) are compared with the float64 reference on the full weight
(``assert_close_to_ref``, the one-process op in the same dtype as the yardstick); the loss
and hidden's gradient must be bitwise identical on every rank. A DTensor head (``Shard(0)``
weight, ``Replicate()`` hidden) too.

Over gloo on the CPU (NCCL with one GPU per rank when CUDA has enough GPUs). Each test is
one spawn that runs many cases.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import logitless
from logitless.ops.linear_topk_kl.reference import linear_topk_kl_reference
from tests._distributed import DIST_MARKS, TRITON_RANKS, blocks, cases_worker, head_inputs, same_on_every_rank, spawn
from tests.helpers import assert_close_to_ref

pytestmark = DIST_MARKS

OPTION_KEYS = ("direction", "tail", "temperature", "softcap", "hard_label_weight", "reduction")


def _teacher(seed, shape, v, k, device):
    g = torch.Generator().manual_seed(seed + 50)
    lp, ids = torch.log_softmax(torch.randn(*shape, v, generator=g, dtype=torch.float64) * 2, -1).topk(k, -1)
    return ids.to(device), lp.float().to(device)


def _check_case(rank, device, rows, case):
    pg = dist.group.WORLD
    dtype = case.get("dtype", torch.float64)
    shape = case.get("shape", (11,))
    v = sum(rows)
    x, w, b, t, _ = head_inputs(case.get("seed", 0), shape, case.get("h", 13), v, v, dtype, device,
                                bias=case.get("bias", False))
    ids, lp = _teacher(case.get("seed", 0), shape, v, case.get("k", 6), device)
    kw = {k: case[k] for k in OPTION_KEYS if k in case}
    backend = case.get("backend", "torch")
    mine = blocks(rows, rank)
    xl = x.clone().requires_grad_()
    wl = w[mine].clone().requires_grad_()
    bl = b[mine].clone().requires_grad_() if b is not None else None
    loss = logitless.linear_topk_kl(xl, wl, ids, lp, t, bias=bl, backend=backend, process_group=pg, **kw)
    xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
    bs = b.clone().requires_grad_() if b is not None else None
    loss1 = logitless.linear_topk_kl(xs, ws, ids, lp, t, bias=bs, backend=backend, **kw)
    xr, wr = x.double().clone().requires_grad_(), w.double().clone().requires_grad_()
    br = b.double().clone().requires_grad_() if b is not None else None
    ref = linear_topk_kl_reference(xr, wr, ids, lp, t, br, **kw)
    name = case["name"]
    same_on_every_rank(f"{name}: loss", loss.detach())
    assert_close_to_ref(f"{name}: loss", loss, loss1, ref, dtype)
    if loss.numel() == 0:
        return
    up = torch.randn(loss.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64).to(device)
    (loss * up.to(loss.dtype)).sum().backward()
    (loss1 * up.to(loss1.dtype)).sum().backward()
    (ref * up).sum().backward()
    same_on_every_rank(f"{name}: dx", xl.grad)
    assert_close_to_ref(f"{name}: dx", xl.grad, xs.grad, xr.grad, dtype)
    if mine.stop > mine.start:
        assert_close_to_ref(f"{name}: dw", wl.grad, ws.grad[mine], wr.grad[mine], dtype)
        if b is not None:
            assert_close_to_ref(f"{name}: db", bl.grad, bs.grad[mine], br.grad[mine], dtype)


#: Every direction and tail, every option; fp64 on the torch backend to fp64 rounding.
CASES = [
    dict(name="forward-bucket"),
    dict(name="reverse-bucket", direction="reverse", bias=True),
    dict(name="forward-renormalize", tail="renormalize", reduction="sum"),
    dict(name="reverse-renormalize", direction="reverse", tail="renormalize", temperature=0.7),
    dict(name="forward-none", tail="none", softcap=3.0, reduction="none"),
    dict(name="reverse-none-hard", direction="reverse", tail="none", hard_label_weight=0.4, temperature=1.3),
    dict(name="every-option-3d", direction="reverse", temperature=0.8, softcap=4.0, hard_label_weight=0.3,
         bias=True, shape=(2, 5), k=9),
    dict(name="hard-T1", hard_label_weight=0.5, k=3),
    dict(name="fp32", dtype=torch.float32, temperature=0.9, hard_label_weight=0.2, bias=True),
    dict(name="one-token", shape=(1,), reduction="none"),
    dict(name="empty", shape=(0,), reduction="sum"),
]


def test_world3_uneven_blocks():
    """V = 37 over 3 ranks (13, 13, 11): every case; with an empty rank (20, 0, 17): a few."""
    spawn(cases_worker, 3, _check_case, [[13, 13, 11], [20, 0, 17]], CASES, ("every-option-3d", "fp32"))


TRITON_CASES = [dict(c, backend="triton", dtype=torch.float32, name=f"triton-{c['name']}") for c in CASES
                if c["name"] in ("every-option-3d", "forward-none", "reverse-renormalize", "hard-T1")]


@TRITON_RANKS
def test_world2_triton():
    """The Triton backend's forward and backward on each rank's rows (the interpreter on a CPU)."""
    spawn(cases_worker, 2, _check_case, [[20, 17]], TRITON_CASES)


def _dtensor_worker(rank, world, device):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh(device.type, (world,))
    v, h = 30, 12
    x, w, _, t, _ = head_inputs(3, (2, 7), h, v, v, torch.float64, device)
    ids, lp = _teacher(3, (2, 7), v, 5, device)
    kw = dict(direction="reverse", hard_label_weight=0.3, temperature=0.9, shift=True, backend="torch")
    xd = distribute_tensor(x, mesh, [Replicate()]).requires_grad_()
    wd = distribute_tensor(w, mesh, [Shard(0)]).requires_grad_()
    loss = logitless.linear_topk_kl(xd, wd, ids, lp, t, **kw)
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    ref = linear_topk_kl_reference(xr, wr, ids, lp, t, **{k: v for k, v in kw.items() if k != "backend"})
    torch.testing.assert_close(loss.detach().cpu(), ref.detach().cpu(), rtol=1e-12, atol=1e-12)
    loss.backward()
    ref.backward()
    torch.testing.assert_close(xd.grad.full_tensor().cpu(), xr.grad.cpu(), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(wd.grad.full_tensor().cpu(), wr.grad.cpu(), rtol=1e-10, atol=1e-12)


def test_dtensor_head():
    spawn(_dtensor_worker, 2)


def _errors_worker(rank, world, device):
    pg = dist.group.WORLD
    x = torch.randn(4, 8, device=device)
    w = torch.randn(5 + rank, 8, device=device)  # V = 11 over the two ranks
    ids = torch.tensor([[0, 6, 10]] * 4, device=device)
    lp = torch.full((4, 3), -2.0, device=device)
    logitless.linear_topk_kl(x, w, ids, lp, process_group=pg)  # ids on both ranks, the last one global
    if device.type == "cpu":
        with pytest.raises(ValueError, match=r"teacher_ids contains 11, outside \[0, 11\)"):
            logitless.linear_topk_kl(x, w, ids + 1, lp, process_group=pg)
    with pytest.raises(TypeError, match="process_group"):
        logitless.linear_topk_kl(x, w, ids, lp, process_group="tp")
    with pytest.raises(ValueError, match="tail must be one of"):
        logitless.linear_topk_kl(x, w, ids, lp, process_group=pg, tail="x")


def test_errors():
    spawn(_errors_worker, 2)
