"""The second Gluon probe's host side (``benchmarks/probe_gluon2.py``), on the CPU: the
Gluon kernels have no interpreter, so what can be checked here is their schedule
(replayed step for step in Python), their plans, the checks the GPU run relies on, and
that they compile for sm_90a without spills."""

import importlib.util
import math
import os
import sys

import pytest
import torch

BENCH = os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks")

gluon = pytest.importorskip("triton.experimental.gluon", reason="this triton has no Gluon")

#: Tests that launch the library's Triton kernels on CPU tensors (the suite's CPU mode).
needs_interpreter = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="launches the library's Triton kernels on CPU tensors: needs Triton's interpreter (the "
           "suite's CPU mode); on a GPU benchmarks/gpu/gluon2.sh checks the real kernels")


@pytest.fixture(scope="module")
def p2():
    sys.path.insert(0, BENCH)
    try:
        spec = importlib.util.spec_from_file_location("probe_gluon2", os.path.join(BENCH, "probe_gluon2.py"))
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        yield mod
    finally:
        sys.path.remove(BENCH)


SMALL = [(1, 64, 300), (300, 100, 3000), (1000, 1000, 50257), (300, 2048, 32000), (129, 16, 257 * 7)]


@pytest.mark.parametrize("name", ["persist", "persist_fill", "persist_nt", "dlogits", "dlogits_tma", "dlogits_np"])
@pytest.mark.parametrize("shape", SMALL)
@pytest.mark.parametrize("sms", [132, 5])
def test_persistent_schedule_replay(p2, name, shape, sms):
    """Every consumed ring step finds its own load, every tile is covered once, nothing
    is loaded past a program's end (asserted inside ``simulate``)."""
    N, H, V = shape
    plan = p2.Plan(name, N, H, V, sms, torch.device("cpu"))
    ksteps = math.ceil(H / p2.VARIANTS[name]["BK"])
    out = p2.simulate(plan, ksteps)
    assert out["max_blocks_per_program"] >= out["mean"]


@pytest.mark.parametrize("shape", SMALL)
@pytest.mark.parametrize("sms", [132, 5])
def test_overlap_schedule_replay(p2, shape, sms):
    """The epilogue-overlap kernel: no slot refilled under a running wgmma, every
    wgmma on its own step's load, epilogues in tile order, every item stored once."""
    N, H, V = shape
    cfg = p2.VARIANTS["overlap"]
    plan = p2.Plan("overlap", N, H, V, sms, torch.device("cpu"))
    for ksteps in (cfg["ahead"] + 1, max(cfg["ahead"] + 1, math.ceil(H / cfg["BK"]))):
        assert p2.simulate_overlap(plan, ksteps, cfg["stages"], cfg["ahead"])["ok"]


def test_overlap_schedule_any_depth(p2):
    """The replay holds for every ring depth and look-ahead with ahead < stages and
    ahead < ksteps (the host's condition), not only the variant's 6 / 3."""
    for shape in [(300, 100, 3000), (1, 64, 300)]:
        plan = p2.Plan("overlap", *shape, 5, torch.device("cpu"))
        for stages in range(2, 8):
            for ahead in range(1, stages):
                for ksteps in range(ahead + 1, ahead + 4):
                    assert p2.simulate_overlap(plan, ksteps, stages, ahead)["ok"]


def test_overlap_replay_catches_an_early_refill(p2):
    import inspect
    src = inspect.getsource(p2.simulate_overlap)
    right = "refill(it + stages)\n                it += 1"
    assert right in src
    ns = dict(vars(p2))
    exec(src.replace(right, "refill(it + stages + 1)\n                it += 1"), ns)
    plan = p2.Plan("overlap", 300, 100, 3000, 5, torch.device("cpu"))
    with pytest.raises(AssertionError, match="running wgmma"):
        ns["simulate_overlap"](plan, 5, 6, 3)


def test_schedule_replay_catches_a_wrong_cursor(p2, monkeypatch):
    plan = p2.Plan("persist", 300, 100, 3000, 5, torch.device("cpu"))
    real = p2._grouped_py
    calls = {"n": 0}

    def off_by_one(pid, *a):  # the consumer's 7th item lookup is wrong
        calls["n"] += 1
        r, c = real(pid, *a)
        return (r, c) if calls["n"] != 7 else (r, (c + 1) % plan.splits)

    monkeypatch.setattr(p2, "_grouped_py", off_by_one)
    with pytest.raises(AssertionError):
        p2.simulate(plan, 2)


@pytest.mark.parametrize("shape", [(4096, 2048, 128256), (8192, 4096, 128256), (16384, 2048, 32000)])
def test_fill_splits(p2, shape):
    """The grid-filling splits fill the persistent grid at least as well as the planner's
    and keep >= SMs / group splits (the grouped order's L2 footprint)."""
    N, H, V = shape
    fill = p2.Plan("persist_fill", N, H, V, 132, torch.device("cpu"))
    planner = p2.Plan("persist", N, H, V, 132, torch.device("cpu"))
    assert fill.splits >= math.ceil(132 / fill.group)
    assert fill.info()["fill"] >= planner.info()["fill"] - 1e-9
    blocks = p2.program_blocks(fill.row_blocks, fill.vblocks, fill.splits, fill.group, fill.grid)
    assert blocks.sum().item() == fill.row_blocks * fill.vblocks


