#!/usr/bin/env bash
# GPU run for the training-loop work (autocast, torch.compile, FSDP2, newcomer fixes).
# Usage, from the repo root: OUT=<dir> bash benchmarks/gpu/loop.sh
# Expected wall time: 7-9 minutes (test suite on CUDA <= 6.7 min, timing check < 2.5 min).
# Writes: $OUT/loop-pytest.log (whole suite), $OUT/loop-compile.log and
#         $OUT/loop-compile-*.json (eager vs compiled step time, also in benchmarks/results/).
set +e
OUT=${OUT:-/tmp/loop-out}
mkdir -p "$OUT" benchmarks/results
export PYTHONUNBUFFERED=1 PYTHONPATH=src
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader

echo "== 1/2 the whole test suite on CUDA tensors (this branch's files first)"
OTHERS=$(ls tests/test_*.py | grep -v -e test_training_loops.py -e test_fsdp.py)
timeout 400 python3 -m pytest tests/test_training_loops.py tests/test_fsdp.py $OTHERS -q -rs \
    --durations=15 2>&1 | tee "$OUT/loop-pytest.log" | tail -40
echo "pytest exit: ${PIPESTATUS[0]}"

echo "== 2/2 eager vs torch.compile step time (fp32 params, autocast bf16)"
timeout 150 python3 benchmarks/loop_compile.py --out benchmarks/results 2>&1 | tee "$OUT/loop-compile.log" | tail -12
cp benchmarks/results/loop-compile-*.json "$OUT/" 2>/dev/null

echo "== summary"
grep -E "passed|failed" "$OUT/loop-pytest.log" | tail -1
grep -E "compiled / eager" "$OUT/loop-compile.log"
