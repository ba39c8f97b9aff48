#!/usr/bin/env bash
# Issue 12, after the scheduling change (PERFORMANCE.md section 16).
#   OUT=<dir> bash benchmarks/gpu/schedule_bench.sh [models|lce]   (both: about 9.5 min on one H100)
# 1. python -m logitless_bench --suite models --no-peers --budgets default,logits
#    (26 shapes; predicted vs measured)           -> $OUT/latest-models-<dev>.json/.md
# 2. compare with the recorded models run          -> $OUT/models-compare.md
# 3. python -m logitless_bench --suite lce (anchors, with torch.compile, liger, cce)
#                                                  -> $OUT/latest-lce-<dev>.json/.md
set +e
cd "$(dirname "$0")/../.."
. benchmarks/gpu/prelude.sh
start=$(date +%s)
dev=$(python3 -c "import torch; n = torch.cuda.get_device_name(); print('H200' if 'H200' in n else 'H100')")
cp "benchmarks/results/latest-models-$dev.json" /tmp/old-models.json 2>/dev/null
mkdir -p /tmp/res
part=${1:-all}
if [ "$part" != lce ]; then
timeout 330 python3 -m logitless_bench --suite models --no-peers --budgets default,logits \
    --warmup 2 --reps 8 --max-minutes 5 --out /tmp/res 2>&1 | grep -v "^\[plot\]" | tail -n 40
cp /tmp/res/latest-models-* "$OUT/" 2>/dev/null
if [ -f /tmp/old-models.json ]; then
    timeout 30 python3 -m logitless_bench compare /tmp/old-models.json /tmp/res/latest-models-$dev.json \
        --out "$OUT/models-compare.md" > /dev/null 2>&1
    sed -n '/## Geomean/,/## Regressions/p' "$OUT/models-compare.md"
fi
fi
[ "$part" = models ] && exit 0
left=$(( ${LIMIT:-575} - ($(date +%s) - start) ))
mins=$(python3 -c "print(max(1.0, ($left - 30) / 60))")
timeout $left python3 -m logitless_bench --suite lce --budgets default,logits \
    --methods logitless,logitless@logits,torch-compile,liger,cce-exact --warmup 2 --reps 8 \
    --max-minutes "$mins" --out /tmp/res 2>&1 | grep -v "^\[plot\]" | tail -n 30
cp /tmp/res/latest-lce-* "$OUT/" 2>/dev/null
echo "total $(( $(date +%s) - start )) s"
