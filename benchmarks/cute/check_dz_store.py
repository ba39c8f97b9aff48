"""CPU check of the CuTe d(logits) kernel's dz store extent (benchmarks/cute/dlogits.py).

    PYTHONPATH=<nvidia-cutlass-dsl 4.2.1 python_packages>:<its deps> CUTE_DSL_ARCH=sm_90a \\
        python benchmarks/cute/check_dz_store.py [--hidden 64] [--json out.json]

The first H100 run of the kernel found the TMA epilogues writing past column C of a
row-padded dz buffer at C = 4099 (values right, padding columns 4099..4103 overwritten).
This script shows, without a GPU, what the kernel asks the TMA unit to do:

  * the dz tensor map (the 128-byte CUtensorMap the DSL's host code fills in itself, not
    through cuTensorMapEncodeTiled): the lowered host function (LLVM dialect, after the
    DSL's pass pipeline, no JIT) is evaluated op by op with concrete arguments (N, C, ldz,
    tma_cols, pointers) and the dz map's globalDim words are decoded (word 4: dim0 - 1 in
    the low 32 bits, dim1 - 1 in the high ones, the layout the x and w maps show too).
    With ``exact_tail`` (the fix) the column extent must be tma_store_cols(C) = C // 8 * 8
    (at least 8), never C or the row stride; without it (the first run's code) it is C,
    which shows the extent was not the row stride: the overwrite is the TMA store's
    whole-16-byte-chunk write (C = 4099 bf16 = 8198 bytes ends inside a 16-byte chunk);
  * the PTX: 4 TMA store boxes per 256 columns and, with ``exact_tail``, 4 masked st.global
    per column block for the tail columns [C8, C) (read back from the shared tile; none
    without it; 128 in the direct epilogue); no spills;
  * ptxas -v (registers, spills) where ptxas is found (check_compile._ptxas).
Exit status 1 if a check fails.
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
os.environ.setdefault("CUTE_DSL_DISABLE_FILE_CACHING", "1")

MASK64 = (1 << 64) - 1
# the host function's arguments (dlogits.DlogitsSm90.__call__): x, w, lse, g, target, dz
# pointers, then n_rows, cols, ldz, v0, ctas, tma_cols, stream
ARG_NAMES = ["x", "w", "lse", "g", "target", "dz", "n", "cols", "ldz", "v0", "ctas",
             "tma_cols", "stream"]


class _Captured(Exception):
    pass


def capture(hidden: int, epilogue: str, exact_tail: bool, stages: int) -> tuple:
    """(host LLVM function text, PTX) of one configuration, the compile stopped after the
    DSL's pass pipeline (the same stop as check_compile.py)."""
    import dlogits as dl
    from cutlass.base_dsl import compiler as dsl_compiler

    mods = []
    orig = dsl_compiler.Compiler.compile

    def compile_isa(self, module, pipeline, *args, **kwargs):
        pipeline = pipeline.replace("cubin-format=bin", "cubin-format=isa")
        orig(self, module, pipeline, *args, **kwargs)
        mods.append(str(module))
        raise _Captured("captured")

    dsl_compiler.Compiler.compile = compile_isa
    try:
        dl._COMPILED.clear()
        dl.compile_dlogits(hidden, stages=stages, epilogue=epilogue, exact_tail=exact_tail)
    except Exception as exc:  # noqa: BLE001
        if not mods:
            raise RuntimeError(f"compile failed: {type(exc).__name__}: {str(exc)[:300]}") from exc
    finally:
        dsl_compiler.Compiler.compile = orig
    text = mods[-1]
    m = re.search(r"\n  llvm\.func @cutlass___call___.*?\n  }\n", text, re.S)
    host = m.group(0)
    i = text.index('assembly = "') + len('assembly = "')
    j = i
    while text[j] != '"':
        j += 2 if text[j] == "\\" else 1
    ptx = re.sub(r"\\([0-9A-Fa-f]{2}|\\)",
                 lambda mm: "\\" if mm.group(1) == "\\" else chr(int(mm.group(1), 16)), text[i:j])
    return host, ptx.rstrip("\0")


_ICMP = {"eq": lambda a, b: a == b, "ne": lambda a, b: a != b, "uge": lambda a, b: a >= b,
         "ugt": lambda a, b: a > b, "ule": lambda a, b: a <= b, "ult": lambda a, b: a < b,
         "sge": lambda a, b: a >= b, "sgt": lambda a, b: a > b, "sle": lambda a, b: a <= b,
         "slt": lambda a, b: a < b}
