#!/usr/bin/env bash
# Issue 23, second Gluon probe: persistent `sw` forward statistics (planner splits and
# grid-filling splits) and a persistent Gluon dlogits kernel, against cuBLAS, our Triton
# kernels and the first probe's `sw`.          OUT=<dir> bash benchmarks/gpu/gluon2.sh
# H100, ~4 min wall. Without a GPU it runs the CPU checks (plans, schedule replay, sm_90a
# AOT compile with ptxas) and stops.
# 1. each variant alone on the small correctness shapes (float64), each in its own process
#    under a 100 s timeout, all at once (a hung kernel takes only itself down; this also
#    fills the triton cache), and meanwhile the library's Triton kernels run once at every
#    shape (compiled before the timed run)      -> $OUT/gluon2-checks.log
# 2. the check shapes with the library comparison and the five timed shapes, with the
#    variants that neither hung nor crashed in 1 (wrong ones are still timed, flagged BAD)
#                                                  -> $OUT/probe_gluon2.json, .log
# 3. the table, last, rebuilt from the JSON (a partial run still prints one)
#                                                  -> $OUT/gluon2.md
# At most 4 files under $OUT.
set +e
cd "$(dirname "$0")/../.."
. benchmarks/gpu/prelude.sh
start=$(date +%s)
P=benchmarks/probe_gluon2.py
if ! python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "== no GPU: CPU smoke (plans + schedule replay) and sm_90a AOT compile"
  python3 $P --smoke 2>&1 | tee "$OUT/gluon2-checks.log" | tail -n 12 | cut -c1-300
  python3 $P --compile 2>&1 | tee -a "$OUT/gluon2-checks.log" | cut -c1-300
  exit 0
fi
VARIANTS="sw persist persist_fill persist_nt overlap dlogits dlogits_tma dlogits_np"
CHK=/tmp/gluon2-check
mkdir -p $CHK
# The library's Triton kernels compiled at every shape meanwhile (the timed run then only
# reads the triton cache).
( timeout 110 python3 $P --warm-lib > "$CHK/warm.log" 2>&1 ) &

for v in $VARIANTS; do
  ( timeout 100 python3 $P --check-only --variant "$v" --out $CHK > "$CHK/$v.log" 2>&1; echo $? > "$CHK/$v.rc" ) &
done
wait
run=""
echo "== library warm-up: $(grep -c ': ok' "$CHK/warm.log") shapes ok"; grep -v ": ok" "$CHK/warm.log" | tail -n 5 | cut -c1-300
: > "$OUT/gluon2-checks.log"
for v in $VARIANTS; do
  rc=$(cat "$CHK/$v.rc")
  { echo "== $v: check rc=$rc"; cat "$CHK/$v.log"; } >> "$OUT/gluon2-checks.log"
  echo "== $v: check rc=$rc"
  grep -E "^(check|  $v|check-only)" "$CHK/$v.log" | cut -c1-300
  if [ "$rc" = 0 ] || [ "$rc" = 2 ]; then run="$run${run:+,}$v"; else tail -n 12 "$CHK/$v.log" | cut -c1-300; fi
done
{ echo "== library warm-up"; cat "$CHK/warm.log"; } >> "$OUT/gluon2-checks.log"
left=$(( 240 - ($(date +%s) - start) ))
[ $left -lt 60 ] && left=60
echo "== timed run: variants '${run}', ${left} s left ($(( $(date +%s) - start )) s so far)"
timeout $left python3 $P --out "$OUT" --reps 30 --variant "${run:-,}" 2>&1 \
    | tee "$OUT/probe_gluon2.log" | grep -v "^{" | cut -c1-400
echo "total $(( $(date +%s) - start )) s"
[ -f "$OUT/probe_gluon2.json" ] && python3 $P --table-from "$OUT/probe_gluon2.json" --markdown "$OUT/gluon2.md"
