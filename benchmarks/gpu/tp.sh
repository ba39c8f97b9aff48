#!/usr/bin/env bash
# Issue 18 (helper "tp"): vocab-parallel linear_cross_entropy on 2x H200 over NCCL.
#   OUT=<dir> bash benchmarks/gpu/tp.sh      (from the repo root; kind nvidia-h200-x2)
# Expected wall time: ~4-5 min (hard stops keep it under 6).
# 1. tests/test_tensor_parallel{,_jsd}.py over NCCL (one GPU per rank, Triton backend for real;
#    the world-3 test skips with its reason on 2 GPUs)        -> $OUT/tp-pytest.log
# 2. python -m logitless_bench --suite tp at llama3.1-8b (8192 x 4096 x 128256) and
#    qwen3-8b (16384 x 4096 x 151936), bf16: logitless-tp, megatron-style,
#    dtensor-loss-parallel, logitless-1gpu                   -> $OUT/tp-bench.log,
#                                                               latest-tp-<dev>.json/.md
# On a machine without 2 GPUs both parts run in their CPU/gloo smoke mode.
# 4 files come back. Each part runs under its own timeout; one failing part does not stop the next.
set +e
cd "$(dirname "$0")/../.."
. benchmarks/gpu/lib.sh
gpu_env .out/tp
start=$(date +%s)
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv 2>&1 | head -n 3
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-/tmp/inductor-tp}
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton-tp}

echo "== tests (NCCL when >= 2 GPUs, else gloo) =="
PYTHONPATH=src timeout 220 python3 -m pytest -q -rs -p no:cacheprovider tests/test_tensor_parallel.py \
    tests/test_tensor_parallel_jsd.py \
    2>&1 | tee "$OUT/tp-pytest.log" | tail -n 25
echo "tests took $(( $(date +%s) - start )) s"

echo "== bench --suite tp =="
left=$(( 350 - ($(date +%s) - start) ))
mins=$(python3 -c "print(max(0.5, ($left - 50) / 60))")
PYTHONPATH=src timeout $left python3 -m logitless_bench --suite tp --max-minutes "$mins" --warmup 2 --reps 5 \
    --out "$OUT" 2>&1 | tee "$OUT/tp-bench.log" | tail -n 40
rm -f "$OUT"/tp-*-2*.json "$OUT"/tp-*-2*.md   # the dated copies: latest-* come back
mkdir -p benchmarks/results
cp "$OUT"/latest-tp-*.json "$OUT"/latest-tp-*.md benchmarks/results/ 2>/dev/null

echo "== summary =="
grep -E "passed|failed|skipped|error" "$OUT/tp-pytest.log" | tail -n 3
sed -n '/^| shape/,$p' "$OUT"/latest-tp-*.md 2>/dev/null | head -n 12
echo "total $(( $(date +%s) - start )) s"