_BIN = {"add": lambda a, b: a + b, "sub": lambda a, b: a - b, "mul": lambda a, b: a * b,
        "udiv": lambda a, b: a // b, "and": lambda a, b: a & b, "or": lambda a, b: a | b,
        "shl": lambda a, b: a << b, "lshr": lambda a, b: a >> b, "xor": lambda a, b: a ^ b}


def _set(struct, path, val):
    out = dict(struct) if isinstance(struct, dict) else {}
    if len(path) == 1:
        out[path[0]] = val
    else:
        out[path[0]] = _set(out.get(path[0], {}), path[1:], val)
    return out


def _get(struct, path):
    for p in path:
        struct = struct[p]
    return struct


def tensor_maps(host: str, args: dict) -> list:
    """Evaluate the straight-line start of the host function (up to its first branch) with
    concrete argument values; return the 16-word descriptors it fills in (alloca'd arrays of
    16 x i64), in order."""
    sig = re.search(r"llvm\.func @\S+\((.*?)\)\s*(attributes|\{)", host, re.S).group(1)
    names = re.findall(r"(%arg\d+):", sig)
    env = {n: args.get(ARG_NAMES[k], 0) if k < len(ARG_NAMES) else 0
           for k, n in enumerate(names)}
    mem, allocas = {}, []
    for line in host.splitlines()[1:]:
        s = line.strip()
        if s.startswith(("llvm.br", "llvm.cond_br", "llvm.return")):
            break
        m = re.match(r"llvm\.store (%\w+), (%\w+)", s)
        if m:
            if m.group(1) in env and m.group(2) in env:
                mem[env[m.group(2)]] = env[m.group(1)]
            continue
        m = re.match(r"(%\w+) = llvm\.([\w.]+)\s*(.*)", s)
        if not m:
            continue
        res, op, rest = m.groups()
        ops = re.findall(r"%\w+", rest.split(":")[0])
        try:
            if op == "mlir.constant":
                v = re.match(r"\((-?\d+|true|false)", rest).group(1)
                env[res] = {"true": 1, "false": 0}.get(v, None)
                if env[res] is None:
                    env[res] = int(v) & MASK64
            elif op in ("mlir.undef", "mlir.zero"):
                env[res] = {}
            elif op in _BIN:
                env[res] = _BIN[op](env[ops[0]], env[ops[1]]) & MASK64
            elif op in ("zext", "sext", "ptrtoint", "inttoptr", "trunc", "bitcast"):
                env[res] = env[ops[0]]
            elif op == "icmp":
                pred = re.match(r'"(\w+)"', rest).group(1)
                env[res] = int(_ICMP[pred](env[ops[0]], env[ops[1]]))
            elif op == "alloca":
                env[res] = ("alloca", len(allocas))
                allocas.append(res)
            elif op == "getelementptr":
                idx = [int(v) for v in re.search(r"\[([\d, ]+)\]", rest).group(1).split(",")]
                env[res] = (env[ops[0]], idx[-1])
            elif op == "insertvalue":
                path = [int(v) for v in re.search(r"\[([\d, ]+)\]", rest).group(1).split(",")]
                env[res] = _set(env[ops[1]], path, env[ops[0]])
            elif op == "extractvalue":
                path = [int(v) for v in re.search(r"\[([\d, ]+)\]", rest).group(1).split(",")]
                env[res] = _get(env[ops[0]], path)
        except (KeyError, TypeError, IndexError):
            continue  # a value this evaluator does not model: left undefined
    descs = []
    for k in range(len(allocas)):
        words = [mem.get((("alloca", k), w)) for w in range(16)]
        if all(isinstance(w, int) for w in words):
            descs.append(words)
    return descs


def decode(words: list) -> dict:
    """The fields this check needs: the global address (word 0: address / 16 << 4), the 2-D
    extents (word 4) and dim1's byte stride (word 1: stride / 16 << 32)."""
    return {"address": (words[0] >> 4) * 16,
            "dim0": (words[4] & 0xFFFFFFFF) + 1, "dim1": (words[4] >> 32) + 1,
            "stride1_bytes": ((words[1] >> 32) & 0xFFFFFFFF) * 16}


CASES = [  # (n, C, ldz): C = 4099 padded to 8 (the H100 failure) and to 64, tiny and even C
    (1000, 4099, 4104), (129, 4099, 4160), (7, 5, 8), (1000, 16384, 16384), (300, 16391, 16400)]


