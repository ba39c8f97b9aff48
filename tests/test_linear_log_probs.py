"""linear_log_probs against the float64 reference, for every backend and option.

On the GPU when there is one; otherwise the Triton backend runs on the CPU interpreter
(conftest.py), at small sizes (V prime, H not a multiple of 16).
"""

from __future__ import annotations

import math

import pytest
import torch

import logitless
from logitless.formulas.log_probs import finish, merge_splits, online_update
from logitless.ops.common.contract import Needs
from logitless.ops.linear_log_probs import triton_backend as llp_triton
from logitless.ops.linear_log_probs.api import BACKENDS as LLP_BACKENDS
from logitless.ops.linear_log_probs.api import OPS
from logitless.ops.linear_log_probs.contract import LlpBackwardCall, LlpCall
from logitless.ops.linear_log_probs.custom_op import planned, replan
from logitless.ops.linear_log_probs.reference import linear_log_probs_reference
from logitless.options import LogProbOptions, VocabParallelOptions
from logitless.planning.overrides import override
from tests.conftest import DEVICE, HAS_CUDA
from tests.helpers import AllocationRecorder, assert_close_to_ref, max_err

BACKENDS = ["torch", "triton"]

OPTIONS = {
    "plain": {},
    "temperature": {"temperature": 0.7},
    "entropy": {"entropy": True},
    "softcap": {"softcap": 4.0},
    "ignore": {"_ignore": 0.3},
    "bias": {"_bias": True},
    "all": {"temperature": 0.6, "entropy": True, "softcap": 5.0, "_ignore": 0.3, "_bias": True},
    "hot": {"temperature": 1.7, "entropy": True, "_bias": True},
}


def make_inputs(lead, hidden, vocab, dtype, opts, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, hidden, generator=g).to(dtype)
    w = (torch.randn(vocab, hidden, generator=g) * hidden**-0.5 * 3).to(dtype)
    tokens = torch.randint(0, vocab, lead, generator=g)
    if opts.get("_ignore"):
        tokens[torch.rand(lead, generator=g) < opts["_ignore"]] = -100
    bias = (torch.randn(vocab, generator=g) * 0.5).to(dtype).to(DEVICE).requires_grad_() if opts.get("_bias") else None
    kw = {k: v for k, v in opts.items() if not k.startswith("_")}
    return x.to(DEVICE).requires_grad_(), w.to(DEVICE).requires_grad_(), tokens.to(DEVICE), bias, kw


def _outputs(out, entropy):
    return out if entropy else (out, None)


def check(backend, dtype, lead, hidden, vocab, opts, seed, budget=None):
    x, w, t, b, kw = make_inputs(lead, hidden, vocab, dtype, opts, seed)
    entropy = kw.get("entropy", False)
    ours = _outputs(logitless.linear_log_probs(x, w, t, b, backend=backend, memory_budget=budget, **kw), entropy)
    ref_kw = {k: v for k, v in kw.items() if k != "entropy"}
    ref = linear_log_probs_reference(x, w, t, b, **ref_kw)
    same = linear_log_probs_reference(x, w, t, b, dtype=dtype, **ref_kw)
    assert ours[0].dtype == torch.float32 and ours[0].shape == t.shape
    stat_dtype = torch.float32 if dtype == torch.float32 else dtype
    assert_close_to_ref("logp", ours[0], same[0], ref[0], stat_dtype)
    if entropy:
        assert_close_to_ref("entropy", ours[1], same[1], ref[1], stat_dtype)
    # Upstream gradients on both outputs (any values, any sign).
    g = torch.Generator().manual_seed(seed + 1)
    g_lp = torch.randn(t.shape, generator=g).to(DEVICE)
    g_h = torch.randn(t.shape, generator=g).to(DEVICE)
    params = [p for p in (x, w, b) if p is not None]

    def total(outs):
        s = (outs[0] * g_lp).sum()
        return s + (outs[1] * g_h).sum() if entropy else s

    grads = torch.autograd.grad(total(ours), params)
    ref_grads = torch.autograd.grad(total(ref), params)
    same_grads = torch.autograd.grad(total(same), params)
    for name, a, s, r in zip(("dx", "dw", "db"), grads, same_grads, ref_grads):
        assert a.dtype == dtype
        assert_close_to_ref(name, a, s, r, dtype)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(OPTIONS))
