"""Planner grid: every planner's result over shapes x budgets x flags x devices x overrides,
one line per call (device|override|call|sha1 of the result's repr). Devices are simulated
through torch.cuda (what the library reads of a device), so the same script runs on a tree
before and after a planner refactor; equal files mean equal plans.

    PYTHONPATH=src python benchmarks/check_plan_grid.py OUT.txt
"""
import contextlib
import hashlib
import itertools
import os
import sys
import tempfile
import time
import types
import warnings
from unittest import mock

os.environ["LOGITLESS_CACHE_DIR"] = tempfile.mkdtemp()
os.environ.pop("LOGITLESS_TUNED", None)
import torch

from logitless.ops.linear_jsd import planning as ljsd
from logitless.planning import cute, logits, memo, plans, rocm
from logitless.planning.overrides import override
from logitless.planning.tiles import TritonPlan
from logitless.triton_lib import launch
from logitless.triton_lib import log_probs_candidates as lpc

GiB = 1 << 30
DEVICES = {
    "cpu": None,
    "H100": dict(hip=None, name="NVIDIA H100 80GB HBM3", sms=132, cap=(9, 0), l2=50 << 20, arch=""),
    "H200": dict(hip=None, name="NVIDIA H200", sms=132, cap=(9, 0), l2=60 << 20, arch=""),
    "A100": dict(hip=None, name="NVIDIA A100-SXM4-80GB", sms=108, cap=(8, 0), l2=40 << 20, arch=""),
    "MI300X": dict(hip="6.4.43482", name="AMD Instinct MI300X", sms=304, cap=(9, 4), l2=4 << 20,
                   arch="gfx942:sramecc+:xnack-"),
    "MI355X": dict(hip="6.4.43482", name="AMD Instinct MI355X", sms=256, cap=(9, 5), l2=4 << 20,
                   arch="gfx950:sramecc+:xnack-"),
}


@contextlib.contextmanager
def simulated(spec):
    memo.clear()
    rocm._arch_of.cache_clear()
    if spec is None:
        yield torch.device("cpu")
        return
    props = types.SimpleNamespace(name=spec["name"], multi_processor_count=spec["sms"], L2_cache_size=spec["l2"],
                                  gcnArchName=spec["arch"], major=spec["cap"][0], minor=spec["cap"][1])
    with mock.patch.object(torch.version, "hip", spec["hip"]), \
         mock.patch.object(torch.cuda, "get_device_properties", lambda d=None: props), \
         mock.patch.object(torch.cuda, "get_device_name", lambda d=None: spec["name"]), \
         mock.patch.object(torch.cuda, "get_device_capability", lambda d=None: spec["cap"]), \
         mock.patch.object(torch.cuda, "current_device", lambda: 0), \
         mock.patch.object(cute, "dsl_problem", lambda: None):
        try:
            yield torch.device("cuda", 0)
        finally:
            memo.clear()
    rocm._arch_of.cache_clear()


class FakeT:
    def __init__(self, shape, dtype, device):
        self.shape, self.dtype, self.device = torch.Size(shape), dtype, device
    def stride(self):
        return (self.shape[1], 1)
    def data_ptr(self):
        return 1 << 20


OVERRIDES = {"none": {}, "tiles": dict(tiles=(64, 128, 32, 4, 3)), "gif": dict(strategy=("grad_in_forward", 64)),
             "partial": dict(strategy=("partial", 0)), "pre1": dict(tf32_preround=True),
             "pre0": dict(tf32_preround=False), "cute1": dict(cute=True), "cute0": dict(cute=False),
             "jsd1": dict(jsd_fused_forward=True), "jsd0": dict(jsd_fused_forward=False)}
NS = (1, 37, 512, 2048, 4096, 16384)
VS = (131, 32000, 50257, 128256, 151936)
HS = (64, 2048, 4096)
BUDGETS = (60_000, 1 << 20, 64 << 20, 256 << 20, int(2.4 * GiB), 8 * GiB)


SMALL = dict(NS=(37, 4096, 16384), VS=(131, 50257, 128256), HS=(64, 4096), BUDGETS=(60_000, 256 << 20, 8 * GiB))
FULL = dict(NS=NS, VS=VS, HS=HS, BUDGETS=BUDGETS)


