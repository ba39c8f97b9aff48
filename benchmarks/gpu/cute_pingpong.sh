#!/usr/bin/env bash
# Issue 23 item 1: the consumer ping-pong CuTe DSL forward (benchmarks/cute/fused_forward_pingpong.py)
# on the H100 (<= 240 s).
#   OUT=<dir> bash benchmarks/gpu/cute_pingpong.sh          (carry [".cute"], as cute_forward.sh)
#   SMOKE=1 OUT=<dir> bash benchmarks/gpu/cute_pingpong.sh  (CPU: compile check + probe self-test;
#       PYTHON_CUTE=a Python 3.12 with the DSL importable, PYTHON=a Python with torch)
# Parts (each under its own timeout; a failing part does not stop the others):
#   0. sim_pingpong_sync.py: the ring / ordering-barrier protocol model (no deadlock, no ABA) ~1 s
#   1. check_compile.py --kernels pingpong: sm_90a PTX/SASS checks + load on the GPU
#      (H = 4096 on the GPU, where each configuration compiles twice; 256/4096/7168 SMOKE) <= 35 s
#   2. probe_pingpong.py correctness vs float64 (11 shapes; tiles 64x256 and 128x128;
#      ring 4, setmaxnreg 24/240, 7-stage 128x128 at H = 4096; 24 runs)                  <= 75 s
#   3. probe_pingpong.py timing, baselines interleaved in 5 rounds (cuBLAS, Triton forward,
#      cooperative CuTe, ping-pong 64x256 at 3 splits + 2 variants, 128x128 at 2 splits;
#      4096x4096, 2048x2048, 8192x7168 x 128000)                                        <= 105 s
# Files under $OUT (7): cute-pp-{compile,correctness,timing}.{json,log}, cute-pp-summary.txt
set +e
cd "$(dirname "$0")/../.."
. benchmarks/gpu/lib.sh
gpu_env .out/cute-pingpong /tmp/cute-dsl
cute_dsl_env
SUM="$OUT/cute-pp-summary.txt"
: > "$SUM"
S=$(date +%s)
echo "sync model (benchmarks/cute/sim_pingpong_sync.py): $(timeout -k 2 20 "$PY" \
    benchmarks/cute/sim_pingpong_sync.py 2>&1 | tail -c 400)" | tee -a "$SUM"
timeout -k 5 35 "$PYC" benchmarks/cute/check_compile.py --kernels pingpong \
    $([ -z "$SMOKE" ] && echo --pingpong-hidden 4096) \
    --json "$OUT/cute-pp-compile.json" > "$OUT/cute-pp-compile.log" 2>&1
echo "compile check exit: $? ($(( $(date +%s) - S )) s)" | tee -a "$SUM"
if [ -n "$SMOKE" ]; then
    timeout -k 5 120 "$PY" benchmarks/cute/probe_pingpong.py --json "$OUT/cute-pp-correctness.json" \
        > "$OUT/cute-pp-correctness.log" 2>&1
    echo "probe (smoke) exit: $? ($(( $(date +%s) - S )) s)" | tee -a "$SUM"
else
    timeout -k 5 75 "$PY" benchmarks/cute/probe_pingpong.py --part correctness \
        --json "$OUT/cute-pp-correctness.json" > "$OUT/cute-pp-correctness.log" 2>&1
    rc=$?
    echo "correctness exit: $rc ($(( $(date +%s) - S )) s)$([ $rc = 124 ] && echo ' TIMED OUT: a hang (ring phases / ordering barrier)?')" | tee -a "$SUM"
    timeout -k 5 105 "$PY" benchmarks/cute/probe_pingpong.py --part timing --rounds 5 --budget-s 75 \
        --json "$OUT/cute-pp-timing.json" > "$OUT/cute-pp-timing.log" 2>&1
    echo "timing exit: $? ($(( $(date +%s) - S )) s)" | tee -a "$SUM"
fi
echo "wall: $(( $(date +%s) - S )) s" | tee -a "$SUM"
echo "== compile check (table; spec = tile rows / stages)"
grep -A12 "^     H  spec" "$OUT/cute-pp-compile.log" | grep -v '^{'
grep -m1 "ping-pong (one warpgroup" "$OUT/cute-pp-compile.log" | cut -c1-400
for f in cute-pp-correctness cute-pp-timing; do
    [ -f "$OUT/$f.log" ] && { echo "== $f (log tail)"; tail -c 700 "$OUT/$f.log"; echo; }
done
echo "== summary"
"$PY" - "$OUT" <<'PYEOF' | tee -a "$SUM"
import json, os, sys
out = sys.argv[1]
def load(name):
    try:
        return json.load(open(os.path.join(out, name)))
    except Exception as exc:  # noqa: BLE001
        print(f"{name}: not readable ({type(exc).__name__})")
        return None
c = load("cute-pp-correctness.json")
if c:
    if "smoke" in c:
        print("smoke (CPU; the rows below used float64 torch partials):", json.dumps(c["smoke"]))
    rows = c.get("correctness", [])
    print(f"correctness: {sum(bool(r.get('ok')) for r in rows)}/{len(rows)} ok")
    print(f"{'variant':>8} {'N x H x V':>18} {'splits':>6} {'lse err':>9} {'bf16 err':>9} "
          f"{'m err':>9} {'e rel':>9} ok")
    for r in rows:
        pe = r.get("partials_err", {})
        print(f"{r['variant']:>8} {str(r['n']) + 'x' + str(r['h']) + 'x' + str(r['v']):>18} "
              f"{r['splits']:>6} {r.get('max_err_lse', float('nan')):9.2e} "
              f"{r.get('torch_bf16_err_lse', float('nan')):9.2e} {pe.get('m_abs', float('nan')):9.2e} "
              f"{pe.get('e_rel', float('nan')):9.2e} "
              f"{'yes' if r.get('ok') else 'NO ' + (r.get('error') or str(r.get('bad_rows')) + ' bad rows')[:90]}")
t = load("cute-pp-timing.json") if os.path.exists(os.path.join(out, "cute-pp-timing.json")) else c
if t is c and c and c.get("timing"):
    print("timing harness dry run (CPU clock, stand-in kernels: the numbers mean nothing):")
if t:
    print(f"timing on {t.get('device')} (torch {t.get('torch')}, triton {t.get('triton')}, "
          f"cutlass {t.get('cutlass')}): median of per-round do_bench medians, V = 128000")
    for r in t.get("timing", []):
        if "skipped" in r:
            print(f"{r['n']}x{r['h']}x{r['v']}: skipped ({r['skipped']})")
            continue
        print(f"{r['n']}x{r['h']}x{r['v']} ({r.get('rounds_done_before_budget', r['rounds'])} rounds):")
        for k in [k[:-3] for k in r if k.endswith("_ms") and not k.endswith("_rounds_ms")]:
            rr = r.get(f"{k}_rounds_ms", [])
            print(f"   {k:>14}: {r[k + '_ms']:8.3f} ms  {r.get(k + '_x_cublas', float('nan')):6.3f}x cuBLAS  "
                  f"{r.get(k + '_tflops', 0):5.0f} TF/s  rounds {min(rr):.3f}-{max(rr):.3f}")
        for k, v in r.items():
            if k.endswith("_error"):
                print(f"   {k}: {v[:150]}")
PYEOF
