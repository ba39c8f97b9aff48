#!/usr/bin/env bash
# Issue 20/21, TRL side (helper "trl-grpo"): patch_grpo / patch_sft and the PatchBypassedWarning
# under torch 2.11 and on CUDA.
#   OUT=<dir> bash benchmarks/gpu/trl_grpo.sh            (from the repo root; ~3-4 min on an H100, guarded at 8)
#   TRL_SH_SMOKE=1 OUT=<dir> bash benchmarks/gpu/trl_grpo.sh   (CPU smoke: fewer tests, a 2-step fp32 CPU probe)
# 1. pytest: tests/test_integrations_trl_grpo.py (real GRPOTrainer.train(), CPU), test_transformers_bypass.py
#    (the warning; real SFTTrainer runs), test_integrations_trl.py, test_integrations_trl_sft.py, and the
#    torch.compile tests of test_transformers_integration.py (the backbone pre-hook under dynamo, fullgraph),
#    with PatchBypassedWarning as an error everywhere it must not fire       -> $OUT/trl-pytest.log
# 2. benchmarks/probe_trl_grpo.py --device cuda (fp32): GRPOTrainer with TRL's head / lt.patch alone (must
#    warn) / lt.patch + patch_grpo (must not; same completions, loss, KL, entropy to 1e-4)
#                                                                            -> $OUT/trl-grpo-fp32.{log,json}
# 3. the same with --bf16 (TRL's bf16 tiles vs logitless' fp32 statistics: within 5e-2)
#                                                                            -> $OUT/trl-grpo-bf16.{log,json}
# 5 files come back. Each part has its own timeout; a failing part does not stop the others.
set +e
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
cd "$(dirname "$0")/../.."
OUT=${OUT:-.out/trl-grpo}
mkdir -p "$OUT"
start=$(date +%s)
SMOKE=${TRL_SH_SMOKE:-0}
PY=${PY:-python3}
[ -f benchmarks/gpu/prelude.sh ] && . benchmarks/gpu/prelude.sh   # peers' wheels (trl, datasets) into /tmp/peers
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor-trl-grpo-sh TRITON_CACHE_DIR=/tmp/triton-trl-grpo-sh
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv 2>/dev/null | tail -n 1
W=(-W error::logitless.transformers.bypass.PatchBypassedWarning)

echo "== 1. pytest =="
if [ "$SMOKE" = 1 ]; then
    FILES=(tests/test_integrations_trl_grpo.py tests/test_transformers_bypass.py); SEL=(); TT=400
else
    FILES=(tests/test_integrations_trl_grpo.py tests/test_transformers_bypass.py tests/test_integrations_trl.py
           tests/test_integrations_trl_sft.py tests/test_transformers_integration.py); SEL=(-k "not fsdp"); TT=240
fi
timeout $TT $PY -m pytest -q -rs -p no:cacheprovider "${W[@]}" "${SEL[@]}" "${FILES[@]}" > "$OUT/trl-pytest.log" 2>&1
rc1=$?
tail -n 15 "$OUT/trl-pytest.log"
P1=$(grep -E "^[0-9]+ (passed|failed)|passed|failed|error" "$OUT/trl-pytest.log" | tail -n 1)
echo "pytest rc=$rc1 at $(( $(date +%s) - start )) s"

if [ "$SMOKE" = 1 ]; then DEV=(--device cpu --steps 2); else DEV=(--device cuda --steps 4); fi
echo "== 2. probe fp32 =="
timeout 120 $PY benchmarks/probe_trl_grpo.py "${DEV[@]}" --out "$OUT/trl-grpo-fp32.json" > "$OUT/trl-grpo-fp32.log" 2>&1
rc2=$?
grep -E '^(device|step| +[0-9]|max|completions equal|  (ok|FAIL)|Traceback|[A-Za-z]*Error)' "$OUT/trl-grpo-fp32.log" | tail -n 16
echo "probe fp32 rc=$rc2 at $(( $(date +%s) - start )) s"

rc3=skipped
if [ "$SMOKE" != 1 ]; then
    echo "== 3. probe bf16 =="
    timeout 120 $PY benchmarks/probe_trl_grpo.py "${DEV[@]}" --bf16 --out "$OUT/trl-grpo-bf16.json" > "$OUT/trl-grpo-bf16.log" 2>&1
    rc3=$?
    grep -E '^(device|step| +[0-9]|max|completions equal|  (ok|FAIL)|Traceback|[A-Za-z]*Error)' "$OUT/trl-grpo-bf16.log" | tail -n 16
fi

echo
echo "== summary (trl_grpo.sh, $(( $(date +%s) - start )) s) =="
printf "%-44s %-8s %s\n" "part" "rc" "result"
printf "%-44s %-8s %s\n" "1 pytest (TRL + bypass + compile hook)" "$rc1" "$P1"
printf "%-44s %-8s %s\n" "2 GRPOTrainer probe fp32 (${DEV[1]})" "$rc2" "$(grep -E '^max' "$OUT/trl-grpo-fp32.log" 2>/dev/null) $(grep -c FAIL "$OUT/trl-grpo-fp32.log" 2>/dev/null) FAIL"
[ "$SMOKE" != 1 ] && printf "%-44s %-8s %s\n" "3 GRPOTrainer probe bf16 (${DEV[1]})" "$rc3" "$(grep -E '^max' "$OUT/trl-grpo-bf16.log" 2>/dev/null) $(grep -c FAIL "$OUT/trl-grpo-bf16.log" 2>/dev/null) FAIL"
exit 0
