#!/usr/bin/env bash
# Issue 23: the CuTe DSL d(logits) kernel of the backward (benchmarks/cute/dlogits.py) on the
# H100 (<= 200 s).
#   OUT=<dir> bash benchmarks/gpu/cute_dlogits.sh          (carry [".cute"], as cute_forward.sh)
#   SMOKE=1 OUT=<dir> bash benchmarks/gpu/cute_dlogits.sh  (CPU: compile check + harness self-test;
#       PYTHON_CUTE=a Python 3.12 with the DSL importable, PYTHON=a Python with torch)
# Parts (each under its own timeout; a failing part does not stop the others):
#   1. check_compile.py --kernels dlogits (epilogues tma / tma128 / direct; H = 4096 on the
#      GPU, 64/4096/7168 in SMOKE): sm_90a PTX/SASS checks; on the GPU also that an
#      unmodified compile succeeds and loads                                            <= 40 s
#   2. probe correctness vs float64 (24 shapes x 4 variants)                            <= 70 s
#   3. probe timing vs cuBLAS, the Triton dlogits kernel, the chunk's two GEMMs        <= 85 s
# Files under $OUT (5): dz-compile.{json,log}, dz-correctness.{json,log} (SMOKE: dz-probe.*),
# dz-timing.{json,log}; the summary table is printed last.
set +e
cd "$(dirname "$0")/../.."
. benchmarks/gpu/lib.sh
gpu_env .out/cute-dlogits /tmp/cute-dsl
T=/tmp/cute-dsl
PYC="${PYTHON_CUTE:-$PY}"
if [ -z "$SMOKE" ] && ! "$PY" -c "import cutlass.cute" 2>/dev/null; then
    mkdir -p $T && tar xJf .cute/nvidia_cutlass_dsl-*.tar.xz -C $T
fi
export PYTHONPATH="$PYTHONPATH:$T/nvidia_cutlass_dsl/python_packages"
export CUTE_DSL_ARCH=sm_90a
S=$(date +%s)
# on the GPU each configuration compiles twice (PTX capture, then the real load): 3 of them
HS=4096 CAP=40; [ -n "$SMOKE" ] && HS=64,4096,7168 CAP=150  # (9 compiles on a busy 2-core CPU)
timeout -k 5 $CAP "$PYC" benchmarks/cute/check_compile.py --kernels dlogits --dlogits-hidden $HS \
    --json "$OUT/dz-compile.json" > "$OUT/dz-compile.log" 2>&1
echo "compile check exit: $?"
if [ -n "$SMOKE" ]; then
    timeout -k 5 60 "$PY" benchmarks/cute/probe_dlogits.py --json "$OUT/dz-probe.json" \
        > "$OUT/dz-probe.log" 2>&1
    echo "probe (smoke) exit: $?"
else
    timeout -k 5 70 "$PY" benchmarks/cute/probe_dlogits.py --part correctness \
        --json "$OUT/dz-correctness.json" > "$OUT/dz-correctness.log" 2>&1
    echo "correctness exit: $?"
    timeout -k 5 85 "$PY" benchmarks/cute/probe_dlogits.py --part timing \
        --json "$OUT/dz-timing.json" > "$OUT/dz-timing.log" 2>&1
    echo "timing exit: $?"
fi
echo "wall: $(( $(date +%s) - S )) s"
echo "== compile check (table)"; grep -A10 "^     H  spec" "$OUT/dz-compile.log"
grep -v '^{' "$OUT/dz-compile.log" | grep -m3 "Traceback\|Error" | cut -c1-300
for f in dz-probe dz-correctness dz-timing; do
    [ -f "$OUT/$f.log" ] && { echo "== $f (log tail)"; tail -c 1200 "$OUT/$f.log"; echo; }
done
echo "== summary"
"$PY" - "$OUT" <<'PYEOF'
import json, os, sys
out = sys.argv[1]
def load(name):
    try:
        return json.load(open(os.path.join(out, name)))
    except Exception as exc:  # noqa: BLE001
        print(f"{name}: not readable ({type(exc).__name__})")
        return None
cc = load("dz-compile.json")
if cc:
    for r in cc.get("kernels", []):
        bad = [k for k, v in r.get("checks", {}).items() if not v]
        print(f"compile H={r.get('hidden')} {r.get('epilogue')}: regs {r.get('registers')} "
              f"smem {r.get('dynamic_smem_bytes')} {'ok' if r.get('ok') else 'FAILED ' + str(bad)[:150]}"
              + (f" gpu_compile_error={r.get('gpu_compile_error')}" if r.get("gpu_compile_error") else ""))
smoke = os.path.exists(os.path.join(out, "dz-probe.json"))
c = load("dz-probe.json" if smoke else "dz-correctness.json")
if c:
    rows = c.get("correctness", [])
    by = {}
    for r in rows:
        k = (r["epilogue"], r["grid"])
        by.setdefault(k, []).append(r)
    print(f"{'epilogue':>9} {'grid':>7} {'cases':>5} {'ok':>3} {'max err':>9} {'bf16 err':>9} pad")
    for (ep, grid), rs in by.items():
        nok = sum(bool(r.get("ok")) for r in rs)
        me = max((r.get("max_err", float("nan")) for r in rs), default=float("nan"))
        be = max((r.get("torch_bf16_err", float("nan")) for r in rs), default=float("nan"))
        pad = all(r.get("pad_untouched", False) for r in rs)
        print(f"{ep:>9} {grid:>7} {len(rs):>5} {nok:>3} {me:9.2e} {be:9.2e} {pad}")
    for r in rows:
        if not r.get("ok"):
            print("  FAIL", {k: r.get(k) for k in ("n", "h", "c", "v0", "epilogue", "grid", "max_err",
                                                   "worst_excess", "pad_untouched", "error")})
    if smoke:
        print("smoke:", json.dumps(c.get("smoke")))
t = None if smoke else load("dz-timing.json")
if t:
    for r in t.get("timing", []):
        base = r.get("cublas_ms")
        if not base:
            print(r)
            continue
        print(f"{r['n']}x{r['h']} C={r['c']}: cuBLAS {base:.3f} ms ({r.get('cublas_tflops', 0):.0f} TF/s); "
              f"dW {r.get('dw_gemm_ms', float('nan')):.3f} dx {r.get('dx_gemm_ms', float('nan')):.3f} ms")
        if "triton_dz_ms" in r:
            print(f"   {'triton dlogits':>22}: {r['triton_dz_ms']:.3f} ms = {r['triton_dz_ms'] / base:.3f}x cuBLAS")
        for k, v in r.items():
            if k.startswith("cute_") and k.endswith("_ms"):
                print(f"   {k[:-3]:>22}: {v:.3f} ms = {v / base:.3f}x cuBLAS")
            elif k.endswith("_error"):
                print(f"   {k}: {v[:160]}")
        print(f"   bwd estimate (dz + 2 GEMMs) / 3 GEMMs: cute {r.get('bwd_est_cute_vs_3gemm', float('nan')):.3f}"
              f"  triton {r.get('bwd_est_triton_vs_3gemm', float('nan')):.3f}")
PYEOF
