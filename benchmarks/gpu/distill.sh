#!/usr/bin/env bash
# Issue 10 (helper "distill"): jsd / linear_jsd on CUDA, then the distill benchmark suite.
#   OUT=<dir> bash benchmarks/gpu/distill.sh      (from the repo root)
# Expected wall time: ~7-8 min on one H100 (hard stops keep it under 9).
# 1. tests/test_jsd.py tests/test_linear_jsd.py on CUDA (Triton kernels for real)
#                                                              -> $OUT/distill-pytest.log
# 2. python -m logitless_bench --suite distill: 3 shapes (teacher 8192 -> student 4096,
#    V=128256, 4096 and 16384 tokens; 2048/2048, V=151936) x logitless, torch eager and
#    torch.compile of the naive formula, liger LigerFusedLinearJSD and
#    LigerFusedLinearJSDLoss, TRL's ChunkedDivergenceFunction (peers from .peers/)
#                                                              -> $OUT/distill-bench.log,
#                                                                 latest-distill-<dev>.json/.md
# 3. benchmarks/probe_distill.py (before 2): fwd and fwd+bwd vs the floor for 5 backward tiles
#                                                              -> $OUT/distill-probe.log
# 5 files come back. Each part runs under its own timeout; one failing part does not stop the next.
set +e
cd "$(dirname "$0")/../.."
. benchmarks/gpu/lib.sh
gpu_env .out/distill
start=$(date +%s)
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv 2>&1

echo "== tests (CUDA) =="
PYTHONPATH=src timeout 180 python3 -m pytest -q -rs -p no:cacheprovider tests/test_jsd.py tests/test_linear_jsd.py \
    2>&1 | tee "$OUT/distill-pytest.log" | tail -n 25
echo "tests took $(( $(date +%s) - start )) s"

echo "== probe: backward tiles at 4096 x 4096<-8192 x 128256 =="
PYTHONPATH=src timeout 75 python3 benchmarks/probe_distill.py 2>&1 | tee "$OUT/distill-probe.log" | tail -n 8
echo "probe done at $(( $(date +%s) - start )) s"

echo "== peers =="
PEERS=""
if ls .peers/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-deps --no-index --target /tmp/peers .peers/*.whl 2>&1 | tail -n 3
    PEERS=":/tmp/peers"
else
    echo "no .peers/ wheels: liger and TRL rows will be skipped"
fi

echo "== bench --suite distill =="
left=$(( 525 - ($(date +%s) - start) ))
mins=$(python3 -c "print(max(1.0, ($left - 45) / 60))")
PYTHONPATH="src$PEERS" timeout $left python3 -m logitless_bench --suite distill --max-minutes "$mins" \
    --warmup 2 --reps 5 \
    --out benchmarks/results 2>&1 | tee "$OUT/distill-bench.log" | tail -n 30
for f in benchmarks/results/latest-distill-*.json benchmarks/results/latest-distill-*.md; do
    [ -f "$f" ] && cp "$f" "$OUT/$(basename "$f")"
done
echo "total $(( $(date +%s) - start )) s"
