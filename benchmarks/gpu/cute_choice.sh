#!/usr/bin/env bash
# Issue 23, session 6: where the CuTe forward wins, measured the way the planner will use it (H100, <= 580 s).
#   OUT=<dir> bash benchmarks/gpu/cute_choice.sh     (carry [".cute"]: the DSL tarball, see cute_dsl_env)
#   SMOKE=1 OUT=<dir> bash benchmarks/gpu/cute_choice.sh   (CPU: the harness on one tiny shape)
# Parts (each under its own cap):
#   1. bench_cutelib.py --shapes anchors: CE and log-probs forward, CuTe vs Triton vs cuBLAS,
#      interleaved rounds                                                        <= 110 s
#   2. bench_cutelib.py --shapes models --no-logp: the 26 model shapes, CE forward  <= 150 s
#   3. the lce suite with the DSL installed: logitless (default budget), logitless@logits and
#      torch-compile, f+b and forward                                             <= 280 s
#   4. bench compare against session 4's run (lce-compile-issue23-s4-H100-2026-11-23.json)
#   5. probe_raster.py: the CuTe forward's CTA order and splits at large N (interleaved)  <= 170 s
#   6. probe_lce_ab.py: f+b and forward, logitless (default budget), logitless@logits and
#      torch.compile INTERLEAVED per shape (the logits-budget target)                   <= 300 s
# PARTS="anchors models lce raster ab" (default: anchors models lce) picks parts; the lce suite
# gets whatever is left of 560 s.
# Files under $OUT (<= 8): choice-anchors.{log,json}, choice-models.{log,json}, lce-s6.log, s6.tgz
# (the suite's json/md and the compare report), raster.{log,json}, ab.{log,json}.
set +e
cd "$(dirname "$0")/../.."
. benchmarks/gpu/lib.sh
gpu_env .out/cute_choice /tmp/cute-dsl
torch_caches cute_choice
cute_dsl_env
S=$(date +%s)
"$PY" -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu')" 2>&1 | tail -1
"$PY" -c "from logitless.planning.cute import dsl_importable; print('cutlass.cute importable:', dsl_importable())" 2>&1 | tail -1
if [ -n "$SMOKE" ]; then
    TRITON_INTERPRET=1 timeout -k 5 120 "$PY" benchmarks/cute/bench_cutelib.py --smoke --json "$OUT/choice-anchors.json" \
        > "$OUT/choice-anchors.log" 2>&1
    echo "smoke exit: $?"; tail -3 "$OUT/choice-anchors.log"; exit 0
fi
PARTS="${PARTS:-anchors models lce}"
has() { case " $PARTS " in *" $1 "*) return 0 ;; esac; return 1; }
if has raster; then
    timeout -k 5 170 "$PY" benchmarks/cute/probe_raster.py --budget-s 150 --json "$OUT/raster.json" \
        > "$OUT/raster.log" 2>&1
    echo "raster exit: $? (124: cut off) at $(( $(date +%s) - S )) s"; cat "$OUT/raster.log" | grep -v Warning
fi
if has ab; then
    timeout -k 5 300 "$PY" benchmarks/probe_lce_ab.py --budget-s 250 --json "$OUT/ab.json" > "$OUT/ab.log" 2>&1
    echo "ab exit: $? (124: cut off) at $(( $(date +%s) - S )) s"; grep -v Warning "$OUT/ab.log" | tail -40
fi
if has anchors; then
    timeout -k 5 110 "$PY" benchmarks/cute/bench_cutelib.py --shapes anchors --max-seconds 95 \
        --json "$OUT/choice-anchors.json" > "$OUT/choice-anchors.log" 2>&1
    echo "anchors exit: $? (124: cut off) at $(( $(date +%s) - S )) s"
    grep -A12 "N x H x V" "$OUT/choice-anchors.log"
fi
if has models; then
    timeout -k 5 150 "$PY" benchmarks/cute/bench_cutelib.py --shapes models --no-logp --rounds 4 --max-seconds 135 \
        --json "$OUT/choice-models.json" > "$OUT/choice-models.log" 2>&1
    echo "models exit: $? (124: cut off) at $(( $(date +%s) - S )) s"
    grep -A30 "N x H x V" "$OUT/choice-models.log"
fi
has lce || { echo "wall: $(( $(date +%s) - S )) s"; exit 0; }
left=$(( 560 - ($(date +%s) - S) ))
mins=$("$PY" -c "print(round(max(1.0, ($left - 45) / 60), 2))")
mkdir -p "$OUT/bench"
timeout -k 5 $left "$PY" -m logitless_bench --suite lce --methods logitless,logitless@logits,torch-compile \
    --budgets default,logits --warmup 2 --reps 8 --max-minutes "$mins" --out "$OUT/bench" \
    > "$OUT/lce-s6.log" 2>&1
echo "lce suite exit: $? at $(( $(date +%s) - S )) s"
sed -n '/## Summary/,/## All metrics/p' "$OUT"/bench/lce-*.md 2>/dev/null | head -40
NEW=$(ls "$OUT"/bench/lce-*.json 2>/dev/null | head -1)
if [ -n "$NEW" ]; then
    timeout 30 "$PY" -m logitless_bench compare benchmarks/results/lce-compile-issue23-s4-H100-2026-11-23.json "$NEW" \
        --out "$OUT/bench/compare-s6.md" > /dev/null 2>&1
    sed -n '/## Geomean/,/## Too noisy/p' "$OUT/bench/compare-s6.md" | head -40
fi
tar czf "$OUT/s6.tgz" -C "$OUT" bench && rm -rf "$OUT/bench"
echo "wall: $(( $(date +%s) - S )) s"