@needs_interpreter
def test_dz_reference_and_check(p2):
    """float64 dz against softmax, the library's Triton dlogits launcher (interpreter)
    against it, and the check failing on a wrong target column or off-target entry."""
    N, H, V = 37, 48, 301
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(N, H, generator=g) / 4).to(torch.bfloat16)
    W = torch.randn(V, H, generator=g).to(torch.bfloat16)
    t = torch.randint(0, V, (N, ), generator=g)
    z = x.double() @ W.double().T
    lse = torch.logsumexp(z, 1).float()
    coef = p2.coefficients(N, t, "cpu")
    rows = torch.tensor([0, 5, 36])
    ref = p2.dz_reference(x, W, t, lse[rows].double(), coef, rows)
    a, b, c = coef.double()
    want = torch.softmax(z, 1) * a[:, None] - c[:, None]
    want[torch.arange(N), t] -= b
    torch.testing.assert_close(ref, want[rows], rtol=1e-6, atol=1e-9)

    dz = p2.triton_dlogits(x, W, t, lse, coef)()
    res = p2.check_dz(dz, ref, rows, dz, t)
    assert res["ok"] and res["dz_maxdiff_lib"] == 0.0, res
    bad = dz.clone()
    bad[5, t[5]] *= 0.5
    assert not p2.check_dz(bad, ref, rows, target=t)["ok"]
    bad = dz.clone()
    o = dz[0].float().abs()
    o[t[0]] = 0
    bad[0, o.argmax()] *= 1.5
    assert not p2.check_dz(bad, ref, rows, target=t)["ok"]


def test_compiles_for_sm90a_without_spills():
    """AOT compile (Gluon front end -> PTX -> the wheel's ptxas) in a subprocess: the
    suite's TRITON_INTERPRET=1 (conftest) turns kernels defined at import into
    interpreted ones."""
    import ast
    import subprocess

    names = ("persist", "persist_nt", "overlap", "dlogits", "dlogits_tma")
    env = dict(os.environ, TRITON_INTERPRET="0")
    proc = subprocess.run([sys.executable, os.path.join(BENCH, "probe_gluon2.py"), "--compile", "--variant",
                           ",".join(names)], capture_output=True, text=True, env=env, timeout=600)
    res = {line.split(":", 1)[0]: ast.literal_eval(line.split(":", 1)[1].strip())
           for line in proc.stdout.splitlines() if line.split(":", 1)[0] in names}
    assert proc.returncode == 0 and len(res) == len(names), proc.stdout[-3000:] + proc.stderr[-3000:]
    for name, r in res.items():
        assert r["ok"], (name, r)
        if r.get("spill_bytes") is None:
            pytest.skip(f"ptxas did not run: {r.get('ptxas_error')}")
        assert r["spill_bytes"] == 0, (name, r)
        assert r["wgmma_shape"] == ["m64n128k16" if name == "overlap" else "m64n256k16"], (name, r)
        assert r["shared"] <= 227 * 1024, (name, r)
        assert r["wgmma_serialized"] is False, (name, r)  # ptxas C7514: no MMA overlap left


def _emulated_launch(self):
    """A torch stand-in for the kernels (same partials / dz from the same plan), so the
    host side (descriptors, plan, buffers, merge, checks) runs end to end on the CPU."""
    p, cfg = self.plan, self.cfg
    z = self.x.double() @ self.W.double().T
    if cfg["kind"].startswith("dlogits"):
        lse = self.lse.double()
        a, b, c = self.coef.double()
        dz = torch.exp(z - lse[:, None]) * a[:, None] - c[:, None]
        dz[torch.arange(self.N), self.target] -= b
        self.dz.copy_(dz)
        return
    for split in range(p.splits):
        first = split * p.vblocks // p.splits
        last = (split + 1) * p.vblocks // p.splits
        lo, hi = first * cfg["BV"], min(last * cfg["BV"], self.V)
        zs = z[:, lo:hi]
        m = zs.max(1).values
        self.pm[split] = m.float()
        self.ps[split] = torch.exp(zs - m[:, None]).sum(1).float()
        inside = (self.target >= lo) & (self.target < hi)
        zt = z.gather(1, self.target[:, None]).squeeze(1)
        if cfg.get("target") is not False:
            self.pt[split] = torch.where(inside, zt, 0.0).float()