def rows(dev, full):
    g = FULL if full else SMALL
    for n, v, h, isz, b in itertools.product(g["NS"], g["VS"], g["HS"], (2, 4), g["BUDGETS"]):
        for keep, pre, bwd in itertools.product((False, True), (False, True), (False, True)):
            if pre and isz == 2:
                continue
            yield ("triton_plan", n, v, h, isz, b, keep, pre, bwd), lambda: plans.triton_plan(
                n, v, h, isz, b, dev, keep_allowed=keep, prerounded=pre, backward=bwd)
        if isz == 4:
            for gr in (False, True):
                yield ("tf32_choice", n, v, h, b, gr), lambda: plans.tf32_choice(n, v, h, b, dev, grad=gr)
        for keep, pre in itertools.product((False, True), (False, True)):
            if pre and isz == 2:
                continue
            yield ("linear_plan", n, v, h, isz, b, keep, pre), lambda: plans.linear_plan(
                n, v, h, isz, b, dev, keep_allowed=keep, prerounded=pre)
        for ht in (0, h // 2 or 1, 2 * h):
            for pre in (False, True):
                yield ("linear_jsd_plan", n, v, h, ht, isz, b, pre), lambda: ljsd.linear_jsd_plan(
                    n, v, h, isz, b, dev, hidden_t=ht, prerounded=pre)
            if ht:
                yield ("jsd_kl_fused", n, v, h, ht, isz, b), lambda: ljsd.jsd_kl_fused(n, v, h, ht, isz, b, dev)
    # the cost model's strategy choices (slow on the interpreter's small chunk floor): a smaller grid
    for n, v, h, isz, b in itertools.product(SMALL["NS"], SMALL["VS"], SMALL["HS"], (2, 4), SMALL["BUDGETS"]):
        for wf in (False, True):
            yield ("linear_plan_gif", n, v, h, isz, b, wf), lambda: plans.linear_plan(
                n, v, h, isz, b, dev, keep_allowed=True, prerounded=False, grad_in_forward=True, weight_fp32=wf)
        for ng, gok in ((True, True), (True, False), (False, True)):
            yield ("lce_strategy", n, v, h, isz, b, ng, gok), lambda: plans.lce_strategy(
                n, v, h, isz, b, dev, need_grad=ng, grad_in_forward_ok=gok, keep_allowed=True)
        for ht in (h // 2 or 1, 2 * h):
            for wf, ff in ((False, False), (True, False), (False, True)):
                yield ("linear_jsd_strategy", n, v, h, ht, isz, b, wf, ff), lambda: ljsd.linear_jsd_strategy(
                    n, v, h, ht, isz, b, dev, weight_fp32=wf, fused_forward=ff)
    for n, v, isz in itertools.product(NS, VS, (2, 4)):
        yield ("ce_triton_plan", n, v, isz), lambda: logits.ce_triton_plan(n, v, isz, dev)
        yield ("jsd_stats_plan", n, v, isz), lambda: logits.jsd_stats_plan(n, v, isz, dev)
        p = TritonPlan(block_n=64, block_v=128, block_h=32, num_warps=4, num_stages=2, vocab_splits=4,
                       vocab_chunk=256, keep_cols=0, group_n=4, flatten=True, dz_tma=False, dlogits_programs=1)
        yield ("dlogits_tiles", n, v), lambda: launch.dlogits_tiles(p, n, v, dev)
        for c in (16, 64):
            yield ("lpc.splits_for", n, v, c), lambda: lpc.splits_for(n, v, p, c, dev)
    yield ("num_sms",), lambda: plans.num_sms(dev)
    for n, v, h in itertools.product(NS, VS, (64, 2048, 4096, 100)):
        for dt, keep in itertools.product((torch.bfloat16, torch.float32), (0, 256)):
            for ent in (False, True):
                x, w = FakeT((n, h), dt, dev), FakeT((v, h), dt, dev)
                yield ("cute.forward_plan", n, v, h, str(dt), keep, ent), lambda: cute.forward_plan(
                    x, w, keep_cols=keep, keep_block=128, entropy=ent)


def main(out):
    warnings.simplefilter("ignore")
    count = 0
    with open(out, "w") as f:
        for dname, spec in DEVICES.items():
            with simulated(spec) as dev:
                for oname, ov in OVERRIDES.items():
                    with override(**ov):
                        t0 = time.perf_counter()
                        for key, fn in rows(dev, oname == "none"):
                            try:
                                r = repr(fn())
                            except Exception as e:  # noqa: BLE001
                                r = f"RAISES {type(e).__name__}: {e}"
                            f.write(f"{dname}|{oname}|{key}|{hashlib.sha1(r.encode()).hexdigest()[:16]}\n")
                            count += 1
                        print(dname, oname, count, round(time.perf_counter() - t0, 1), flush=True)
            print(dname, count, flush=True)
    print("total", count)


if __name__ == "__main__":
    main(sys.argv[1])
