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
T=/tmp/cute-dsl
PYC="${PYTHON_CUTE:-$PY}"
if [ -z "$SMOKE" ] && ! "$PY" -c "import cutlass.cute" 2>/dev/null; then
    mkdir -p $T && tar xJf .cute/nvidia_cutlass_dsl-*.tar.xz -C $T
fi
export PYTHONPATH="$PYTHONPATH:$T/nvidia_cutlass_dsl/python_packages"
export CUTE_DSL_ARCH=sm_90a
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
echo "== compile check (tail)"; grep -v "^JIT\|libcuda\|Could not\|CUDA_TOOLKIT" "$OUT/cute-compile.log" | tail -n 10
for f in cute-probe cute-correctness cute-timing; do
    [ -f "$OUT/$f.log" ] && { echo "== $f (tail)"; tail -c 3500 "$OUT/$f.log"; }
done
