#!/usr/bin/env bash
# Issue 23 (the route): Gluon warp-specialised LCE forward statistics against our Triton
# forward and one cuBLAS GEMM.   OUT=<dir> bash benchmarks/gpu/gluon.sh   (<= 3 min wall)
# 1. each Gluon variant alone on the small correctness shapes, each in its own process
#    under a 60 s timeout, the four at once (a hung or crashing warp-specialised kernel
#    takes only itself down; also fills the triton cache) -> $OUT/gluon-check-<v>.log/json
# 2. the check shapes again and the four timed shapes, with the variants that neither
#    hung nor crashed in 1 (wrong results are still timed, flagged BAD)
#                                                         -> $OUT/probe_gluon.json, .log
# 3. the table, last (rebuilt from the JSON, so a partial run still prints one).
set +e
cd "$(dirname "$0")/../.."
. benchmarks/gpu/prelude.sh
start=$(date +%s)
VARIANTS="sw ws pingpong pingpong7"
for v in $VARIANTS; do
  ( timeout 60 python3 benchmarks/probe_gluon.py --check-only --variant "$v" --out "$OUT" \
      > "$OUT/gluon-check-$v.log" 2>&1; echo $? > "$OUT/gluon-check-$v.rc" ) &
done
wait
run=""
for v in $VARIANTS; do
  rc=$(cat "$OUT/gluon-check-$v.rc")
  echo "== $v: check rc=$rc"
  grep -E "^(check|  $v|check-only)" "$OUT/gluon-check-$v.log" | cut -c1-400
  if [ "$rc" = 0 ] || [ "$rc" = 2 ]; then run="$run${run:+,}$v"; else tail -n 15 "$OUT/gluon-check-$v.log" | cut -c1-400; fi
done
left=$(( 172 - ($(date +%s) - start) ))
echo "== timed run: variants '${run}', ${left} s left ($(( $(date +%s) - start )) s so far)"
timeout $left python3 benchmarks/probe_gluon.py --out "$OUT" --reps 20 --variant "${run:-,}" 2>&1 \
    | tee "$OUT/probe_gluon.log" | grep -v "^{" | cut -c1-600
echo "total $(( $(date +%s) - start )) s"
[ -f "$OUT/probe_gluon.json" ] && python3 benchmarks/probe_gluon.py --table-from "$OUT/probe_gluon.json"
