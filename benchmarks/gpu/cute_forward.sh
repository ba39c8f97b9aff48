#!/usr/bin/env bash
# Issue 23: the CuTe DSL fused forward (benchmarks/cute/fused_forward.py) on the H100 (<= 240 s).
#   OUT=<dir> bash benchmarks/gpu/cute_forward.sh          (carry [".cute"], as cute_dsl.sh)
#   SMOKE=1 OUT=<dir> bash benchmarks/gpu/cute_forward.sh  (CPU: compile check + merge self-test;
#       PYTHON_CUTE=a Python 3.12 with the DSL importable, PYTHON=a Python with torch)
# Parts (each under its own timeout; a failing part does not stop the others):
#   1. check_compile.py: sm_90a PTX/SASS checks (wgmma, TMA, setmaxnreg, no spills)   <= 30 s
#   2. probe correctness vs float64 (both variants, 6 shapes)                          <= 75 s
#   3. probe timing vs cuBLAS and logitless's Triton forward (2 big shapes)            <= 120 s
set +e
cd "$(dirname "$0")/../.."
. benchmarks/gpu/lib.sh
gpu_env .out/cute-forward /tmp/cute-dsl
cute_dsl_env
S=$(date +%s)
timeout -k 5 30 "$PYC" benchmarks/cute/check_compile.py --json "$OUT/cute-compile.json" \
    > "$OUT/cute-compile.log" 2>&1
echo "compile check exit: $?" | tee -a "$OUT/cute-forward-summary.txt"
if [ -n "$SMOKE" ]; then
    timeout -k 5 120 "$PY" benchmarks/cute/probe_fused_forward.py --json "$OUT/cute-probe.json" \
        > "$OUT/cute-probe.log" 2>&1
    echo "probe (smoke) exit: $?" | tee -a "$OUT/cute-forward-summary.txt"
else
    timeout -k 5 75 "$PY" benchmarks/cute/probe_fused_forward.py --part correctness \
        --json "$OUT/cute-correctness.json" > "$OUT/cute-correctness.log" 2>&1
    echo "correctness exit: $?" | tee -a "$OUT/cute-forward-summary.txt"
    timeout -k 5 120 "$PY" benchmarks/cute/probe_fused_forward.py --part timing \
        --json "$OUT/cute-timing.json" > "$OUT/cute-timing.log" 2>&1
    echo "timing exit: $?" | tee -a "$OUT/cute-forward-summary.txt"
fi
echo "wall: $(( $(date +%s) - S )) s"
echo "== compile check (table)"; grep -A9 "^     H  spec" "$OUT/cute-compile.log"
for f in cute-probe cute-correctness cute-timing; do
    [ -f "$OUT/$f.log" ] && { echo "== $f (log tail)"; tail -c 1500 "$OUT/$f.log"; echo; }
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
smoke = os.path.exists(os.path.join(out, "cute-probe.json"))
c = load("cute-probe.json" if smoke else "cute-correctness.json")
if c:
    print(f"{'variant':>7} {'N x H x V':>18} {'splits':>6} {'lse err':>9} {'bf16 err':>9} ok")
    for r in c.get("correctness", []):
        shape = f"{r['n']}x{r['h']}x{r['v']}"
        print(f"{'ws' if r['specialised'] else 'inline':>7} {shape:>18} {r['splits']:>6} "
              f"{r.get('max_err_lse', float('nan')):9.2e} {r.get('torch_bf16_err_lse', float('nan')):9.2e} "
              f"{'yes' if r.get('ok') else 'NO ' + r.get('error', '')[:80]}")
t = None if smoke else load("cute-timing.json")
if t:
    for r in t.get("timing", []):
        base = r.get("cublas_ms")
        print(f"{r['n']}x{r['h']}x{r['v']}: cuBLAS {base:.3f} ms ({r.get('cublas_tflops', 0):.0f} TF/s), "
              f"triton fwd {r.get('triton_ms', float('nan')) / base:.3f}x")
        for k, v in r.items():
            if k.startswith("cute_") and k.endswith("_ms"):
                print(f"   {k[:-3]:>14}: {v:.3f} ms = {v / base:.3f}x cuBLAS")
            elif k.endswith("_error"):
                print(f"   {k}: {v[:120]}")
if smoke and c:
    print("smoke (CPU; harness rows above used torch partials):", json.dumps(c.get("smoke"))[:300])
PYEOF
