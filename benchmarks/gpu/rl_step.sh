#!/usr/bin/env bash
# Issue 20 item 5 + issue 21 item 5 (helper "bench-rl"): end-to-end RL / SFT steps of a 1B HF model.
#   OUT=<dir> bash benchmarks/gpu/rl_step.sh          (from the repo root; ONE H100; ~5-6 min, guarded at 6)
#   RL_STEP_SMOKE=1 OUT=<dir> bash benchmarks/gpu/rl_step.sh   (CPU smoke; also what runs without a GPU)
# 1. tests/test_bench_grpo.py (the harness on the CPU; on CUDA: our GRPO heads' log p, entropy and
#    LM-head gradient under bf16 autocast vs an fp64 model), tests/test_integrations_trl.py (TRL's
#    trainers with logitless, when trl is importable)                  -> $OUT/rl_step-pytest.log
# 2. python -m logitless_bench --suite grpo: Llama-3.2-1B-shaped (random init), 4 x (256 prompt +
#    2048 completion) tokens = 8192 scored tokens per step, bf16 autocast + fp32 AdamW, T = 0.7,
#    old log-probs (no-grad policy forward) + reference log-probs (frozen bf16 second model) +
#    policy forward/backward (clipped surrogate, k3 KL beta 0.04, entropy bonus 0.01) + AdamW;
#    3 warm-up + 8 timed steps per method: unpatched, logitless, logitless-trl, trl-logits and
#    trl-head (need trl), liger (needs liger)   -> $OUT/grpo.log, $OUT/latest-grpo-<dev>.{json,md}
# 3. python -m logitless_bench --suite train --methods hf,trl-head,trl+logitless: TRL's
#    SFTTrainer.compute_loss (TRL's own fused head; patch_sft) vs hf (unpatched) on the same model,
#    4 x 2048 tokens, autocast, 25 steps       -> $OUT/sft.log, $OUT/latest-train-<dev>.{json,md}
# 7 files. Peers: liger and trl (+ datasets, dill, multiprocess) wheels from .peers/ (prelude.sh);
# without them those rows say "skipped" and the rest runs. Each part has its own timeout; a
# failing part does not stop the next. The summary tables are printed last.
set +e
cd "$(dirname "$0")/../.."
. benchmarks/gpu/prelude.sh
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor-rl-step TRITON_CACHE_DIR=/tmp/triton-rl-step
export HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
PY=${PY:-python3}
start=$(date +%s)
LIMIT=${RL_STEP_LIMIT_S:-355}
left() { echo $(( LIMIT - ($(date +%s) - start) )); }
GPU=$($PY -c "import torch; print(int(torch.cuda.is_available()))" 2>/dev/null)
SMOKE=${RL_STEP_SMOKE:-0}
[ "$GPU" = "1" ] || SMOKE=1
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv 2>/dev/null | tail -n 1
[ "$SMOKE" = 1 ] && echo "SMOKE MODE (no GPU or RL_STEP_SMOKE=1): tiny CPU runs, NOT the benchmark"

echo "== 1. tests =="
if [ "$SMOKE" = 1 ]; then
  timeout 240 $PY -m pytest -q -rs -p no:cacheprovider tests/test_bench_grpo.py > "$OUT/rl_step-pytest.log" 2>&1
else
  # the CUDA and unit cases (the CPU harness runs of the suites are left to the CPU suite)
  timeout 100 $PY -m pytest -q -rs -p no:cacheprovider tests/test_bench_grpo.py tests/test_integrations_trl.py \
      -k "float64 or formula or batches or step_times or failure or not bench_grpo" > "$OUT/rl_step-pytest.log" 2>&1
fi
tail -n 8 "$OUT/rl_step-pytest.log"
echo "[tests: $(( $(date +%s) - start )) s]"

echo "== 2. --suite grpo =="
if [ "$SMOKE" = 1 ]; then
  timeout 240 $PY -m logitless_bench --suite grpo --cpu --out "$OUT" > "$OUT/grpo.log" 2>&1
else
  t=$(( $(left) - 80 )); [ $t -gt 210 ] && t=210; [ $t -lt 60 ] && t=60
  timeout "$t" $PY -m logitless_bench --suite grpo --max-minutes "$(python3 -c "print(max(0.5, ($t - 30) / 60))")" \
      --out "$OUT" > "$OUT/grpo.log" 2>&1
fi
echo "[grpo rc $?: $(( $(date +%s) - start )) s]"
grep -E "^\[" "$OUT/grpo.log" | cut -c1-200

echo "== 3. --suite train, TRL SFTTrainer rows =="
if [ "$SMOKE" = 1 ]; then
  timeout 240 $PY -m logitless_bench --suite train --cpu --steps 3 --modes autocast \
      --methods hf,trl-head,trl+logitless --no-big --no-spread --out "$OUT" > "$OUT/sft.log" 2>&1
else
  t=$(( $(left) - 10 )); [ $t -lt 45 ] && t=45
  timeout "$t" $PY -m logitless_bench --suite train --steps 25 --modes autocast \
      --methods hf,trl-head,trl+logitless --no-big --no-spread --max-minutes "$(python3 -c "print(max(0.5, ($t - 20) / 60))")" \
      --out "$OUT" > "$OUT/sft.log" 2>&1
fi
echo "[sft rc $?: $(( $(date +%s) - start )) s]"
grep -E "^\[" "$OUT/sft.log" | grep -v "examples/s" | cut -c1-200
# keep 7 files: the dated copies duplicate latest-*, the png is redrawn from the JSON (--from-json)
rm -f "$OUT"/grpo-*-20*.json "$OUT"/grpo-*-20*.md "$OUT"/train-*-20*.json "$OUT"/train-*-20*.md "$OUT"/*.png

echo "== summary ($(( $(date +%s) - start )) s) =="
echo "tests: $(grep -E "passed|failed|error" "$OUT/rl_step-pytest.log" | tail -n 1)"
sed -n '/^grpo: /,/^files:/p' "$OUT/grpo.log" | grep -v "^files:"
sed -n '/^train: /,/^files:/p' "$OUT/sft.log" | grep -v "^files:"
ls "$OUT"