def test_fp32_every_option(backend, name):
    check(backend, torch.float32, (2, 5), 20, 61, OPTIONS[name], seed=hash(name) % 1000)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", ["plain", "all", "hot"])
def test_16bit(backend, dtype, name):
    check(backend, dtype, (11,), 24, 67, OPTIONS[name], seed=7)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("budget", [1, 3_000, 30_000])
def test_budgets_keep_some_or_none(backend, budget):
    """Tiny budgets: the Triton backend keeps a few columns and recomputes the rest."""
    check(backend, torch.float32, (23,), 40, 257, OPTIONS["all"], seed=3, budget=budget)
    check(backend, torch.bfloat16, (23,), 40, 257, {"entropy": True, "temperature": 0.5}, seed=4, budget=budget)


def test_triton_keeps_columns_when_the_budget_allows():
    opts = LogProbOptions(0.7, True, None, -100)

    def shapes(dtype, budget, opts, need_grad):
        x, w = torch.zeros(23, 40, dtype=dtype, device=DEVICE), torch.zeros(257, 40, dtype=dtype, device=DEVICE)
        backend = llp_triton.TritonBackend()
        return backend.kept_shapes(backend.plan(x, w, None, opts, budget=budget, need_grad=need_grad), 23)

    kept = shapes(torch.float32, 30_000, opts, True)
    if torch.device(DEVICE).type != "cuda":  # the budget rule: keep what fits (GPUs: the cost model's pick)
        assert kept is not None and kept[0][1] > 0
    # fp16 with entropy or a soft-cap, or no gradient: nothing kept (log e would underflow)
    assert shapes(torch.float16, 10**9, opts, True) is None
    assert shapes(torch.float32, 10**9, opts, False) is None
    wide_cap = LogProbOptions(0.5, True, 30.0, -100)  # exp(-2 s / T) underflows
    assert shapes(torch.bfloat16, 10**9, wide_cap, True) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["entropy", "softcap", "all"])
