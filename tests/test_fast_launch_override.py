"""``override(fast_launch=False)``: the launch path as a per-context switch (the in-process
A/B of benchmarks/probe_launch_ab.py), and linear_jsd's launches through
``launch.run_kernel`` (the cached compiled kernels: the same results bitwise)."""

from __future__ import annotations

import pytest
import torch

from logitless.planning.overrides import override


def _fake_triton(monkeypatch):
    """JITFunction.run and the CUDA stream faked (CPU): returns (jit kernel, the launches
    through the cached compiled kernel, the launches through kernel[grid])."""
    from triton.runtime.jit import JITFunction

    from logitless.triton_lib import jsd_rows, launch

    jit = JITFunction(getattr(jsd_rows.jsd_finish_kernel, "fn", jsd_rows.jsd_finish_kernel))
    launched, slow = [], []

    class Compiled:
        packed_metadata, function = "packed", "function"

        def launch_metadata(self, grid, stream, *args):
            return None

        def run(self, *args):
            launched.append(args)

    compiled = Compiled()

    def jit_run(self, *args, grid, warmup, **kwargs):
        slow.append(grid)
        return compiled

    monkeypatch.setattr(JITFunction, "run", jit_run)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 7, raising=False)
    monkeypatch.setattr(launch, "FAST_LAUNCH", True)
    monkeypatch.setattr(launch, "_FAST", {})
    return jit, launched, slow


def test_override_sends_every_launch_through_kernel_grid(monkeypatch):
    """A key already cached launches directly by default; under override(fast_launch=False)
    the same call goes through kernel[grid] (and the counter says so); after the context
    the direct launch is back. Nested overrides keep the switch unless they name it."""
    from logitless.triton_lib import launch

    jit, launched, slow = _fake_triton(monkeypatch)
    n = 33
    args = (torch.zeros(n, 8), torch.zeros(n, dtype=torch.long), torch.zeros(4, 2, n), torch.zeros(2, 2, n),
            torch.zeros(6, n), n, 8, 2, 8, 1, n, 1.0)
    kw = dict(MODE=0, HAS_HARD=False, HAS_CAP_S=False, BLOCK_N=64, num_warps=4)
    launch.run_kernel(jit, (1,), *args, **kw)  # compiles (faked), caches
    assert len(slow) == 1 and not launched
    launch.run_kernel(jit, (1,), *args, **kw)
    assert len(slow) == 1 and len(launched) == 1
    before = dict(launch.LAUNCHES)
    with override(fast_launch=False):
        launch.run_kernel(jit, (1,), *args, **kw)
        with override(group_rows=2):  # an inner override of another field keeps the switch
            launch.run_kernel(jit, (1,), *args, **kw)
    assert len(slow) == 3 and len(launched) == 1
    assert launch.LAUNCHES["triton"] - before.get("triton", 0) == 2
    assert launch.LAUNCHES["fast"] == before.get("fast", 0)
    with override(fast_launch=True):
        launch.run_kernel(jit, (1,), *args, **kw)
    launch.run_kernel(jit, (1,), *args, **kw)
    assert len(slow) == 3 and len(launched) == 3


def test_fast_launch_is_an_override_field():
    from logitless.planning.overrides import current

    assert current().fast_launch is True
    with override(fast_launch=False) as o:
        assert o.fast_launch is False and current().fast_launch is False
    assert current().fast_launch is True


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the fast launch path runs compiled kernels (CUDA)")
@pytest.mark.parametrize("budget", [1 << 20, None])  # several forward chunks / vocab chunks; the default
def test_linear_jsd_launches_are_fast_and_bitwise(budget):
    """linear_jsd's kernels (row statistics, epilogues, dlogits) take the cached launches on
    a repeated call: loss and gradients bitwise equal to the same call with every launch
    through kernel[grid] (override(fast_launch=False), which holds in the backward too:
    no fast launch there)."""
    import logitless
    from logitless.triton_lib import launch

    g = torch.Generator().manual_seed(3)
    n, hs, ht, v = 300, 96, 160, 1009
    xs0 = torch.randn(n, hs, generator=g).to("cuda", torch.bfloat16)
    ws0 = (torch.randn(v, hs, generator=g) * 0.1).to("cuda", torch.bfloat16)
    xt = torch.randn(n, ht, generator=g).to("cuda", torch.bfloat16)
    wt = (torch.randn(v, ht, generator=g) * 0.1).to("cuda", torch.bfloat16)
    t = torch.randint(0, v, (n,), generator=g).to("cuda")

    def run():
        xs, ws = xs0.clone().requires_grad_(True), ws0.clone().requires_grad_(True)
        loss = logitless.linear_jsd(xs, ws, xt, wt, t, backend="triton", memory_budget=budget,
                                    hard_label_weight=0.25)
        loss.backward()
        return [loss.detach(), xs.grad, ws.grad]

    first = run()
    before = launch.LAUNCHES["fast"]
    second = run()
    assert launch.LAUNCHES["fast"] - before >= 5, dict(launch.LAUNCHES)  # stats (3), epilogues (2), dlogits
    with override(fast_launch=False):
        before = launch.LAUNCHES["fast"]
        slow = run()
        assert launch.LAUNCHES["fast"] == before
    for a, b, c in zip(first, second, slow):
        assert torch.equal(a, b) and torch.equal(a, c)
