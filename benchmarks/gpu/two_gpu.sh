#!/usr/bin/env bash
# The multi-GPU runs (kind nvidia-h100-x2 or nvidia-h200-x2), in one or two device calls:
#   PARTS="tests tp" bash benchmarks/gpu/two_gpu.sh      then      PARTS="jax" bash benchmarks/gpu/two_gpu.sh
# Carry .peers, filled where there is network: pip download --no-deps --python-version 3.12
# --only-binary=:all: -d .peers jax-triton==0.3.1 verl==0.9.1 (the JAX triton backend; verl's
# kernel for the verl-tp-logp row: benchmarks/gpu/prelude.sh installs and stubs them).
#   tests  the torch TP / FSDP test files over NCCL and the JAX sharded test files on the
#          GPUs, side by side (each capped at TEST_S seconds, default 300)
#   tp     --suite tp, every method: cross-entropy, log-probs, distillation (MINUTES, default 4)
#   jax    --suite jax-sharded, modes data, tensor and fsdp (2d needs 4 GPUs), every method
#   frameworks  real training steps through the frameworks' own entry points, their loss vs
#          logitless (loss curve, peak memory, step time; JSON per run): Megatron Core (1 GPU;
#          TP=2 + sequence parallel), torchtitan (1 GPU; FSDP2; TP=2), HF Trainer (DeepSpeed
#          ZeRO-3 on 1 and 2 GPUs; FSDP2 through accelerate). Carry .peers with their wheels
#          (the scripts' docstrings list them: megatron-core, torchtitan and its imports, deepspeed).
# Everything lands in $OUT/two-gpu.tgz (the device returns few files) and benchmarks/results/.
set +e
cd "$(dirname "$0")/../.."
. benchmarks/gpu/prelude.sh
nvidia-smi topo -m 2>/dev/null | head -n 4
for part in ${PARTS:-tests tp jax}; do
  case "$part" in
    tests)  # the two suites' test files side by side (suite.sh's lists; logs $OUT/<suite>-pytest.log)
      TEST_S=${TEST_S:-300} MINUTES=0 bash benchmarks/gpu/suite.sh tp > "$OUT/tp-tests.out" 2>&1 &
      TEST_S=${TEST_S:-300} MINUTES=0 bash benchmarks/gpu/suite.sh jax-sharded > "$OUT/jax-tests.out" 2>&1 &
      wait
      grep -h -A14 "^== tests" "$OUT/tp-tests.out" "$OUT/jax-tests.out" ;;
    tp)  TEST_S=0 MINUTES=${MINUTES:-4} bash benchmarks/gpu/suite.sh tp \
           --methods "logitless-tp,logitless-tp@512MiB,megatron-style,dtensor-loss-parallel,logitless-1gpu,logitless-tp-logp,megatron-style-logp,verl-tp-logp,logitless-1gpu-logp,logitless-tp-jsd,logitless-tp-kl,logits-tp-jsd,logitless-1gpu-jsd" ;;
    frameworks)
      M=benchmarks/gpu/megatron_steps.py T=benchmarks/gpu/torchtitan_steps.py
      timeout 240 python3 $M > "$OUT/megatron-1gpu.log" 2>&1; echo "megatron 1 GPU: exit $?"
      timeout 240 torchrun --nproc_per_node 2 $M --tp 2 --sp > "$OUT/megatron-tp2.log" 2>&1; echo "megatron TP=2 SP: exit $?"
      timeout 240 python3 $T > "$OUT/titan-1gpu.log" 2>&1; echo "torchtitan 1 GPU: exit $?"
      timeout 240 torchrun --nproc_per_node 2 $T --dp 2 > "$OUT/titan-fsdp2.log" 2>&1; echo "torchtitan FSDP2: exit $?"
      timeout 240 torchrun --nproc_per_node 2 $T --tp 2 > "$OUT/titan-tp2.log" 2>&1; echo "torchtitan TP=2: exit $?"
      if [ -f benchmarks/gpu/hf_multi_gpu.py ]; then
        timeout 360 bash -c "python3 benchmarks/gpu/hf_multi_gpu.py ${HF_ARGS:-}" > "$OUT/hf-multi.log" 2>&1; echo "HF ZeRO-3 / FSDP2: exit $?"
      fi
      tail -n 3 "$OUT"/megatron-*.log "$OUT"/titan-*.log "$OUT"/hf-multi.log 2>/dev/null ;;
    jax) TEST_S=0 MINUTES=${MINUTES:-6} bash benchmarks/gpu/suite.sh jax-sharded --modes data,tensor,fsdp \
           --methods xla-logits,logitless-xla,logitless-mosaic,logitless,logp-xla-logits,logp-xla,logp ;;
  esac
done
tar czf "$OUT/two-gpu.tgz" -C "$OUT" --exclude two-gpu.tgz . 2>/dev/null
find "$OUT" -maxdepth 1 -type f ! -name two-gpu.tgz -delete
