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
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor-tplp TRITON_CACHE_DIR=/tmp/triton-tplp
start=$(date +%s)
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv 2>&1 | head -n 3
VERL_PATH=""
if ! python3 -c "import verl.utils.kernel.linear_cross_entropy" >/dev/null 2>&1; then
  for d in "$VERL_KERNEL_DIR" /tmp/peers .peers; do
    if [ -n "$d" ] && ls "$d"/verl/utils/kernel/*.py >/dev/null 2>&1; then
      rm -rf /tmp/verl-stub && mkdir -p /tmp/verl-stub/verl/utils/kernel
      cp "$d"/verl/utils/kernel/*.py /tmp/verl-stub/verl/utils/kernel/
      touch /tmp/verl-stub/verl/__init__.py /tmp/verl-stub/verl/utils/__init__.py
      cat > /tmp/verl-stub/verl/utils/device.py <<'PY'
import torch
is_cuda_available = torch.cuda.is_available()
def is_npu_available(): return False
def get_device_name(): return "cuda"
def get_torch_device(): return torch.cuda
def get_device_id(): return torch.cuda.current_device()
def get_nccl_backend(): return "nccl"
def get_device_capability(device_id=0): return torch.cuda.get_device_capability(device_id)
PY
      VERL_PATH="/tmp/verl-stub:"
      break
    fi
  done
fi
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
