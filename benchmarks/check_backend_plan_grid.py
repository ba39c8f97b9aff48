"""Backend plans (LCE triton plan, llp triton linear) over a grid on simulated devices. Usage: grid2.py OUT"""
import contextlib, hashlib, itertools, os, sys, tempfile, types, warnings
from unittest import mock
os.environ["LOGITLESS_CACHE_DIR"] = tempfile.mkdtemp()
os.environ.pop("LOGITLESS_TUNED", None)
import torch
from logitless.planning import cute, memo, rocm
from logitless.planning.overrides import override
from logitless.options import CrossEntropyOptions, LogProbOptions
from logitless.ops.linear_cross_entropy import triton_backend as lce
from logitless.ops.linear_log_probs import triton_backend as llp

DEVICES = {
    "cpu": None,
    "H100": dict(hip=None, name="NVIDIA H100 80GB HBM3", sms=132, cap=(9, 0), l2=50 << 20, arch=""),
    "A100": dict(hip=None, name="NVIDIA A100-SXM4-80GB", sms=108, cap=(8, 0), l2=40 << 20, arch=""),
    "MI300X": dict(hip="6.4.43482", name="AMD Instinct MI300X", sms=304, cap=(9, 4), l2=4 << 20, arch="gfx942:sramecc+:xnack-"),
}

@contextlib.contextmanager
def simulated(spec):
    memo.clear(); rocm._arch_of.cache_clear()
    if spec is None:
        yield torch.device("cpu"); return
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
            memo.clear(); rocm._arch_of.cache_clear()

class FakeT:
    def __init__(self, shape, dtype, device, ptr=1 << 20, stride=None):
        self.shape, self.dtype, self.device, self.ptr = torch.Size(shape), dtype, device, ptr
        self._stride = stride or (shape[1], 1)
    def stride(self): return self._stride
    def data_ptr(self): return self.ptr
    def element_size(self): return self.dtype.itemsize
    def __getitem__(self, sl):
        start, stop, _ = sl.indices(self.shape[0])
        return FakeT((max(0, stop - start), self.shape[1]), self.dtype, self.device,
                     self.ptr + start * self._stride[0] * self.dtype.itemsize, self._stride)

OVS = {"none": {}, "cute1": dict(cute=True), "cute0": dict(cute=False), "gif": dict(strategy=("grad_in_forward", 64)),
       "pre1": dict(tf32_preround=True)}
NS = (1, 37, 4096, 16384); VS = (131, 50257, 128256); HS = (100, 4096)
BUD = (60_000, 256 << 20, 8 << 30)
LAYOUTS = {"ok": {}, "mis": dict(ptr=(1 << 20) + 2), "strided": "strided", "wdt": "wdt"}

def rows(dev):
    for n, v, h, dt, b, lay in itertools.product(NS, VS, HS, (torch.bfloat16, torch.float32), BUD, LAYOUTS):
        kx = {}; wdt = dt
        if lay == "mis": kx = dict(ptr=(1 << 20) + 2)
        if lay == "strided": kx = dict(stride=(2 * h, 1))
        if lay == "wdt": wdt = torch.float32 if dt != torch.float32 else torch.bfloat16
        x = FakeT((n, h), dt, dev, **kx); w = FakeT((v, h), wdt, dev)
        for sc, red, ls, bias, cw, ng, am, gif, cu in itertools.product((None, 30.0), ("mean", "none"), (0.0, 0.1), (False, True), (False, True), (False, True), (False, True), (False, True), (True, False)):
            if (bias or cw or am or ls) and (n, v, h) != (4096, 128256, 4096) and n != 37:
                continue
            opts = CrossEntropyOptions(reduction=red, label_smoothing=ls, softcap=sc)
            yield ("lce", n, v, h, str(dt), str(wdt), b, lay, sc, red, ls, bias, cw, ng, am, gif, cu), lambda: lce.plan(
                x, w, object() if bias else None, object() if cw else None, opts, budget=b, need_grad=ng,
                need_argmax=am, grad_in_forward=gif, cute=cu)
        for sc, ent, bias, ng, cu, r in itertools.product((None, 30.0), (False, True), (False, True), (False, True), (True, False), (None, 16)):
            opts = LogProbOptions(entropy=ent, softcap=sc)
            yield ("llp", n, v, h, str(dt), str(wdt), b, lay, sc, ent, bias, ng, cu, r), lambda: llp.linear(
                x, w, object() if bias else None, opts, budget=b, need_grad=ng, cute=cu, rows=r)

def main(out):
    warnings.simplefilter("ignore"); count = 0
    with open(out, "w") as f:
        for dname, spec in DEVICES.items():
            with simulated(spec) as dev:
                for oname, ov in (OVS.items() if dname == "H100" else [("none", {})]):
                    with override(**ov):
                        for key, fn in rows(dev):
                            try: r = repr(fn())
                            except Exception as e: r = f"RAISES {type(e).__name__}: {e}"
                            f.write(f"{dname}|{oname}|{key}|{hashlib.sha1(r.encode()).hexdigest()[:16]}\n"); count += 1
            print(dname, count, flush=True)
    print("total", count)

main(sys.argv[1])
