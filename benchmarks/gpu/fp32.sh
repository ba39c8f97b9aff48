#!/usr/bin/env bash
# Issue 8, precision parts (helper "fp32"): fp32 inputs on tensor cores (TF32 / 3xTF32
# following torch's matmul precision), float64 exactness, the CPU budget.
#   OUT=<dir> bash benchmarks/gpu/fp32.sh        (from the repo root; ~5-6 min on an H100, at most ~8)
# 1. tests/test_precision.py in full, and the fp32 / torch-backend tests of
#    tests/test_linear_cross_entropy.py and tests/test_cross_entropy.py, on CUDA
#    -> $OUT/fp32-pytest.log
# 2. python -m logitless_bench --suite precision (3 shapes x fp32-highest / fp32-high /
#    autocast-bf16 x logitless / logitless-tf32-truncate / torch eager) -> benchmarks/results/precision-H100-*.json/.md,
#    copied to $OUT, log in $OUT/fp32-bench.log; its summary table is printed last.
set +e
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/../.."
OUT=${OUT:-.out/fp32}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv 2>&1 | tee "$OUT/fp32-gpu.txt"
start=$(date +%s)

echo "== tests (CUDA) =="
PYTHONPATH=src timeout 150 python3 -m pytest -q -rs tests/test_precision.py 2>&1 | tee "$OUT/fp32-pytest.log" | tail -n 15
PYTHONPATH=src timeout 100 python3 -m pytest -q -rs tests/test_linear_cross_entropy.py tests/test_cross_entropy.py \
    -k "float32 or float64 or (torch and not bfloat16 and not float16)" 2>&1 | tee -a "$OUT/fp32-pytest.log" | tail -n 8
echo "tests took $(( $(date +%s) - start )) s"

echo "== precision benchmark =="
PYTHONPATH=src timeout 210 python3 -m logitless_bench --suite precision --warmup 2 --reps 5 --max-minutes 2.5 \
    --out benchmarks/results 2>&1 | tee "$OUT/fp32-bench.log" | grep -v "^\[plot\]" | tail -n 45
for f in benchmarks/results/latest-precision-*.json benchmarks/results/latest-precision-*.md; do
    [ -f "$f" ] && cp "$f" "$OUT/fp32-$(basename "$f")"
done
echo "total $(( $(date +%s) - start )) s; files in $OUT:"
ls "$OUT"
echo "== summary (fwd / 1 GEMM, fwd+bwd / 3 GEMMs, peak MiB; errors vs float64) =="
for f in benchmarks/results/latest-precision-*.md; do
    [ -f "$f" ] && sed -n '/^## Summary/,/^## All metrics/p' "$f" | grep -v "^## "
done
