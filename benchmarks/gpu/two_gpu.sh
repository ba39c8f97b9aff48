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
    frameworks)  # one-GPU runs two at a time (one per GPU), then the two-GPU runs
      M=benchmarks/gpu/megatron_steps.py T=benchmarks/gpu/torchtitan_steps.py H=benchmarks/gpu/hf_multi_gpu.py
      one() { local gpu=$1 log=$2; shift 2; CUDA_VISIBLE_DEVICES=$gpu timeout 200 "$@" > "$OUT/$log.log" 2>&1; echo "$log: exit $?"; }
      two() { local log=$1; shift; timeout 200 "$@" > "$OUT/$log.log" 2>&1; echo "$log: exit $?"; }
      one 0 megatron-1gpu python3 $M & one 1 titan-1gpu python3 $T --steps 15 & wait
      one 0 hf-zero3-1gpu-plain torchrun --nproc_per_node 1 --master_port 29511 $H --mode zero3 --variant plain --steps 12 &
      one 1 hf-zero3-1gpu-patched torchrun --nproc_per_node 1 --master_port 29512 $H --mode zero3 --variant patched --steps 12 &
      wait
      two megatron-tp2-sp torchrun --nproc_per_node 2 $M --tp 2 --sp
      two titan-fsdp2 torchrun --nproc_per_node 2 $T --dp 2 --steps 15
      two titan-tp2 torchrun --nproc_per_node 2 $T --tp 2 --steps 15
      for v in plain patched; do
        two hf-zero3-2gpu-$v torchrun --nproc_per_node 2 $H --mode zero3 --variant $v --steps 12
        two hf-fsdp2-2gpu-$v accelerate launch --num_processes 2 $H --mode fsdp2 --variant $v --steps 12
      done
      python3 $H --compare > "$OUT/hf-compare.log" 2>&1; echo "hf compare: exit $?"
      tail -n 4 "$OUT"/*.log ;;
    jax) TEST_S=0 MINUTES=${MINUTES:-6} bash benchmarks/gpu/suite.sh jax-sharded --modes data,tensor,fsdp \
           --methods xla-logits,logitless-xla,logitless-mosaic,logitless,logp-xla-logits,logp-xla,logp ;;
  esac
done
tar czf "$OUT/two-gpu.tgz" -C "$OUT" --exclude two-gpu.tgz . 2>/dev/null
find "$OUT" -maxdepth 1 -type f ! -name two-gpu.tgz -delete
