"""Vocab-parallel (tensor-parallel) linear_log_probs: 2 and 3 processes.

Each rank holds a contiguous block of rows of the full LM-head weight (uneven blocks,
an empty one, padded vocabularies); x and the token ids are the same on every rank.
logp, entropy and the gradients from both outputs are compared with the float64
reference on the full weight (``assert_close_to_ref``, the one-process op in the same
dtype as the yardstick); both outputs must be bitwise identical on every rank.

Over gloo on the CPU (NCCL with one GPU per rank when CUDA has enough GPUs: the spawn
helper of tests/_distributed.py). Each test is one spawn that runs many cases.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

import logitless
from logitless.ops.linear_log_probs.reference import linear_log_probs_reference
from tests._distributed import (
    DIST_MARKS,
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

OPTION_KEYS = ("temperature", "softcap", "ignore_index", "entropy")


def _outputs(out, entropy):
    return out if entropy else (out, None)


def _check_case(rank, device, rows, case):
    """One case: the op with this rank's block vs the one-process op and the reference."""
    pg = dist.group.WORLD
    dtype = case.get("dtype", torch.float64)
    shape = case.get("shape", (11,))
    h = case.get("h", 13)
    v_rows = sum(rows)
    v_real = case.get("vocab_size") or v_rows
    x, w, b, t, _ = head_inputs(case.get("seed", 0), shape, h, v_rows, v_real, dtype, device,
                                bias=case.get("bias", False), ignore=case.get("ignore_index", -100))
    kw = {k: case[k] for k in OPTION_KEYS if k in case}
    entropy = case.get("entropy", False)
    backend = case.get("backend", "torch")
    mine = blocks(rows, rank)
    xl = x.clone().requires_grad_()
    wl = w[mine].clone().requires_grad_()
    bl = b[mine].clone().requires_grad_() if b is not None else None
    logp, ent = _outputs(logitless.linear_log_probs(
        xl, wl, t, bl, backend=backend, process_group=pg, vocab_size=case.get("vocab_size"),
        partial_dx=case.get("partial_dx", False), **kw), entropy)
    real = slice(0, v_real)
    xs = x.clone().requires_grad_()
    ws = w[real].clone().requires_grad_()
    bs = b[real].clone().requires_grad_() if b is not None else None
    logp1, ent1 = _outputs(logitless.linear_log_probs(xs, ws, t, bs, backend=backend, **kw), entropy)
    xr = x.double().clone().requires_grad_()
    wr = w[real].double().clone().requires_grad_()
    br = b[real].double().clone().requires_grad_() if b is not None else None
    rkw = {k: v for k, v in kw.items() if k != "entropy"}
    ref_lp, ref_ent = linear_log_probs_reference(xr, wr, t, br, **rkw)
    name = case["name"]
    assert logp.dtype == logp1.dtype and logp.shape == t.shape, name
    same_on_every_rank(f"{name}: logp", logp.detach())
    assert_close_to_ref(f"{name}: logp", logp, logp1, ref_lp, dtype)
    if entropy:
        same_on_every_rank(f"{name}: entropy", ent.detach())
        assert_close_to_ref(f"{name}: entropy", ent, ent1, ref_ent, dtype)
    if logp.numel() == 0:
        return
    gen = torch.Generator().manual_seed(5)
    up_lp = torch.randn(logp.shape, generator=gen, dtype=torch.float64).to(device)
    up_ent = torch.randn(logp.shape, generator=gen, dtype=torch.float64).to(device)

    which = case.get("grad", "both")  # the outputs the objective uses: "both", "logp", "entropy"

    def objective(lp, en):
        total = (lp * up_lp.to(lp.dtype)).sum() if which != "entropy" else 0.0
        return total + (en * up_ent.to(en.dtype)).sum() if en is not None and which != "logp" else total

    objective(logp, ent).backward()
    objective(logp1, ent1).backward()
    objective(ref_lp, ref_ent if entropy else None).backward()
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
    assert wl.grad.shape == wl.shape, name
    if n_real:
        assert_close_to_ref(f"{name}: dw", wl.grad[:n_real], ws.grad[real_mine], wr.grad[real_mine], dtype)
    assert torch.all(wl.grad[n_real:] == 0), f"{name}: padding rows got a gradient"
    if b is not None:
        if n_real:
            assert_close_to_ref(f"{name}: db", bl.grad[:n_real], bs.grad[real_mine], br.grad[real_mine], dtype)
        assert torch.all(bl.grad[n_real:] == 0), f"{name}: padding rows of the bias got a gradient"


