#!/usr/bin/env bash
# Issue 9 (helper "hf"): logitless.transformers on CUDA and the end-to-end training benchmark.
#   OUT=<dir> bash benchmarks/gpu/hf.sh        (from the repo root; ~8.5 min on an H100, hard-guarded)
# 1. tests/test_transformers.py on CUDA (Triton backend)            -> $OUT/hf-pytest.log
# 2. python -m logitless.bench --suite train: Llama-3.2-1B-shaped model, 4 x 2048 tokens/step,
#    AdamW, 80 steps per curve, autocast (fp32 master weights) and pure bf16, for hf / logitless
#    (default 256 MiB budget) / logitless@logits (budget = the bf16 logits, 2 GiB: faster) / liger;
#    the larger-batch probe (without, then with gradient checkpointing; autocast; default budgets);
#    hf re-run on another data order (the spread).
#    A time guard stops it (saving what it measured) so that the whole script ends by ~8.7 min.
#    -> benchmarks/results/train-H100-<date>.json/.md/.png, copied to $OUT as hf-train.*,
#       log in $OUT/hf-train.log; its summary table is printed last.
# How to read the targets: in the table, rows logitless[@logits]-autocast and -bf16, columns
# "x hf" (step time, then peak memory): targets <= 0.97 and <= 0.78; liger-* rows the same
# columns for liger; "curve diff" of logitless vs that of hf-seed2 (the spread of two hf runs);
# "larger batch" lines: most tokens per step each method fits; "target" lines say met / NOT MET.
set +e
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/../.."
OUT=${OUT:-.out/hf}
mkdir -p "$OUT"
start=$(date +%s)
LIMIT=${HF_SH_LIMIT_S:-520}   # whole script, seconds

PEERS=/tmp/peers
if [ -f benchmarks/gpu/prelude.sh ]; then
    . benchmarks/gpu/prelude.sh      # main's shared set-up: peers' wheels into /tmp/peers, PYTHONPATH
elif ls .peers/liger_kernel-*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-deps --no-index --target "$PEERS" .peers/liger_kernel-*.whl 2>&1 | tail -n 2
else
    echo "no .peers/liger_kernel-*.whl: the liger rows will be skipped"
fi
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv 2>&1 | tail -n 1

echo "== tests/test_transformers.py (CUDA) =="
PYTHONPATH=src timeout 150 python3 -m pytest -q -rs tests/test_transformers.py 2>&1 | tee "$OUT/hf-pytest.log" | tail -n 15
echo "tests took $(( $(date +%s) - start )) s"

left=$(( LIMIT - ($(date +%s) - start) ))
guard=$(python3 -c "print(max(1.0, ($left - 45) / 60))")
echo "== training benchmark (time guard ${guard} min, hard limit ${left} s) =="
PYTHONPATH=src:$PEERS timeout -s TERM "$left" python3 -m logitless.bench --suite train --steps 80 \
    --methods hf,logitless,logitless@logits,liger \
    --max-minutes "$guard" --out benchmarks/results 2>&1 | tee "$OUT/hf-train.log" | grep -v "^\*" | tail -n 40
for ext in json md png; do
    f=$(ls -t benchmarks/results/train-*."$ext" 2>/dev/null | head -n 1)
    [ -n "$f" ] && cp "$f" "$OUT/hf-$(basename "$f")"
done
echo "total $(( $(date +%s) - start )) s; files in $OUT:"
ls "$OUT"
