#!/usr/bin/env bash
# Issue 20 part 1 (helper "logprobs"): linear_log_probs / log_probs on CUDA, then the rl suite.
#   OUT=<dir> bash benchmarks/gpu/rl.sh      (from the repo root; ONE H100)
# Expected wall time: ~5-6 min (hard stops: tests 200 s, bench the rest of 345 s, at least 120 s).
# 1. tests/test_linear_log_probs.py tests/test_log_probs.py on CUDA   -> $OUT/rl-pytest.log
# 2. python -m logitless_bench --suite rl: qwen3-8b 8k, qwen2.5-7b 16k, llama3.1-8b 8k (bf16,
#    T=0.7, upstream gradients on logp and entropy) x logitless (default budget, logits
#    budget), torch eager, torch.compile, verl's fused kernel      -> $OUT/rl-bench.log,
#                                                                     $OUT/latest-rl-<dev>.json/.md
#    verl: imported if installed; else its kernel files are loaded from the first of
#    $VERL_KERNEL_DIR, /tmp/peers, .peers holding verl/utils/kernel/*.py, with a stub
#    verl/utils/device.py (verl's own __init__ pulls in ray & co).
# Without a GPU it runs a smoke version (a few interpreter tests, the CPU bench case).
# 4 files come back; each part runs under its own timeout; a failing part does not stop the next.
set +e
cd "$(dirname "$0")/../.."
. benchmarks/gpu/prelude.sh
. benchmarks/gpu/lib.sh
torch_caches rl
start=$(date +%s)
GPU=$(python3 -c "import torch; print(int(torch.cuda.is_available()))" 2>/dev/null)
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv 2>&1 | tail -n 2

echo "== tests =="
if [ "$GPU" = "1" ]; then
  timeout 200 python3 -m pytest -q -rs -p no:cacheprovider tests/test_linear_log_probs.py tests/test_log_probs.py \
      > "$OUT/rl-pytest.log" 2>&1
else  # smoke: a few cases on the Triton interpreter
  timeout 200 python3 -m pytest -q -rs -p no:cacheprovider tests/test_linear_log_probs.py tests/test_log_probs.py \
      -k "fp32_every_option and all or test_against_reference and float32" > "$OUT/rl-pytest.log" 2>&1
fi
tail -n 15 "$OUT/rl-pytest.log"
echo "tests took $(( $(date +%s) - start )) s"

echo "== verl =="
verl_kernels
PYTHONPATH="$VERL_PATH$PYTHONPATH" python3 -c "import verl.utils.kernel.linear_cross_entropy as m; print('verl kernel importable:', m.__file__)" 2>&1 | tail -n 1

echo "== bench --suite rl =="
if [ "$GPU" = "1" ]; then
  left=$(( 345 - ($(date +%s) - start) )); [ $left -lt 120 ] && left=120
  mins=$(python3 -c "print(max(0.5, ($left - 40) / 60))")
  PYTHONPATH="$VERL_PATH$PYTHONPATH" timeout $left python3 -m logitless_bench --suite rl --warmup 2 --reps 5 \
      --max-minutes "$mins" --out "$OUT" > "$OUT/rl-bench.log" 2>&1
else
  PYTHONPATH="$VERL_PATH$PYTHONPATH" timeout 120 python3 -m logitless_bench --suite rl --quick --out "$OUT" \
      > "$OUT/rl-bench.log" 2>&1
fi
rm -f "$OUT"/rl-*-20*.json "$OUT"/rl-*-20*.md  # the dated copies duplicate latest-rl-*
grep -E "^==|^  [a-z]" "$OUT/rl-bench.log" | tail -n 20
echo "total $(( $(date +%s) - start )) s"
echo "== summary =="
grep -E "passed|failed|error" "$OUT/rl-pytest.log" | tail -n 1
sed -n '/^| shape/,/^$/p' "$OUT/rl-bench.log"
