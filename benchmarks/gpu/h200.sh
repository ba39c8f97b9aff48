#!/usr/bin/env bash
# Issue 12 on an H200 (run with the device tool's kind nvidia-h200):
#   OUT=<dir> bash benchmarks/gpu/h200.sh        (about 9.5 min)
# 1. probe_schedule.py --quick: plain vs shipped schedule, 6 shapes -> probe-schedule-quick-H200.json
# 2. python -m logitless_bench --suite models --no-peers (4.5 min)  -> latest-models-H200.json/.md
# 3. python -m logitless.tune on 3 shape classes, what time is left -> tune-H200.log (+ its cache)
set +e
cd "$(dirname "$0")/../.."
. benchmarks/gpu/prelude.sh
start=$(date +%s)
[ -f .out/mem.py ] && timeout 60 python3 .out/mem.py 2>&1 | grep -v Warn | tee "$OUT/mem.log"
timeout 200 python3 benchmarks/probe_schedule.py --out "$OUT" --quick \
    --shapes llama3.1-8b,gemma3-4b,gpt-oss-120b,deepseek-v3,llama3.1-8b-16k,llama3.1-8b-512 2>&1 \
    | tee "$OUT/probe-schedule.log" | grep -v "^{"
mkdir -p /tmp/res
timeout 300 python3 -m logitless_bench --suite models --no-peers --budgets default,logits \
    --warmup 2 --reps 8 --max-minutes 4.5 --out /tmp/res 2>&1 | grep -v "^\[plot\]" | grep -A40 "## Summary\|fwd / 1 GEMM" | head -40
cp /tmp/res/latest-models-* "$OUT/" 2>/dev/null
left=$(( ${LIMIT:-580} - ($(date +%s) - start) ))
if [ $left -gt 40 ]; then
    LOGITLESS_CACHE_DIR="$OUT/tune-cache" timeout $left python3 -m logitless.tune \
        --shapes 4096:4096:128256,16384:4096:128256,8192:1152:131072 --reps 3 2>&1 | tee "$OUT/tune-H200.log" | tail -n 20
fi
echo "total $(( $(date +%s) - start )) s"
