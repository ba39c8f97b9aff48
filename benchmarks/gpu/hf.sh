#!/usr/bin/env bash
# Issue 21 (helper "hf"): logitless.transformers on CUDA and the end-to-end training benchmark.
#   OUT=<dir> bash benchmarks/gpu/hf.sh       (from the repo root; ~5.5 min on an H100, hard-guarded at 6)
#   HF_SH_SMOKE=1 OUT=<dir> bash benchmarks/gpu/hf.sh   (CPU smoke: a few tests, 2-step CPU runs)
# 1. tests/test_transformers*.py on CUDA (Triton backend): every family (dense, MoE with the
#    router loss, vision-language) vs unpatched, torch.compile (fullgraph, inductor), class/Auto
#    patching, LoRA heads, gather hooks (the CPU-only FSDP2/gloo and harness tests are left to the
#    CPU suite)                                                           -> $OUT/hf-pytest.log
# 2. python -m logitless_bench --suite train, 8192 tokens/step (4 x 2048), AdamW, 30 steps per run
#    (median step time after the first 5):
#    a. --model llama      Llama-3.2-1B-shaped, bf16 autocast with fp32 master weights:
#                          hf / logitless (/ liger when its wheel is carried)
#    b. --model qwen3-moe  Qwen3-MoE-shaped (12 layers x 32 experts, 8 active, ~1B active params,
#                          router aux loss on), pure bf16 weights: hf / logitless
#    -> $OUT/hf-train-{llama,moe}.log, $OUT/train-{llama,moe}.{json,md}   (7 files in all)
# Targets (printed last, "met"/"NOT MET"): step time <= 0.97x hf; peak memory <= hf's peak minus
# 80% of the fp32 logits (tokens x V x 4 bytes: 3.9 GiB for Llama, 4.6 GiB for Qwen3-MoE), shown as
# "saved / logits" >= 0.8; the patch in use (the training forward returns logits=None).
set +e
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
cd "$(dirname "$0")/../.."
OUT=${OUT:-.out/hf}
mkdir -p "$OUT"
start=$(date +%s)
LIMIT=${HF_SH_LIMIT_S:-355}   # whole script, seconds
SMOKE=${HF_SH_SMOKE:-0}
PY=${PY:-python3}
[ -f benchmarks/gpu/prelude.sh ] && . benchmarks/gpu/prelude.sh   # peers' wheels (liger) into /tmp/peers, PYTHONPATH
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor-hf-sh TRITON_CACHE_DIR=/tmp/triton-hf-sh
RES=$(mktemp -d /tmp/hf-results.XXXX)
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv 2>/dev/null | tail -n 1
left() { echo $(( LIMIT - ($(date +%s) - start) )); }

echo "== tests/test_transformers*.py =="
if [ "$SMOKE" = 1 ]; then
    SEL=(-k "Llama and family_matches or Qwen3Moe and family_matches or Qwen2VL and family_matches")
    TT=300
else
    SEL=(-k "not bench and not fsdp")   # (the CPU-only ones: the bench harness, FSDP2 over gloo)
    TT=160
fi
: > "$OUT/hf-pytest.log"
# two runs (families, then integration: compile is the slow part) so that a time-out loses only one
for files in "tests/test_transformers.py tests/test_transformers_families.py" "tests/test_transformers_integration.py"; do
    t0=$(date +%s)
    # shellcheck disable=SC2086
    timeout "$(( TT / 2 ))" "$PY" -m pytest -q -rs -p no:cacheprovider $files "${SEL[@]}" 2>&1 \
        | tee -a "$OUT/hf-pytest.log" | tail -n 6
    echo "[$files: $(( $(date +%s) - t0 )) s]" | tee -a "$OUT/hf-pytest.log"
done
echo "tests took $(( $(date +%s) - start )) s"

STEPS=30
SHAPE="--batch 4 --seq 2048"
[ "$SMOKE" = 1 ] && { STEPS=2; SHAPE=""; }
LIGER=""
"$PY" -c "import liger_kernel.transformers" 2>/dev/null && [ "$SMOKE" != 1 ] && LIGER=",liger"
run_train() {  # $1 model, $2 methods, $3 share of the time left (percent), $4 short name, $5 modes
    local l guard
    l=$(left)
    [ "$l" -lt 30 ] && { echo "== $1: skipped (time limit) =="; return; }
    l=$(( l * $3 / 100 ))
    guard=$("$PY" -c "print(max(0.5, ($l - 25) / 60))")
    echo "== --suite train --model $1 (time guard ${guard} min, hard limit ${l} s) =="
    timeout -s TERM "$l" "$PY" -m logitless_bench --suite train --model "$1" --steps "$STEPS" $SHAPE \
        --modes "$5" --methods "$2" --no-big --no-spread --max-minutes "$guard" --out "$RES/$4" \
        2>&1 | tee "$OUT/hf-train-$4.log" | grep -v "^\*" | tail -n 8
    for ext in json md; do
        f=$(ls -t "$RES/$4"/latest-train-*."$ext" 2>/dev/null | head -n 1)
        [ -n "$f" ] && cp "$f" "$OUT/train-$4.$ext"
    done
}
run_train llama "hf,logitless$LIGER" 40 llama autocast
# (pure bf16 for the MoE: transformers' grouped_mm experts run bf16; under autocast they would run fp32)
run_train qwen3-moe "hf,logitless" 100 moe bf16

echo
echo "==================== summary (hf.sh, $(( $(date +%s) - start )) s) ===================="
grep -E "passed|failed|error|^\[tests" "$OUT/hf-pytest.log" | tail -n 6
for m in llama moe; do
    f="$OUT/train-$m.md"
    [ -f "$f" ] || { echo "train $m: no result"; continue; }
    echo "-- train $m --"
    grep -E "^\| (hf|logitless|liger)" "$f"
    grep -E "^\| .*(step time|peak memory|in use)" "$f"
done
ls "$OUT"