def check(hidden: int, epilogue: str, exact_tail: bool, stages: int) -> dict:
    import dlogits as dl

    t0 = time.perf_counter()
    rec = {"hidden": hidden, "epilogue": epilogue, "exact_tail": exact_tail, "stages": stages}
    try:
        host, ptx = capture(hidden, epilogue, exact_tail, stages)
    except Exception as exc:  # noqa: BLE001
        rec.update(ok=False, error=f"{type(exc).__name__}: {str(exc)[:300]}")
        return rec
    rec["compile_s"] = round(time.perf_counter() - t0, 2)
    checks = {}
    tma = epilogue != "direct"
    dz_addr = 0x7F0000000000
    rec["maps"] = []
    for n, c, ldz in CASES:
        tc = dl.tma_store_cols(c, exact_tail)
        args = {"x": 0x7E0000000000, "w": 0x7D0000000000, "lse": 0x7C0000000000,
                "g": 0x7B0000000000, "target": 0x7A0000000000, "dz": dz_addr, "n": n,
                "cols": c, "ldz": ldz, "v0": 0, "ctas": 132, "tma_cols": tc}
        maps = [decode(w) for w in tensor_maps(host, args)]
        dz_maps = [d for d in maps if d["address"] == dz_addr]
        row = {"n": n, "c": c, "ldz": ldz, "tma_cols_arg": tc, "maps_found": len(maps),
               "dz_map": dz_maps[0] if dz_maps else None}
        rec["maps"].append(row)
        if not tma:  # (the map is built but never used: no TMA store in the PTX)
            continue
        if not dz_maps:
            checks[f"dz tensor map found n={n} C={c}"] = False
            continue
        d = dz_maps[0]
        want = (c // 8 * 8 or 8) if exact_tail else c
        name = (f"dz map n={n} C={c} ldz={ldz}: dims ({d['dim0']}, {d['dim1']}), row stride "
                f"{d['stride1_bytes']} B; want ({want}, {n}), {2 * ldz} B")
        checks[name] = (d["dim0"], d["dim1"], d["stride1_bytes"]) == (want, n, 2 * ldz)
        if exact_tail:
            # no 16-byte chunk of the store's extent reaches past C
            checks[f"C={c}: store extent ends on a 16-byte boundary <= C (or no store)"] = \
                d["dim0"] % 8 == 0 and (d["dim0"] <= c or c < 8)
    counts = {k: len(re.findall(p, ptx)) for k, p in (
        ("tma_store", r"cp\.async\.bulk\.tensor\.2d\.global\.shared::cta"),
        ("st_global", r"st\.global"), ("ex2", r"ex2\.approx"))}
    rec["ptx_counts"] = counts
    if tma:
        checks["4 TMA store boxes (64 x 64) per 256 columns"] = counts["tma_store"] == 4
        # the tail [C8, C): 4 columns per thread, read back from the shared tile, per block
        tail = 4 * (2 if epilogue == "tma128" else 1) if exact_tail else 0
        checks[f"{tail} masked st.global (tail columns [C8, C), 4 per block)"] = \
            counts["st_global"] == tail
    else:
        checks["128 masked st.global (direct epilogue)"] = counts["st_global"] == 128
    try:
        import check_compile as cc

        cc._ptxas(rec, ptx, checks)
    except Exception as exc:  # noqa: BLE001
        rec["ptxas_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
    rec["checks"] = checks
    rec["ok"] = all(checks.values())
    return rec


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--configs", default="tma:3:1,tma128:4:1,direct:3:1,tma:3:0",
                    help="epilogue:stages:exact_tail triples")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    out = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "kernels": []}
    for cfg in args.configs.split(","):
        ep, st, ex = cfg.split(":")
        rec = check(args.hidden, ep, bool(int(ex)), int(st))
        out["kernels"].append(rec)
        print(json.dumps({k: v for k, v in rec.items() if k != "maps"}), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(out, f, indent=1)
    print(f"{'epilogue':>8} {'exact':>5} {'regs':>5} {'spill':>5} {'st.g':>5} {'ok':>3}  dz map (C=4099, ldz=4104)")
    for r in out["kernels"]:
        m = (r.get("maps") or [{}])[0].get("dz_map")
        print(f"{r['epilogue']:>8} {str(r['exact_tail']):>5} {str(r.get('registers')):>5} "
              f"{str(r.get('spill_stores')):>5} {str(r.get('ptx_counts', {}).get('st_global')):>5} "
              f"{'ok' if r.get('ok') else 'NO':>3}  "
              + (f"dims ({m['dim0']}, {m['dim1']}) stride {m['stride1_bytes']} B" if m else "none")
              + (f"  {r['error']}" if r.get("error") else ""))
        for k, v in (r.get("checks") or {}).items():
            if not v:
                print(f"   FAILED: {k}")
    return 0 if all(r.get("ok") for r in out["kernels"]) else 1


if __name__ == "__main__":
    sys.exit(main())
