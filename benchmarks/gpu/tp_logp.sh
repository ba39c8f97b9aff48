#!/usr/bin/env bash
# Issue 20 item 6: vocab-parallel linear_log_probs (and the verl drop-in) on 2x H200 over NCCL.
#   OUT=<dir> bash benchmarks/gpu/tp_logp.sh      (from the repo root; kind nvidia-h200-x2)
# Expected wall time: ~5 min (hard stops keep it under 6).
# 1. tests/test_tensor_parallel_log_probs.py tests/test_integrations_verl.py over NCCL
#    (one GPU per rank; the world-3 test skips with its reason on 2 GPUs) -> $OUT/tplp-pytest.log
# 2. python -m logitless_bench --suite tp with the log-prob methods (logitless-tp-logp,
#    megatron-style-logp, verl-tp-logp, logitless-1gpu-logp) and logitless-tp (CE, for scale)
#    at llama3.1-8b 8k and qwen3-8b 16k, bf16, T = 0.7           -> $OUT/tplp-bench.log,
#                                                                   latest-tp-<dev>.json/.md
# verl: its kernel files from .peers' wheel with a stub verl/utils/device.py (as rl.sh).
set +e
cd "$(dirname "$0")/../.."
. benchmarks/gpu/prelude.sh
. benchmarks/gpu/lib.sh
torch_caches tplp
start=$(date +%s)
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv 2>&1 | head -n 3
verl_kernels
export PYTHONPATH="$VERL_PATH$PYTHONPATH"

echo "== tests (NCCL when >= 2 GPUs) =="
timeout 200 python3 -m pytest -q -rs -p no:cacheprovider tests/test_tensor_parallel_log_probs.py \
    tests/test_integrations_verl.py tests/test_bench_tp.py 2>&1 | tee "$OUT/tplp-pytest.log" | tail -n 20
echo "tests took $(( $(date +%s) - start )) s"

echo "== bench --suite tp (log-probs) =="
left=$(( 330 - ($(date +%s) - start) )); [ $left -lt 100 ] && left=100
mins=$(python3 -c "print(max(0.5, ($left - 40) / 60))")
timeout $left python3 -m logitless_bench --suite tp --max-minutes "$mins" --warmup 2 --reps 5 \
    --methods logitless-tp-logp,megatron-style-logp,verl-tp-logp,logitless-1gpu-logp,logitless-tp \
    --out "$OUT" 2>&1 | tee "$OUT/tplp-bench.log" | tail -n 30
rm -f "$OUT"/tp-*-2*.json "$OUT"/tp-*-2*.md
for f in "$OUT"/latest-tp-*; do mv "$f" "${f/latest-tp-/latest-tp-logp-}"; done
echo "== summary =="
grep -E "passed|failed|skipped|error" "$OUT/tplp-pytest.log" | tail -n 3
sed -n '/^| shape/,$p' "$OUT"/latest-tp-logp-*.md 2>/dev/null | head -n 14
echo "total $(( $(date +%s) - start )) s"
