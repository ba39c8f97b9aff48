#!/usr/bin/env bash
# Issue 12 (helper "speed"): cost-model planner, gradient-in-forward, model-shape suite,
# regression report.  OUT=<dir> bash benchmarks/gpu/speed.sh   (from the repo root)
# Expected wall time: 7-8.5 min on one H100 (timeouts on every part stop it by ~8.8 min).
# 1. tests on CUDA: tests/test_cost_model.py, tests/test_bench_compare.py and the bf16
#    keep/budget tests of tests/test_linear_cross_entropy.py (the planner now picks the
#    kept columns on GPUs)                                   -> $OUT/speed-pytest.log
# 2. probe: each strategy vs the model's prediction on 4 shapes x 2-5 budgets
#                                                            -> $OUT/speed-probe.log, probe-strategies-*.json
# 3. python -m logitless_bench --suite models --no-peers --budgets default,logits
#    (26 shapes, logitless only, predicted vs measured columns)
#                                                            -> $OUT/speed-models.log, models-*.json/.md
# 4. compare against the recorded anchors run (benchmarks/results/latest-lce-H100.json)
#                                                            -> $OUT/speed-compare.md
# 5. python -m logitless.tune on 2 shapes, whatever time is left (cache under $OUT)
#                                                            -> $OUT/speed-tune.log (the cache file appended)
# At most 8 files come back: speed-pytest.log, speed-probe.log, probe-strategies-<dev>.json,
# speed-models.log, latest-models-<dev>.json/.md, speed-compare.md, speed-tune.log.
set +e
cd "$(dirname "$0")/../.."
. benchmarks/gpu/lib.sh
gpu_env .out/speed
start=$(date +%s)
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv 2>&1
cp benchmarks/results/latest-lce-H100.json /tmp/speed-old-lce-H100.json 2>/dev/null

echo "== tests (CUDA) =="
PYTHONPATH=src timeout 130 python3 -m pytest -q -rs tests/test_cost_model.py tests/test_bench_compare.py tests/test_tuned.py \
    2>&1 | tee "$OUT/speed-pytest.log" | tail -n 6
PYTHONPATH=src timeout 75 python3 -m pytest -q -rs tests/test_linear_cross_entropy.py \
    -k "reductions_all_options or plan_budgets" 2>&1 | tee -a "$OUT/speed-pytest.log" | tail -n 4
echo "tests took $(( $(date +%s) - start )) s"

echo "== probe: strategies vs predictions =="
PYTHONPATH=src timeout 150 python3 benchmarks/probe_strategies.py --out "$OUT" 2>&1 | tee "$OUT/speed-probe.log" | tail -n 40
echo "probe done at $(( $(date +%s) - start )) s"

echo "== suite models (logitless only, default and logits budgets) =="
left=$(( 480 - ($(date +%s) - start) ))
mins=$(python3 -c "print(max(1.0, ($left - 40) / 60))")
PYTHONPATH=src timeout $left python3 -m logitless_bench --suite models --no-peers --budgets default,logits \
    --warmup 2 --reps 6 --max-minutes "$mins" --out benchmarks/results 2>&1 | tee "$OUT/speed-models.log" \
    | grep -v "^\[plot\]" | grep -E "^\[|^==" | tail -n 60
for f in benchmarks/results/latest-models-*.json benchmarks/results/latest-models-*.md; do
    [ -f "$f" ] && cp "$f" "$OUT/$(basename "$f")"
done

echo "== compare with the recorded anchors run =="
NEW=$(ls benchmarks/results/latest-models-*.json 2>/dev/null | head -n 1)
if [ -n "$NEW" ] && [ -f /tmp/speed-old-lce-H100.json ]; then
    PYTHONPATH=src timeout 30 python3 -m logitless_bench compare /tmp/speed-old-lce-H100.json "$NEW" \
        --out "$OUT/speed-compare.md" > /tmp/speed-compare.log 2>&1 || tail -n 20 /tmp/speed-compare.log
    sed -n '/## Geomean/,/## Regressions/p' "$OUT/speed-compare.md"
fi

echo "== tuner (opt-in; its cache goes to /tmp, not used by the runs above) =="
left=$(( 515 - ($(date +%s) - start) ))
if [ $left -gt 40 ]; then
    LOGITLESS_CACHE_DIR=/tmp/speed-tune-cache PYTHONPATH=src timeout $left python3 -m logitless.tune \
        --shapes 4096:4096:128256,8192:1152:131072 --reps 3 2>&1 | tee "$OUT/speed-tune.log" | tail -n 16
    cat /tmp/speed-tune-cache/*.json >> "$OUT/speed-tune.log" 2>/dev/null
else
    echo "skipped: ${left}s left"
fi

echo "== summary (planner: predicted vs measured) =="
[ -n "$NEW" ] && PYTHONPATH=src python3 - "$NEW" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
g = d["units"].get("gemm_ms", {})
print(f"{'shape':18} {'method':17} {'fwd/GEMM':>8} {'f+b/3G':>7} {'meas ms':>8} {'pred ms':>8} {'m/p':>5}  strategy")
for r in d["rows"]:
    if r.get("status") != "ok":
        print(f"{r['shape']:18} {r['method']:17} {r['status']}: {r.get('reason', '')[:80]}")
        continue
    print(f"{r['shape']:18} {r['method']:17} {r['fwd_per_gemm']:8.2f} {r['fwdbwd_per_3gemm']:7.2f} "
          f"{r['fwdbwd_ms']:8.2f} {r.get('pred_ms', 0):8.2f} {r['fwdbwd_ms'] / r.get('pred_ms', 1):5.2f}  {r.get('pred_strategy')}")
PY
echo "total $(( $(date +%s) - start )) s; files in $OUT:"
ls "$OUT"
