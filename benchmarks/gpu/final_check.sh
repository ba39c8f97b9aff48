#!/usr/bin/env bash
# End-of-session GPU check of the merged tree (one H100, ~9.5 min):
#   OUT=<dir> bash benchmarks/gpu/final_check.sh
# 1. the whole PyTorch suite on the GPU (pytest -n 8, cap 420 s; 300 s cut it at ~97% on 2026-11-23) -> $OUT/gpu-suite.log
# 2. the JAX log-prob backends' GPU tests (mosaic_gpu, triton; cap 100 s) -> $OUT/gpu-jax-lp.log
set +e
cd "$(dirname "$0")/../.."
. benchmarks/gpu/prelude.sh
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 TRL_EXPERIMENTAL_SILENCE=1
export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor-final TRITON_CACHE_DIR=/tmp/triton-final
JT=/tmp/jt-peers
python3 -c "import jax_triton" 2>/dev/null || { mkdir -p $JT && python3 -m pip install -q --no-deps --no-index --target $JT .peers/jax_triton-*.whl .peers/absl_py-*.whl 2>/dev/null; export PYTHONPATH="$PYTHONPATH:$JT"; }
start=$(date +%s)
timeout -s INT -k 10 420 python3 -m pytest tests -q -n 8 -p no:cacheprovider -rs > "$OUT/gpu-suite.log" 2>&1
echo "torch suite: $(tail -n 1 "$OUT/gpu-suite.log") [$(( $(date +%s) - start )) s]"
grep -E "^FAILED|^ERROR" "$OUT/gpu-suite.log" | head -n 20
timeout -s INT -k 10 100 python3 -m pytest -q -p no:cacheprovider -rs tests_jax/test_jax_log_probs_mosaic.py \
    tests_jax/test_jax_log_probs_triton.py -k "not options_against_float64 or all" > "$OUT/gpu-jax-lp.log" 2>&1
echo "jax log-probs: $(tail -n 1 "$OUT/gpu-jax-lp.log") [$(( $(date +%s) - start )) s]"
grep -E "^FAILED|^ERROR" "$OUT/gpu-jax-lp.log" | head -n 20
