#!/usr/bin/env bash
# Issue 18 (helper "tp"): vocab-parallel linear_cross_entropy on 2x H200 over NCCL.
#   OUT=<dir> bash benchmarks/gpu/tp.sh      (from the repo root; kind nvidia-h200-x2)
# Expected wall time: ~6-7 min (hard stops keep it under 9).
# 1. tests/test_tensor_parallel{,_jsd}.py over NCCL (one GPU per rank, Triton backend for real;
#    the world-3 test skips with its reason on 2 GPUs)        -> $OUT/tp-pytest.log
# 2. (after 3.) python -m logitless_bench --suite tp at llama3.1-8b (8192 x 4096 x 128256) and
#    qwen3-8b (16384 x 4096 x 151936), bf16: logitless-tp, megatron-style,
#    dtensor-loss-parallel, logitless-1gpu                   -> $OUT/tp-bench.log,
#                                                               latest-tp-<dev>.json/.md
# 3. benchmarks/probe_tp_jsd.py under torchrun (one process per GPU): vocab-parallel linear_jsd,
#    beta 0 / 1 / 0.5, shapes A and B, times of the slowest rank    -> $OUT/tp-jsd.{log,json}
# On a machine without 2 GPUs the tests and the bench run in their CPU/gloo smoke mode.
# 6 files come back. Each part runs under its own timeout; one failing part does not stop the next.
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

echo "== probe_tp_jsd over the GPUs (linear_jsd, vocab-parallel: merge / two passes / no group) =="
NGPU=$(python3 -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
if [ "${NGPU:-0}" -ge 2 ]; then
    timeout -k 5 150 python3 -m torch.distributed.run --standalone --nproc_per_node "$NGPU" \
        benchmarks/probe_tp_jsd.py --shapes A,B --rounds 5 --json "$OUT/tp-jsd.json" 2>&1 \
        | grep -v "Warning\|OMP_NUM_THREADS\|^\*\*\*" | tee "$OUT/tp-jsd.log" | tail -n 34
else
    echo "fewer than 2 GPUs: skipped (tests/test_tensor_parallel_jsd.py runs its CPU mode over gloo)"
fi

echo "== bench --suite tp =="
left=$(( 500 - ($(date +%s) - start) ))
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