#: Every option alone and combined; fp64 on the torch backend must match the float64
#: reference to fp64 rounding, fp32/bf16 as well as the one-process op does.
CASES = [
    dict(name="plain"),
    dict(name="entropy", entropy=True),
    dict(name="temperature", temperature=0.7),
    dict(name="softcap", softcap=2.5),
    dict(name="ignore-index", ignore_index=3),
    dict(name="bias", bias=True),
    dict(name="every-option-3d", entropy=True, temperature=1.3, softcap=3.0, bias=True, ignore_index=-1,
         shape=(2, 5)),
    dict(name="partial-dx", partial_dx=True, entropy=True, bias=True),
    dict(name="grad-from-entropy-only", entropy=True, grad="entropy", temperature=0.9, bias=True),
    dict(name="grad-from-logp-only", entropy=True, grad="logp", softcap=2.0),
    dict(name="fp32-entropy", dtype=torch.float32, entropy=True, temperature=0.8),
    dict(name="one-token", shape=(1,), entropy=True),
    dict(name="empty", shape=(0,), entropy=True),
    dict(name="bf16", dtype=torch.bfloat16, shape=(9,), h=16, bias=True, entropy=True, softcap=4.0),
]


def test_world3_unevenblocks():
    """V = 37 over 3 ranks (13, 13, 11): every case; with an empty rank (20, 0, 17): a few."""
    spawn(cases_worker, 3, _check_case, [[13, 13, 11], [20, 0, 17]], CASES,
           ("every-option-3d", "fp32-entropy", "partial-dx"))


def test_world2_padded_vocab():
    """Megatron-style padding: 40 rows (20 + 20) of which 37 are real classes; and 44 rows
    of which rank 1's 7 are all padding. Padding rows are no class and get no gradient."""
    cases = [dict(c, vocab_size=37) for c in CASES if c["name"] in ("every-option-3d", "fp32-entropy", "partial-dx")]
    spawn(cases_worker, 2, _check_case, [[20, 20], [37, 7]], cases)


def _merge_worker(rank, world, device):
    """``distributed.merge_online`` alone: rows split over 3 ranks (one without columns),
    a row of -inf on one rank, then lse and entropy by ``formulas.log_probs.finish``."""
    from logitless.distributed import merge_online
    from logitless.formulas.log_probs import finish, partials_of

    rows = [9, 0, 5]
    g = torch.Generator().manual_seed(3)
    a = torch.randn(3, sum(rows), generator=g, dtype=torch.float64) * 4
    a[2, :9] = float("-inf")  # rank 0's columns of row 2 are all -inf
    cols = blocks(rows, rank)
    al = a[:, cols].to(device)
    if al.shape[1]:
        lse_l = torch.logsumexp(al, dim=1)
        p = torch.exp(al - lse_l[:, None])
        ent_l = -torch.where(p > 0, p * (al - lse_l[:, None]), torch.zeros_like(p)).sum(dim=1)
        m, s, u = partials_of(lse_l, ent_l)
        s = torch.where(lse_l == float("-inf"), torch.zeros_like(s), s)
        u = torch.where(lse_l == float("-inf"), torch.zeros_like(u), u)
        tail = al[:, -1]
    else:
        m = torch.full((3,), float("-inf"), dtype=a.dtype, device=device)
        s = u = tail = torch.zeros(3, dtype=a.dtype, device=device)
    big, s_all, u_all, (sum_tail,) = merge_online(dist.group.WORLD, m, s, u, [tail])
    lse, ent = finish(big, s_all, u_all)
    lse_ref = torch.logsumexp(a, dim=1)
    lp = a - lse_ref[:, None]
    ent_ref = -torch.where(lp > float("-inf"), lp.exp() * lp, torch.zeros_like(lp)).sum(dim=1)
    torch.testing.assert_close(lse.cpu(), lse_ref)
    torch.testing.assert_close(ent.cpu(), ent_ref)
    torch.testing.assert_close(sum_tail.cpu(), a[:, 8] + a[:, -1])


def test_merge_online():
    spawn(_merge_worker, 3)


def _errors_worker(rank, world, device):
    pg = dist.group.WORLD
    x = torch.randn(4, 8, device=device)
    w = torch.randn(5 + rank, 8, device=device)
    t = torch.tensor([0, 3, 10, -100], device=device)
    check_vocab_parallel_errors(logitless.linear_log_probs, x, w, t, pg, device)
    with pytest.raises(TypeError, match="partial_dx"):
        logitless.linear_log_probs(x, w, t, process_group=pg, partial_dx=1)
    with pytest.raises(ValueError, match="temperature"):
        logitless.linear_log_probs(x, w, t, process_group=pg, temperature=0.0)
    with pytest.raises(ValueError, match="tokens"):
        logitless.linear_log_probs(x, w, t[:3], process_group=pg)
    # vocab_size without a group: the first rows of a padded single-GPU head.
    wf = torch.randn(12, 8, device=device)
    sliced = logitless.linear_log_probs(x, wf, t, vocab_size=11, entropy=True)
    full = logitless.linear_log_probs(x, wf[:11], t, entropy=True)
    assert all(torch.equal(a, b) for a, b in zip(sliced, full))
    # The module form passes the group on.
    t_ok = torch.tensor([0, 3, 9, -100], device=device)
    module = logitless.LinearLogProbs(process_group=pg, entropy=True, temperature=0.9)
    got = module(x, w, t_ok)
    want = logitless.linear_log_probs(x, w, t_ok, process_group=pg, entropy=True, temperature=0.9)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_errors():
    spawn(_errors_worker, 2)