@pytest.mark.parametrize("name", ["sw", "persist", "persist_fill", "persist_nt", "overlap"])
def test_forward_host_side_with_emulated_kernel(p2, name, monkeypatch):
    """Runner + merge + the float64 check the GPU run applies, with the kernel emulated:
    the merge of the plan's partials gives lse and z_t within the check's bound, and a
    wrong partial is flagged."""
    sys.path.insert(0, BENCH)
    import probe_gluon as pg
    sys.path.remove(BENCH)
    monkeypatch.setattr(p2.Runner, "launch", _emulated_launch)
    N, H, V = 300, 256, 3001
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(N, H, generator=g) / 8).to(torch.bfloat16)
    W = torch.randn(V, H, generator=g).to(torch.bfloat16)
    t = torch.randint(0, V, (N, ), generator=g)
    r = p2.Runner(name, x, W, t, 5)
    rows = torch.arange(0, N, 7)
    ref = (rows, *pg.reference_rows(x, W, t, rows))
    res = pg.check(r(), ref, None, None)
    assert res["ok"] and res["lse_err_f64"] < 1e-6, res
    lse, zt = r()
    assert not pg.check((lse + 0.01, zt), ref, None, None)["ok"]


@pytest.mark.parametrize("name", ["dlogits", "dlogits_tma", "dlogits_np"])
def test_dlogits_host_side_with_emulated_kernel(p2, name, monkeypatch):
    monkeypatch.setattr(p2.Runner, "launch", _emulated_launch)
    N, H, V = 70, 64, 1001
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(N, H, generator=g) / 8).to(torch.bfloat16)
    W = torch.randn(V, H, generator=g).to(torch.bfloat16)
    t = torch.randint(0, V, (N, ), generator=g)
    lse = torch.logsumexp(x.double() @ W.double().T, 1).float()
    coef = p2.coefficients(N, t, "cpu")
    r = p2.Runner(name, x, W, t, 5, lse, coef)
    rows = torch.tensor([0, 33, 69])
    ref = p2.dz_reference(x, W, t, lse[rows].double(), coef, rows)
    res = p2.check_dz(r(), ref, rows, None, t)
    assert res["ok"], res


def test_overlap_refuses_short_hidden(p2):
    """H <= AHEAD * BK would leave the look-ahead waiting on loads never issued (a hang
    on the GPU): the host refuses it with a clear error."""
    x = torch.zeros(16, 192, dtype=torch.bfloat16)
    W = torch.zeros(300, 192, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="steps of H"):
        p2.Runner("overlap", x, W, torch.zeros(16, dtype=torch.int64), 5)


class _FakeEvent:
    """torch.cuda.Event stand-in on the CPU: wall-clock stamps."""

    def __init__(self, enable_timing=True):
        self.t = None

    def record(self):
        import time
        self.t = time.perf_counter()

    def elapsed_time(self, other):
        return (other.t - self.t) * 1e3


@needs_interpreter
def test_run_shape_end_to_end_on_cpu(p2, monkeypatch):
    """``run_shape`` as the GPU run calls it (checks against float64 and the library,
    interleaved timing, ratios), on the CPU: the kernels emulated, the library's Triton
    dlogits on the interpreter, CUDA events replaced by wall-clock stamps. Every variant
    checks ok and gets a time; a variant whose launch raises gets its error recorded."""
    sys.path.insert(0, BENCH)
    import probe_gluon as pg
    sys.path.remove(BENCH)
    real_inputs = pg.inputs

    def cpu_inputs(N, H, V, seed=0):
        g = torch.Generator().manual_seed(seed)
        x = (torch.randn(N, H, generator=g) / math.sqrt(H) * 2).to(torch.bfloat16)
        W = torch.randn(V, H, generator=g).to(torch.bfloat16)
        return x, W, torch.randint(0, V, (N, ), generator=g)

    assert real_inputs is not None
    monkeypatch.setattr(pg, "inputs", cpu_inputs)
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda *a, **k: None)
    monkeypatch.setattr(p2.Runner, "launch", _emulated_launch)
    names = ["sw", "persist_fill", "persist_nt", "overlap", "dlogits_tma"]
    out = p2.run_shape(20, 200, 301, names, 3, 5)
    assert "lib_check" in out and out["lib_check"]["ok"], out.get("lib_check", out.get("lib_error"))
    assert out["lib_dz_check"]["ok"], out.get("lib_dz_check", out.get("lib_dz_error"))
    assert out["cublas_ms"] > 0 and out["triton_ratio"] > 0 and out["triton_dlogits_ratio"] > 0
    for name in names:
        rec = out["variants"][name]
        assert rec["check"]["ok"], (name, rec)
        assert rec["ratio"] > 0 and rec["kernel_ratio"] > 0, (name, rec)
    assert "| 20 x 200 x 301 |" in p2.table([out], names, markdown=True)

    def broken(self):
        raise RuntimeError("launch failed")

    monkeypatch.setattr(p2.Runner, "launch", broken)
    out = p2.run_shape(20, 200, 301, ["persist"], 3, 5, with_lib=False)
    assert "launch failed" in out["variants"]["persist"]["error"]
