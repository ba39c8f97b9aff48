"""Compile-check the library's CuTe DSL forward kernel (logitless.cute_lib.forward_stats) for sm_90a on a CPU.

    PYTHONPATH=src:<nvidia-cutlass-dsl 4.2.1 python_packages>:<its deps> CUTE_DSL_ARCH=sm_90a \\
        python benchmarks/cute/check_lib_compile.py [--quick] [--json out.json]

For each library configuration (hidden size incl. ragged H % 64 != 0, bf16/fp16, the
SMOOTH and ENTROPY flags, both variants) it runs ``cute.compile`` with PTX requested
(as ``check_compile.py`` does for the probe), checks the PTX (4 wgmma m64n{256}k16 per k
slab of the operand dtype, TMA loads, setmaxnreg iff specialised, at most 10 global
stores: 2 rows x (3 + smooth + entropy) partials, the ex2 count), assembles it with
``ptxas -v`` (registers, no spills). Exit 1 if a compile fails before the host JIT or a
check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from check_compile import _captured_ptx, _ptxas  # noqa: E402  (PTX capture; ptxas -v, cuobjdump)


def captured_ptx(**cfg):
    """The PTX of one library configuration, the compile stopped after the pass pipeline
    (``check_compile._captured_ptx``: no host JIT, no module load, the same on a CPU and a GPU
    machine): (ptx, error or None, dynamic smem bytes)."""
    from logitless.cute_lib import forward_stats as fs

    def build():
        fs._COMPILED.clear()
        fs.compile_forward(**cfg)

    return _captured_ptx(build)


def check_one(cfg: dict) -> dict:
    t0 = time.perf_counter()
    ptx, err, smem = captured_ptx(**cfg)
    rec = dict(cfg, dynamic_smem_bytes=smem, compile_s=round(time.perf_counter() - t0, 2), stopped_at=err)
    if ptx is None:
        rec["ok"] = False
        return rec
    ab = "bf16" if cfg["dtype"] == "bfloat16" else "f16"
    spec = cfg.get("specialised", True)
    counts = {
        "wgmma": len(re.findall(rf"wgmma\.mma_async\.sync\.aligned\.m64n256k16\.f32\.{ab}\.{ab}", ptx)),
        "tma": len(re.findall(r"cp\.async\.bulk\.tensor\.2d\.shared::cluster\.global", ptx)),
        "setmaxnreg": len(re.findall(r"setmaxnreg\.inc", ptx)),
        "st_global": len(re.findall(r"st\.global", ptx)),
        "ex2": len(re.findall(r"ex2\.approx", ptx)),
    }
    rec["ptx_counts"] = counts
    stores = 2 * (3 + cfg["smooth"] + cfg["entropy"])
    keep = cfg.get("keep_block", 0)
    # KEEP: two more epilogue copies (kept, full and ragged), each 128 element stores of e and
    # 2 x (256 / keep_block) stores of the maxima (ptxas may merge a few of the copies' common tails)
    lo = hi = stores
    if keep:
        lo, hi = stores + 2 * 128, stores + 2 * (128 + 2 * (256 // keep))
    checks = {
        "4 wgmma m64n256k16 per k slab": counts["wgmma"] == 4,
        "TMA loads of x and w": counts["tma"] == (2 if spec else 4),
        "setmaxnreg iff specialised": (counts["setmaxnreg"] > 0) == spec,
        f"only the {lo}-{hi} partial (and kept) stores reach global memory": lo <= counts["st_global"] <= hi,
        "epilogue copies (full, ragged tile; x2 kept) x (128 exp2 + 2 rescales)":
            (512 <= counts["ex2"] <= 520) if keep else counts["ex2"] == 260,
        "dynamic smem fits sm_90 (227 KiB)": smem is not None and smem <= 227 * 1024,
        "the pass pipeline was the only stop": err is None,
    }
    _ptxas(rec, ptx, checks)  # registers and spills by ptxas -v, SASS counts by cuobjdump (where found)
    rec["checks"] = checks
    rec["ok"] = all(checks.values())
    return rec


def configs(quick: bool):
    """The library's configurations: the planner's (specialised, 4 stages) at ragged and
    model hidden sizes, each flag alone and together, fp16, and the inline-producer variant."""
    base = dict(dtype="bfloat16", smooth=False, entropy=False, stages=4, specialised=True, group=0, keep_block=0)
    out = [dict(base, hidden=4096), dict(base, hidden=72, smooth=True),
           dict(base, hidden=4096, entropy=True), dict(base, hidden=2560, smooth=True, entropy=True)]
    if not quick:
        out += [dict(base, hidden=7168), dict(base, hidden=2048), dict(base, hidden=8),
                dict(base, hidden=4096, dtype="float16"), dict(base, hidden=4104, specialised=False),
                dict(base, hidden=4096, group=16), dict(base, hidden=4096, keep_block=256),
                dict(base, hidden=72, keep_block=128, smooth=True),
                dict(base, hidden=4096, keep_block=64, entropy=True)]
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    recs = []
    for cfg in configs(args.quick):
        rec = check_one(cfg)
        recs.append(rec)
        print(json.dumps(rec))
    print()
    print(f"{'H':>6} {'dtype':>9} {'sm':>3} {'ent':>3} {'spec':>5} {'grp':>4} {'keep':>4} {'regs':>5} "
          f"{'spill':>5} {'smem':>7} {'st':>3} {'ok':>3}")
    for r in recs:
        print(f"{r['hidden']:>6} {r['dtype']:>9} {int(r['smooth']):>3} {int(r['entropy']):>3} "
              f"{str(r['specialised']):>5} {r['group']:>4} {r['keep_block']:>4} {r.get('registers')!s:>5} "
              f"{r.get('spill_stores')!s:>5} "
              f"{r.get('dynamic_smem_bytes')!s:>7} {r.get('ptx_counts', {}).get('st_global')!s:>3} "
              f"{'yes' if r['ok'] else 'NO':>3}")
        if not r["ok"]:
            print("   failed:", [k for k, v in r.get("checks", {}).items() if not v], r.get("stopped_at"))
    ok = all(r["ok"] for r in recs)
    print("all checks:", "PASS" if ok else "FAIL")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"arch": os.environ["CUTE_DSL_ARCH"], "kernels": recs}, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
