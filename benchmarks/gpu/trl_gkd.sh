#!/usr/bin/env bash
# Issue 21 item 3 (helper "trl-gkd"): TRL GKDTrainer / DistillationTrainer through linear_jsd.
#   OUT=<dir> bash benchmarks/gpu/trl_gkd.sh      (from the repo root; ONE H100)
# Expected wall time: ~4 min (hard stops: tests 240 s, bench 240 s).
# 1. tests/test_integrations_trl_gkd.py (CPU trainer runs + the CUDA variants: real
#    GKDTrainer / DistillationTrainer.train() on the GPU, Triton backend)  -> $OUT/trl-gkd-pytest.log
# 2. benchmarks/trl_gkd_bench.py: loss step (loss fn + backward) of both trainers, TRL's own
#    against patch_gkd; Llama student 2048 / teacher 4096 hidden, V=128256, bf16, 4 x 1024
#    tokens                             -> $OUT/trl-gkd-bench.log, $OUT/trl_gkd.json, $OUT/trl_gkd.md
# Without a GPU it runs a smoke version (the gkd_loss unit tests, the bench on tiny CPU models).
# 4 files come back; each part runs under its own timeout; a failing part does not stop the next.
set +e
cd "$(dirname "$0")/../.."
. benchmarks/gpu/prelude.sh
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 TRL_EXPERIMENTAL_SILENCE=1
export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor-trl-gkd TRITON_CACHE_DIR=/tmp/triton-trl-gkd
start=$(date +%s)
GPU=$(python3 -c "import torch; print(int(torch.cuda.is_available()))" 2>/dev/null)
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv 2>&1 | tail -n 2

echo "== tests =="
if [ "$GPU" = "1" ]; then
  timeout 240 python3 -m pytest -q -rs -p no:cacheprovider tests/test_integrations_trl_gkd.py \
      > "$OUT/trl-gkd-pytest.log" 2>&1
  SMOKE=""
else
  timeout 240 python3 -m pytest -q -rs -p no:cacheprovider tests/test_integrations_trl_gkd.py -k "gkd_loss" \
      > "$OUT/trl-gkd-pytest.log" 2>&1
  SMOKE="--smoke"
fi
tail -n 12 "$OUT/trl-gkd-pytest.log"
echo "tests took $(( $(date +%s) - start )) s"

echo "== bench =="
timeout 240 python3 benchmarks/trl_gkd_bench.py --out "$OUT" $SMOKE > "$OUT/trl-gkd-bench.log" 2>&1
echo "bench exit $? after $(( $(date +%s) - start )) s"
tail -n 3 "$OUT/trl-gkd-bench.log" | grep -v "^|" | tail -n 2

echo "== summary =="
grep -E "passed|failed|error" "$OUT/trl-gkd-pytest.log" | tail -n 1
cat "$OUT/trl_gkd.md" 2>/dev/null || echo "no bench table (see trl-gkd-bench.log)"
