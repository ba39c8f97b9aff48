#!/usr/bin/env bash
# Issue 23 item 2 (helper "tf32"): fp32 inputs at matmul precision "high" on operands
# rounded to TF32 beforehand (x once, W in vocabulary chunks; kernels on TF32-exact
# operands through TMA).
#   OUT=<dir> bash benchmarks/gpu/tf32.sh        (from the repo root; ~4 min on an H100, at most 5)
#   SMOKE=1 OUT=<dir> bash benchmarks/gpu/tf32.sh  (CPU: the tests on the interpreter + a tiny probe)
#   TESTS_ONLY=1 OUT=<dir> bash benchmarks/gpu/tf32.sh  (part 1 alone: ~1 min on an H100)
# 1. tests/test_tf32_prerounded.py + the fp32 tests of tests/test_precision.py on CUDA
#    (bitwise pre-rounded vs in-kernel rounding on the GPU for linear_cross_entropy and
#    linear_log_probs, accuracy vs float64 at each setting, tiles fit shared memory)
#    -> $OUT/tf32-pytest.log
# 2. benchmarks/probe_tf32.py at 4096 x 4096 x 128256: cuBLAS TF32 GEMM, the rounding
#    pass, forward and forward+backward pre-rounded (default budget, 4 GiB, two tile
#    sets) vs in-kernel rounding, "highest" -> $OUT/probe-tf32-*.json, $OUT/tf32-probe.log
# 3. python -m logitless_bench --suite precision (short; its new logitless-tf32-in-kernel rows
#    are the path before) -> $OUT/tf32-bench.log + its md/json
# Files in $OUT: tf32-gpu.txt, tf32-pytest.log, tf32-probe.log, probe-tf32-*.json,
# tf32-bench.log, tf32-latest-precision-*.md/.json (<= 8). A failing part does not stop the others.
set +e
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
cd "$(dirname "$0")/../.."
OUT=${OUT:-.out/tf32}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
start=$(date +%s)
if [ -n "$SMOKE" ]; then
    echo "smoke mode (CPU)" | tee "$OUT/tf32-gpu.txt"
    PYTHONPATH=src timeout 300 $PY -m pytest -q -rs tests/test_tf32_prerounded.py 2>&1 | tee "$OUT/tf32-pytest.log" | tail -n 5
    PYTHONPATH=src timeout 300 $PY benchmarks/probe_tf32.py --smoke --out "$OUT" 2>&1 | tee "$OUT/tf32-probe.log" | tail -n 22
    echo "total $(( $(date +%s) - start )) s"
    exit 0
fi
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv 2>&1 | tee "$OUT/tf32-gpu.txt"

echo "== tests (CUDA) =="
XDIST=""
$PY -c "import xdist" 2>/dev/null && XDIST="-n 4"
PYTHONPATH=src timeout 150 $PY -m pytest -q -rs $XDIST tests/test_tf32_prerounded.py tests/test_precision.py \
    -k "not cpu_torch_backend and not float64" 2>&1 | tee "$OUT/tf32-pytest.log" | tail -n 15
echo "tests took $(( $(date +%s) - start )) s"
if [ -n "$TESTS_ONLY" ]; then
    echo "== summary: tests =="
    grep -E "passed|failed|error" "$OUT/tf32-pytest.log" | tail -n 3
    exit 0
fi

echo "== probe (4096 x 4096 x 128256 fp32 'high') =="
PYTHONPATH=src timeout 130 $PY benchmarks/probe_tf32.py --out "$OUT" 2>&1 | tee "$OUT/tf32-probe.log" | tail -n 3
echo "probe done at $(( $(date +%s) - start )) s"

echo "== precision benchmark (short) =="
PYTHONPATH=src timeout 70 $PY -m logitless_bench --suite precision --warmup 1 --reps 3 --max-minutes 0.9 \
    --out "$OUT/bench-results" 2>&1 | tee "$OUT/tf32-bench.log" | grep -v "^\[plot\]" | tail -n 5
for f in "$OUT"/bench-results/latest-precision-*.json "$OUT"/bench-results/latest-precision-*.md; do
    [ -f "$f" ] && cp "$f" "$OUT/tf32-$(basename "$f")"
done
rm -rf "$OUT/bench-results"
echo "total $(( $(date +%s) - start )) s; files in $OUT:"
ls "$OUT"
echo "== summary: precision suite (fwd / 1 GEMM, fwd+bwd / 3 GEMMs; errors vs float64) =="
for f in "$OUT"/tf32-latest-precision-*.md; do
    [ -f "$f" ] && sed -n '/^## Summary/,/^## All metrics/p' "$f" | grep -v "^## " | head -n 30
done
echo "== summary: tests =="
grep -E "passed|failed|error" "$OUT/tf32-pytest.log" | tail -n 3
echo "== summary: probe (ms, x one TF32 GEMM) =="
sed -n '/^=== tf32 pre-rounded/,$p' "$OUT/tf32-probe.log"