def test_every_column_kept_with_log(dtype, name):
    """The forced "keep" plan: the kept pass takes log e (entropy, a soft-cap; on an NVIDIA GPU
    the MUFU's, ``tile_io.kept_log``) and its gradients still match float64."""
    with override(strategy=("keep", 0)):
        x = torch.zeros(74, 40, dtype=dtype, device=DEVICE)
        w = torch.zeros(263, 40, dtype=dtype, device=DEVICE)
        opts = LogProbOptions(OPTIONS[name].get("temperature", 1.0), OPTIONS[name].get("entropy", False),
                              OPTIONS[name].get("softcap"), -100)
        backend = llp_triton.TritonBackend()
        kept = backend.kept_shapes(backend.plan(x, w, None, opts, budget=10**9, need_grad=True), 74)
        assert kept is not None and kept[0][1] > 0  # (the GPU plans recompute the last partial tile)
        check("triton", dtype, (2, 37), 40, 263, OPTIONS[name], seed=31, budget=10**9)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_recomputed_chunks_reuse_the_spent_kept_columns(dtype, monkeypatch):
    """A plan that keeps most columns and recomputes the rest (eager: the backward owns the
    kept buffer): once the kept columns' dz has fed their GEMMs, the recomputed chunks' dz is
    laid in that buffer's storage (``launch.dz_buffer``: no new memory, as the cost model
    counts it), and the gradients still match float64 (odd sizes, entropy, bias)."""
    from logitless.planning import plans
    from logitless.triton_lib import launch

    lead, h, v = (3, 13), 40, 263
    n, itemsize = math.prod(lead), dtype.itemsize
    for budget in range(n * v * itemsize // 2, 2 * n * v * itemsize, n * itemsize):
        plan = plans.triton_plan(n, v, h, itemsize, budget, torch.device(DEVICE), keep_allowed=True)
        if 0 < min(plan.vocab_chunk, v - plan.keep_cols) <= plan.keep_cols < v:
            break
    else:
        pytest.skip("this device's planner keeps every column or too few at these sizes")
    laid = []
    real = launch.dz_buffer

    def spy(*args, spent=None, **kw):
        buf = real(*args, spent=spent, **kw)
        laid.append(spent is not None and buf.untyped_storage().data_ptr() == spent.untyped_storage().data_ptr())
        return buf

    monkeypatch.setattr(launch, "dz_buffer", spy)
    check("triton", dtype, lead, h, v, OPTIONS["all"], seed=41, budget=budget)
    assert laid == [True], laid


@pytest.mark.parametrize("backend", BACKENDS)
def test_shapes_one_token_3d_empty(backend):
    check(backend, torch.float32, (1,), 16, 5, OPTIONS["all"], seed=11)
    check(backend, torch.float32, (2, 3, 2), 17, 31, {"entropy": True, "temperature": 0.9}, seed=12)
    x = torch.zeros(0, 8, device=DEVICE, requires_grad=True)
    w = torch.randn(13, 8, device=DEVICE, requires_grad=True)
    lp, ent = logitless.linear_log_probs(x, w, torch.zeros(0, dtype=torch.long, device=DEVICE), entropy=True,
                                         backend=backend)
    assert lp.shape == (0,) and ent.shape == (0,)
    (lp.sum() + ent.sum()).backward()
    assert torch.equal(w.grad, torch.zeros_like(w))


@pytest.mark.parametrize("backend", BACKENDS)
def test_ignored_tokens_give_zero_and_no_gradient(backend):
    x, w, t, b, _ = make_inputs((9,), 16, 29, torch.float32, {}, seed=5)
    t[2] = t[6] = -1
    lp, ent = logitless.linear_log_probs(x, w, t, b, temperature=0.8, entropy=True, ignore_index=-1, backend=backend)
    assert lp[2] == 0 and ent[6] == 0 and lp[0] < 0 and ent[0] > 0
    (lp.sum() * 3 + ent.sum()).backward()
    assert torch.all(x.grad[2] == 0) and torch.all(x.grad[6] == 0) and x.grad[0].abs().sum() > 0


def test_finite_differences_float64():
    """The new gradient (both outputs, temperature, soft-cap, bias) by finite differences."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 6, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(9, 6, generator=g, dtype=torch.float64, requires_grad=True)
    b = torch.randn(9, generator=g, dtype=torch.float64, requires_grad=True)
    t = torch.tensor([0, 8, -100, 3])
    for kw in ({"temperature": 0.7, "entropy": True, "softcap": 3.0},
               {"temperature": 1.9, "entropy": True}, {"temperature": 0.5}):
        def f(x, w, b, kw=kw):
            out = logitless.linear_log_probs(x, w, t, b, backend="torch", memory_budget=300, **kw)
            return out if kw.get("entropy") else (out,)
        assert torch.autograd.gradcheck(f, (x, w, b), eps=1e-6, atol=1e-7)


def test_temperature_divides_fp32_logits_not_bf16_x():
    """bf16 x at T = 0.7: the result is exact for the bf16 inputs (x / T never rounded)."""
    x, w, t, _, _ = make_inputs((64,), 48, 101, torch.bfloat16, {}, seed=21)
    for backend in BACKENDS:
        lp, ent = logitless.linear_log_probs(x, w, t, temperature=0.7, entropy=True, backend=backend)
        ref_lp, ref_ent = linear_log_probs_reference(x, w, t, temperature=0.7)
        assert max_err(lp, ref_lp) < 1e-4 and max_err(ent, ref_ent) < 1e-4
        # What the x / T workaround gives (rounded in bf16): measurably worse.
        via_x = linear_log_probs_reference((x / 0.7).to(torch.bfloat16), w, t)[0]
        assert max_err(via_x, ref_lp) > 10 * max_err(lp, ref_lp)


@pytest.mark.parametrize("temperature", [0.0, -1.0, float("nan"), float("inf")])
def test_bad_temperature(temperature):
    x, w, t, _, _ = make_inputs((3,), 8, 7, torch.float32, {}, seed=1)
    with pytest.raises(ValueError, match="temperature"):
        logitless.linear_log_probs(x, w, t, temperature=temperature)


def test_bad_arguments():
    x, w, t, _, _ = make_inputs((3,), 8, 7, torch.float32, {}, seed=1)
    with pytest.raises(TypeError, match="temperature"):
        logitless.linear_log_probs(x, w, t, temperature=True)
    with pytest.raises(TypeError, match="entropy"):
        logitless.linear_log_probs(x, w, t, entropy=1)
    with pytest.raises(ValueError, match="softcap"):
        logitless.linear_log_probs(x, w, t, softcap=-2.0)
    with pytest.raises(ValueError, match="tokens"):
        logitless.linear_log_probs(x, w, t[:2])
    with pytest.raises(TypeError, match="tokens"):
        logitless.linear_log_probs(x, w, t.float())
    with pytest.raises(ValueError, match="hidden size"):
        logitless.linear_log_probs(x, w[:, :5], t)
    with pytest.raises(TypeError, match="weight"):
        logitless.linear_log_probs(x, w.double(), t)
    with pytest.raises(ValueError, match="memory_budget"):
        logitless.linear_log_probs(x, w, t, memory_budget=0)
    with pytest.raises(ValueError, match="backend"):
        logitless.linear_log_probs(x, w, t, backend="cuda")


@pytest.mark.skipif(HAS_CUDA, reason="the CPU check; on a GPU an out-of-range token gives NaN")
def test_token_out_of_range_cpu():
    x, w, t, _, _ = make_inputs((3,), 8, 7, torch.float32, {}, seed=1)
    t[1] = 7
    for backend in BACKENDS:
        with pytest.raises(ValueError, match="tokens contains"):
            logitless.linear_log_probs(x, w, t, backend=backend)


@pytest.mark.skipif(not HAS_CUDA, reason="GPU behaviour: an out-of-range token gives NaN (no host sync)")
def test_token_out_of_range_gpu_is_nan():
    x, w, t, _, _ = make_inputs((3,), 8, 7, torch.float32, {}, seed=1)
    t[1] = 7
    lp, ent = logitless.linear_log_probs(x, w, t, entropy=True)
    assert torch.isnan(lp[1]) and torch.isnan(ent[1]) and not torch.isnan(lp[0])


@pytest.mark.parametrize("backend", BACKENDS)
def test_bitwise_repeatable_and_retain_graph(backend):
    x, w, t, b, kw = make_inputs((19,), 24, 83, torch.bfloat16, OPTIONS["all"], seed=9)

    def run(retain=False):
        lp, ent = logitless.linear_log_probs(x, w, t, b, backend=backend, **kw)
        loss = lp.sum() - 0.3 * ent.sum()
        first = torch.autograd.grad(loss, (x, w, b), retain_graph=retain)
        if retain:  # the kept columns were consumed: the second backward recomputes
            second = torch.autograd.grad(loss, (x, w, b))
            for a, c in zip(first, second):
                assert torch.equal(a, c) or max_err(a, c) <= 1e-2 * a.abs().max().item()
        return (lp, ent) + first

    a, c = run(), run(retain=True)
    for u, v in zip(a, c):
        assert torch.equal(u, v)


def test_double_backward_raises():
    x, w, t, _, _ = make_inputs((4,), 8, 11, torch.float64, {}, seed=2)
    lp = logitless.linear_log_probs(x, w, t, backend="torch")
    (gx,) = torch.autograd.grad(lp.sum(), (x,), create_graph=True)
    with pytest.raises(RuntimeError, match="double backward"):
        gx.sum().backward()


def test_only_entropy_gets_a_gradient():
    x, w, t, _, _ = make_inputs((6,), 12, 17, torch.float64, {}, seed=4)
    _, ent = logitless.linear_log_probs(x, w, t, entropy=True, temperature=0.8, backend="torch")
    (gx,) = torch.autograd.grad(ent.sum(), (x,))
    _, ref_ent = linear_log_probs_reference(x, w, t, temperature=0.8)
    (rx,) = torch.autograd.grad(ref_ent.sum(), (x,))
    assert max_err(gx, rx) < 1e-10


def test_no_grad_keeps_nothing_and_entropy_false_returns_a_tensor():
    x, w, t, _, _ = make_inputs((12,), 16, 41, torch.float32, {}, seed=6)
    with torch.no_grad():
        call = LlpCall(x, w, None, t, LogProbOptions(), "triton", 10**8, need_grad=False, need_dw=True, top_k=None,
                       top_p=None, min_p=None, checked=True, k_max=-1, block=0, tp=VocabParallelOptions())
        out = OPS.outputs_of(OPS.forward_op(*OPS.args(call)))
    config = replan(LlpBackwardCall(out.logp, None, x, w, None, t, out.lse, None, out.keep, out.keep_max, None,
                                    LogProbOptions(), "triton", Needs(True, True, False), None, None, None, None,
                                    VocabParallelOptions(), planned(call)), llp_triton.TritonBackend())
    assert out.keep.shape == (1, 1) and not config.main.keeps \
        and out.entropy.numel() == 0
    lp = logitless.linear_log_probs(x, w, t)
    assert isinstance(lp, torch.Tensor) and lp.shape == (12,)


def test_memory_stays_within_budget():
    """No tokens x vocab tensor: the largest allocation stays below the logits' size."""
    n, h, v = 256, 16, 997
    x, w, t, _, _ = make_inputs((n,), h, v, torch.float32, {}, seed=8)
    rec = AllocationRecorder()
    with rec:
        lp, ent = logitless.linear_log_probs(x, w, t, entropy=True, temperature=0.7, backend="torch",
                                             memory_budget=60_000)
        (lp.sum() + ent.sum()).backward()
    assert rec.largest <= max(v * h, n * v // 8), (rec.largest, rec.largest_op)  # dW is an output


def test_merge_of_split_statistics():
    """The tensor-parallel merge rule: statistics over vocabulary parts merge exactly."""
    g = torch.Generator().manual_seed(3)
    a = torch.randn(5, 40, generator=g, dtype=torch.float64) * 4
    a[1, :25] = float("-inf")  # a part with nothing but -inf
    parts = []
    for cols in (slice(0, 25), slice(25, 31), slice(31, 40)):
        m0 = torch.full((5,), float("-inf"), dtype=torch.float64)
        zero = torch.zeros(5, dtype=torch.float64)
        parts.append(online_update(a[:, cols].clone(), m0, zero, zero.clone()))
    m, s, u = (torch.stack(z) for z in zip(*parts))
    lse, ent = merge_splits(m, s, u)
    lp = torch.log_softmax(a, dim=1)
    assert torch.allclose(lse, torch.logsumexp(a, 1), atol=1e-12)
    assert torch.allclose(ent, -(lp.exp() * lp).nan_to_num().sum(1), atol=1e-12)
    lse1, _ = finish(*online_update(a.clone(), torch.full((5,), -math.inf, dtype=torch.float64),
                                    torch.zeros(5, dtype=torch.float64), None))
    assert torch.allclose(lse1, lse, atol=1e-12)


def test_autocast_as_f_linear():
    x, w, t, _, _ = make_inputs((10,), 16, 37, torch.float32, {}, seed=14)
    with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
        lp, ent = logitless.linear_log_probs(x, w, t, entropy=True, temperature=0.7)
    expect = logitless.linear_log_probs(x.bfloat16(), w.bfloat16(), t, entropy=True, temperature=0.7)
    assert torch.equal(lp, expect[0]) and torch.equal(ent, expect[1]) and lp.dtype == torch.float32
    (lp.sum() + ent.sum()).backward()
    assert w.grad.dtype == torch.float32


class _Head(torch.nn.Module):
    def __init__(self, backend, **kw):
        super().__init__()
        self.proj = torch.nn.Linear(12, 12)
        self.head = torch.nn.Linear(12, 53, bias=False)
        self.logp = logitless.LinearLogProbs(backend=backend, **kw)

    def forward(self, h, tokens):
        lp, ent = self.logp(torch.tanh(self.proj(h)), self.head.weight, tokens)
        return (lp * 0.5).sum() - ent.mean()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dynamic", [False, True])
def test_compile_fullgraph(backend, dynamic):
    torch.manual_seed(0)
    model = _Head(backend, temperature=0.7, entropy=True, memory_budget=4_000).to(DEVICE)
    compiled = torch.compile(model, fullgraph=True, dynamic=dynamic)
    for shape in ((2, 9), (3, 5)):
        h = torch.randn(*shape, 12, device=DEVICE)
        t = torch.randint(0, 53, shape, device=DEVICE)
        eager = torch.autograd.grad(model(h, t), list(model.parameters()))
        comp = torch.autograd.grad(compiled(h, t), list(model.parameters()))
        for a, c in zip(eager, comp):
            assert max_err(a, c) <= 1e-5 * max(1.0, a.abs().max().item())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("need_grad", [False, True])
def test_opcheck(backend, need_grad):
    x, w, t, b, _ = make_inputs((13,), 24, 104, torch.float32, {"_bias": True}, seed=5)
    opts, tp = LogProbOptions(temperature=0.7, entropy=True, softcap=4.0), VocabParallelOptions()
    budget = 10**9 if HAS_CUDA else 6_000  # (CPU: a few columns kept; a GPU's cost model keeps none at 6 kB)
    call = LlpCall(x, w, b, t, opts, backend, budget, need_grad=need_grad, need_dw=True, top_k=None, top_p=None,
                   min_p=None, checked=True, k_max=-1, block=0, tp=tp)
    torch.library.opcheck(OPS.forward_op, OPS.args(call),
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))
    out = OPS.outputs_of(OPS.forward_op(*OPS.args(call)))
    bcall = LlpBackwardCall(torch.randn_like(out.logp), torch.randn_like(out.entropy), x.detach(), w.detach(),
                            b.detach(), t, out.lse, out.entropy.detach(), out.keep, out.keep_max, None, opts,
                            backend, Needs(True, True, True), None, None, None, None, tp, planned(call))
    decoded = getattr(replan(bcall, LLP_BACKENDS[backend]), "main", None)  # (the backward op's Config)
    if backend == "triton" and need_grad:
        assert out.keep.shape[1] > 1 and decoded.keeps
    else:
        assert out.keep.shape == (1, 1) and (decoded is None or not decoded.keeps)
    torch.library.opcheck(OPS.backward_op, OPS.backward_args(bcall))


@pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                    reason="needs torch.distributed with gloo")
def test_dtensor_weight_gets_the_fsdp_error(tmp_path):
    """A DTensor weight (e.g. FSDP2-sharded, used outside the module's forward): one clear error."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        w = distribute_tensor(torch.randn(11, 8), mesh, [Shard(0)])
        with pytest.raises(TypeError, match="DTensor.*register_fsdp_forward_method"):
            logitless.linear_log_probs(torch.randn(3, 8), w, torch.tensor([0, 1, 2]))
        with pytest.raises(TypeError, match="DTensor"):
            logitless.log_probs(distribute_tensor(torch.randn(4, 11), mesh, [Shard(0)]), torch.tensor([0, 1, 2, 3]))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("backend", BACKENDS)
def test_vocabulary_shards_merge_like_tensor_parallelism(backend):
    """What a tensor-parallel wrapper will do: each shard's backend forward with the token
    relative to the shard, partials merged (max, then sums), the backward per shard with
    the merged lse and entropy. Equal to the unsharded op."""
    from logitless.formulas.log_probs import LogProbStats, grad_coefficients, partials_of, token_outputs
    from logitless.ops.linear_log_probs.api import BACKENDS as LLP_BACKENDS

    impl = LLP_BACKENDS[backend]
    x, w, t, b, _ = make_inputs((13,), 24, 71, torch.float32, {"_bias": True}, seed=31)
    opts = LogProbOptions(0.8, True, 3.0, -100)
    x, w, b = x.detach(), w.detach(), b.detach()
    t[4] = -100
    bounds = [(0, 30), (30, 31), (31, 71)]
    plans = [impl.plan(x, w[v0:v1], b[v0:v1], opts, budget=2**20, need_grad=False) for v0, v1 in bounds]
    parts = [impl.forward(x, w[v0:v1], b[v0:v1], t - v0, opts, p, outputs=False)[0]
             for (v0, v1), p in zip(bounds, plans)]
    m, s, u = (torch.stack(z) for z in zip(*[partials_of(p.lse, p.entropy) for p in parts]))
    lse, ent = merge_splits(m, s, u)
    stats = LogProbStats(lse, sum(p.target for p in parts), ent)
    logp, ent = token_outputs(stats, t, 71, opts)
    xr, wr, br = (p.clone().requires_grad_() for p in (x, w, b))
    ref_lp, ref_ent = logitless.linear_log_probs(xr, wr, t, br, temperature=0.8, entropy=True, softcap=3.0,
                                                 backend=backend)
    assert max_err(logp, ref_lp) < 1e-5 and max_err(ent, ref_ent) < 1e-5
    g_lp, g_h = torch.randn(13, device=DEVICE), torch.randn(13, device=DEVICE)
    coef = grad_coefficients(ent, t, g_lp, g_h, 71, opts, lse)
    dx = torch.zeros_like(x)
    dw, db = [], []
    for (v0, v1), plan in zip(bounds, plans):
        gx, gw, gb = impl.backward(x, w[v0:v1], b[v0:v1], t - v0, opts, lse, coef, plan, kept=None, need_dx=True,
                                   need_dw=True, need_db=True)
        dx += gx
        dw.append(gw)
        db.append(gb)
    rx, rw, rb = torch.autograd.grad((ref_lp * g_lp).sum() + (ref_ent * g_h).sum(), (xr, wr, br))
    assert max_err(dx, rx) < 1e-5 and max_err(torch.cat(dw), rw) < 1e-5 and max_err(torch.cat(db), rb) < 1e-5