def _compile_worker(rank, world, device):
    """torch.compile(fullgraph=True) with the default (inductor) backend: no graph break,
    eager's numbers and gradients; torch backend with entropy and a padded vocabulary,
    and with partial_dx; the Triton backend (interpreter on the CPU) with a padded
    vocabulary (the fake's run-time-sized kept buffers) and with dynamic=True."""
    pg = dist.group.WORLD
    x, w, b, t, _ = head_inputs(4, (7,), 16, 24, 23, torch.float32, device, bias=True)
    mine = blocks([12, 12], rank)
    counts = torch._dynamo.utils.counters
    counts.clear()

    def with_entropy(backend):
        def fn(x, w, b, t):
            lp, ent = logitless.linear_log_probs(x, w, t, b, process_group=pg, entropy=True, temperature=0.7,
                                                 softcap=3.0, backend=backend, vocab_size=23)
            return (lp * 0.3).sum() + (ent * 0.7).sum()
        return fn

    def without(backend):
        def fn(x, w, b, t):
            lp = logitless.linear_log_probs(x, w, t, b, process_group=pg, partial_dx=True, backend=backend)
            return lp.square().sum()
        return fn

    runs = [(with_entropy("torch"), False), (without("torch"), False)]
    if device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1":  # (CPU ranks on a GPU machine: no kernels)
        runs += [(with_entropy("triton"), False), (without("triton"), True)]
    for fn, dynamic in runs:
        torch._dynamo.reset()
        compiled = torch.compile(fn, fullgraph=True, dynamic=dynamic)
        xl, wl, bl = x.clone().requires_grad_(), w[mine].clone().requires_grad_(), b[mine].clone().requires_grad_()
        loss = compiled(xl, wl, bl, t)
        loss.backward()
        xe, we, be = x.clone().requires_grad_(), w[mine].clone().requires_grad_(), b[mine].clone().requires_grad_()
        eager = fn(xe, we, be, t)
        eager.backward()
        torch.testing.assert_close(loss, eager, rtol=1e-6, atol=1e-6)
        for got, want in ((xl.grad, xe.grad), (wl.grad, we.grad), (bl.grad, be.grad)):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        same_on_every_rank("compiled loss", loss.detach())
    assert not counts["graph_break"], dict(counts["graph_break"])


def test_compile_fullgraph_inductor():
    spawn(_compile_worker, 2)


def _dtensor_worker(rank, world, device):
    """A DTensor Shard(0) weight (and bias) with a Replicate() or token-sharded x: no other
    argument; logp/entropy vs the float64 reference, gradients back as DTensors."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh(device.type, (world,))
    x, w, b, t, _ = head_inputs(3, (2, 6), 12, 37, 37, torch.float64, device, bias=True)
    xr, wr, br = (u.clone().requires_grad_() for u in (x, w, b))
    ref_lp, ref_ent = linear_log_probs_reference(xr, wr, t, br, temperature=0.8)
    (ref_lp.sum() + 0.5 * ref_ent.sum()).backward()
    for x_place in (Replicate(), Shard(1)):
        xd = distribute_tensor(x, mesh, [x_place]).requires_grad_()
        wd = distribute_tensor(w, mesh, [Shard(0)]).requires_grad_()
        bd = distribute_tensor(b, mesh, [Shard(0)]).requires_grad_()
        lp, ent = logitless.linear_log_probs(xd, wd, t, bd, temperature=0.8, entropy=True, backend="torch")
        (lp.sum() + 0.5 * ent.sum()).backward()
        name = f"x {x_place}"
        assert_close_to_ref(f"{name}: logp", lp, None, ref_lp, torch.float64)
        assert_close_to_ref(f"{name}: entropy", ent, None, ref_ent, torch.float64)
        assert tuple(wd.grad.placements) == (Shard(0),), name
        assert_close_to_ref(f"{name}: dx", xd.grad.full_tensor(), None, xr.grad, torch.float64)
        assert_close_to_ref(f"{name}: dw", wd.grad.full_tensor(), None, wr.grad, torch.float64)
        assert_close_to_ref(f"{name}: db", bd.grad.full_tensor(), None, br.grad, torch.float64)
    wd = distribute_tensor(w, mesh, [Shard(0)])
    with pytest.raises(TypeError, match="register_fsdp_forward_method"):
        logitless.linear_log_probs(x, wd, t)
    with pytest.raises(ValueError, match="not both"):
        logitless.linear_log_probs(distribute_tensor(x, mesh, [Replicate()]), wd, t, process_group=dist.group.WORLD)


def test_dtensor():
    pytest.importorskip("torch.distributed.tensor", reason="DTensor needs torch >= 2.4")
    spawn(_dtensor_worker, 2)


def _triton_worker(rank, world, device):
    for case in (dict(name="triton-entropy", dtype=torch.float32, backend="triton", shape=(6,), h=16, bias=True,
                      entropy=True, temperature=0.7, softcap=3.0),
                 dict(name="triton-padded-partial", dtype=torch.float32, backend="triton", shape=(5,), h=16,
                      vocab_size=30, partial_dx=True, ignore_index=2)):
        _check_case(rank, device, [17, 16], case)


@TRITON_RANKS
def test_triton_backend():
    spawn(_triton_worker, 2)
