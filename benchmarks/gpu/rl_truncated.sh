#!/usr/bin/env bash
# Truncated log-probs (issue 38) on one GPU, from the worktree's root (<= ~9 min):
#   OUT=<dir> bash benchmarks/gpu/rl_truncated.sh
# 1. the truncated / batch-invariant tests on the GPU (<= 270 s: 150 no longer covered them);
# 2. the rl suite's truncated rows on qwen3-8b-8k (8192 x 4096 x 151936 bf16, T = 0.7: flat rows),
#    with the untruncated op, the peaked-row pair (T = 0.1) and the logits way (vLLM's masks) to compare (<= 4 min).
# Writes $OUT/rl-trunc-pytest.log, $OUT/rl-trunc-bench.log and the suite's files under $OUT/rl.
set +e
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src:$PWD/benchmarks:$PWD${PYTHONPATH:+:$PYTHONPATH}
export OUT=${OUT:-/tmp/out} TRITON_CACHE_DIR=/tmp/triton-rl-trunc
mkdir -p "$OUT/rl"
S=$(date +%s)
nvidia-smi -L
timeout -k 5 270 python3 -m pytest tests/test_truncated_log_probs.py tests/test_batch_invariant.py -x -q \
    -p no:cacheprovider > "$OUT/rl-trunc-pytest.log" 2>&1
echo "tests exit $? at $(( $(date +%s) - S )) s"
grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/rl-trunc-pytest.log" | tail -20
timeout -k 5 270 python3 -m logitless_bench --suite rl --shapes qwen3-8b-8k --max-minutes 4 \
    --methods logitless,logitless-topk64,logitless-minp0.05,logitless-topp0.95,logitless-k50p0.9,logitless-invariant,logitless-peaked,logitless-topp0.95-peaked,torch-eager-topp0.95,torch-eager-minp0.05,torch-eager-k50p0.9 \
    --out "$OUT/rl" > "$OUT/rl-trunc-bench.log" 2>&1
echo "bench exit $? at $(( $(date +%s) - S )) s"
tail -n 30 "$OUT/rl-trunc-bench.log"
