#!/usr/bin/env bash
# Issue 23 (the route): Gluon warp-specialised LCE forward statistics against our Triton
# forward and one cuBLAS GEMM.   OUT=<dir> bash benchmarks/gpu/gluon.sh   (<= 3 min wall)
# 1. each Gluon variant alone on the small correctness shapes, in its own process under
#    a timeout (a hung or crashing warp-specialised kernel takes only itself down; also
#    compiles each variant once into the triton cache)   -> $OUT/gluon-check-<v>.log/json
# 2. the four timed shapes with the variants that neither hung nor crashed in 1
#    (wrong results are still timed, flagged BAD)         -> $OUT/probe_gluon.json, .log
# 3. the table, last (rebuilt from the JSON, so a partial run still prints one).
set +e
cd "$(dirname "$0")/../.."
. benchmarks/gpu/prelude.sh
start=$(date +%s)
run=""
for v in sw ws pingpong; do
  timeout 40 python3 benchmarks/probe_gluon.py --check-only --variant "$v" --out "$OUT" \
      > "$OUT/gluon-check-$v.log" 2>&1
  rc=$?
  echo "== $v: check rc=$rc ($(( $(date +%s) - start )) s)"
  grep -E "^(check|  $v|check-only)" "$OUT/gluon-check-$v.log" | cut -c1-400
  if [ $rc = 0 ] || [ $rc = 2 ]; then run="$run${run:+,}$v"; else tail -n 15 "$OUT/gluon-check-$v.log" | cut -c1-400; fi
done
left=$(( 172 - ($(date +%s) - start) ))
echo "== timed run: variants '${run}', ${left} s left"
timeout $left python3 benchmarks/probe_gluon.py --out "$OUT" --reps 20 \
    ${run:+--variant $run} $([ -z "$run" ] && echo --variant ,) 2>&1 | tee "$OUT/probe_gluon.log" | grep -v "^{" | cut -c1-600
echo "total $(( $(date +%s) - start )) s"
[ -f "$OUT/probe_gluon.json" ] && python3 benchmarks/probe_gluon.py --table-from "$OUT/probe_gluon.json"
