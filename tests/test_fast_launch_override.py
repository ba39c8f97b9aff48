"""``override(fast_launch=False)``: the launch path as a per-context switch (the in-process
A/B of a probe listed in docs/history.md), and linear_jsd's launches through
``launch.run_kernel`` (the cached compiled kernels: the same results bitwise)."""

from __future__ import annotations

import pytest
import torch

from logitless.planning.overrides import override

from .helpers import fake_triton_launches


def _fake_triton(monkeypatch):
    """linear_jsd's finish kernel with Triton faked (CPU): ``helpers.fake_triton_launches``."""
    from logitless.triton_lib import jsd_rows

    return fake_triton_launches(monkeypatch, jsd_rows.jsd_finish_kernel, stream=7)


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
    before = dict(launch.LAUNCHES)
    second = run()
    fast = launch.LAUNCHES["fast"] - before["fast"]
    # every launch of the repeated call is a cached one (stats, epilogues, dlogits: how many
    # depends on the plan the budget gives)
    assert launch.LAUNCHES["triton"] == before["triton"] and fast > 0, dict(launch.LAUNCHES)
    with override(fast_launch=False):
        before = dict(launch.LAUNCHES)
        slow = run()
        assert launch.LAUNCHES["fast"] == before["fast"]
        assert launch.LAUNCHES["triton"] - before["triton"] == fast  # the same launches, all through kernel[grid]
    for a, b, c in zip(first, second, slow):
        assert torch.equal(a, b) and torch.equal(a, c)


@pytest.mark.parametrize("kernel", ["jsd_partial_kernel", "jsd_divergence_kernel", "jsd_finish_kernel",
                                    "jsd_loss_epilogue_kernel", "jsd_upstream_kernel", "jsd_dlogits_kernel",
                                    "jsd_backward_kernel"])
def test_launch_key_implies_tritons_specialisation_for_jsd_kernels(kernel):
    """linear_jsd's kernels now launch through ``run_kernel``: equal ``launch_key`` must
    imply equal Triton specialisation and options (Triton's own binder for sm_90, on the
    CPU), and the fast path must hand the launcher the values ``JITFunction.run`` would;
    over random arguments (tensors of several dtypes and alignments, TMA descriptors, ints
    around 1 / 16 / 2^31, floats (the kernels' scalar options), bools, None)."""
    import random

    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import JITFunction, create_function_from_signature

    from logitless.triton_lib import jsd_epilogue, jsd_rows, launch
    from logitless.triton_lib import linear_jsd_kernels as LK
    from tests.test_host_overhead import _random_launch_args

    fn = next(getattr(m, kernel) for m in (jsd_rows, jsd_epilogue, LK) if hasattr(m, kernel))
    jit = JITFunction(getattr(fn, "fn", fn))
    binder = create_function_from_signature(jit.signature, jit.params, make_backend(GPUTarget("cuda", 90, 32)))
    flat = {dt: torch.zeros(4096, dtype=dt) for dt in (torch.bfloat16, torch.float32, torch.int64)}
    pool_t = [flat[dt][off:off + 512] for dt in flat for off in (0, 1, 8, 16)]
    pool_t += [flat[dt][16:528].view(8, 64) for dt in flat]
    pool_t += [launch.descriptor(flat[torch.bfloat16][off:off + 1024].view(16, 64), (16, 64), (64, 1), bs)
               for bs in ((16, 64), (16, 32)) for off in (0, 64)] + [None]
    pool_i = [0, 1, 2, 16, 17, 2**31 - 1, 2**31, -1, 1.0, 0.5, -0.25, True, False]
    pool_c = [True, False, 0, 1, 2, 16, 64, "tf32", "tf32x3", None]
    same = {}
    for value in pool_t + pool_i + pool_c:
        same.setdefault(launch.launch_key(jit, 0, (value,), {}), []).append(value)
    g = random.Random(kernel)
    seen: dict = {}
    collisions = 0
    for _ in range(150):
        base_args, base_kwargs = _random_launch_args(jit.params, g, pool_t, pool_i, pool_c)
        for _ in range(5):
            def swap(a):
                return g.choice(same.get(launch.launch_key(jit, 0, (a,), {}), [a]))

            args = [swap(a) for a in base_args]
            kwargs = {k: swap(a) for k, a in base_kwargs.items()}
            ours = launch.launch_key(jit, 0, tuple(args), kwargs)
            bound, spec, options = binder(*args, **kwargs)
            tail = tuple((p.name, p.default) for p in list(jit.signature.parameters.values())[len(args):])
            assert launch.bound_values(tuple(args), kwargs, tail) == tuple(bound.values())
            theirs = (str(spec), str(options))
            if ours in seen:
                collisions += 1
                assert seen[ours] == theirs, (args, kwargs)
            seen[ours] = theirs
    assert collisions > 50
