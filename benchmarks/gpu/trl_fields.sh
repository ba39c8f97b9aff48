#!/usr/bin/env bash
# TRL's head fields on the GPU, from the worktree's root (under 3 minutes on an H100):
#   OUT=<dir> bash benchmarks/gpu/trl_fields.sh
# 1. pytest of the TRL head's field tests on CUDA (both routes; the Triton one is the FIELDS kernels) <= 90 s.
# 2. head_fields (what add_fused_lm_head calls) at 8192 x 4096 x 151936 bf16: outputs (log_probs, entropy)
#    against all five fields, forward and forward+backward medians (CUDA events, L2 flushed:
#    logitless_bench.timing) -> $OUT/trl-fields.json.
set +e
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}
export OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
S=$(date +%s)
nvidia-smi -L
timeout -k 5 90 python3 -m pytest tests/test_integrations_trl_head.py -q -p no:cacheprovider \
    -k "float64 or not_asked or ties or triton_route" > "$OUT/trl-fields-tests.log" 2>&1
echo "tests exit $? at $(( $(date +%s) - S )) s"
grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/trl-fields-tests.log" | tail -20
timeout -k 5 80 python3 - <<'PY'
import json, os
import torch
from logitless.integrations.trl_fields import FIELDS, head_fields
from logitless_bench.timing import time_ms_spread

n, h, v = 8192, 4096, 151936
dev = torch.device("cuda")
g = torch.Generator(device=dev).manual_seed(0)
x = torch.randn(n, h, device=dev, generator=g).to(torch.bfloat16).requires_grad_()
w = (torch.randn(v, h, device=dev, generator=g) * h**-0.5).to(torch.bfloat16).requires_grad_()
labels = torch.randint(0, v, (n,), device=dev, generator=g)
labels[::7] = -100
res = dict(device=torch.cuda.get_device_name(), n=n, h=h, v=v, dtype="bfloat16", torch=torch.__version__)

def clear():
    x.grad = w.grad = None

for name, outputs in (("logp_entropy", FIELDS[:2]), ("all_fields", FIELDS)):
    def fwd_nograd():
        with torch.no_grad():
            head_fields(x, w, labels, outputs=outputs)

    def fwd():
        return head_fields(x, w, labels, outputs=outputs)

    def fwd_bwd():
        out = head_fields(x, w, labels, outputs=outputs)
        (out[0].sum() + out[1].sum()).backward()

    row = {}
    torch.cuda.reset_peak_memory_stats()
    for key, fn in (("forward_nograd_ms", fwd_nograd), ("forward_ms", fwd), ("fwd_bwd_ms", fwd_bwd)):
        ms, spread = time_ms_spread(fn, device=dev, setup=clear, warmup=3, reps=10)
        row[key], row[key.replace("_ms", "_spread")] = round(ms, 3), round(spread, 3)
    row["peak_mib"] = round(torch.cuda.max_memory_allocated() / 2**20)
    res[name] = row
    print(name, row, flush=True)
res["all_over_logp_entropy"] = {k: round(res["all_fields"][k] / res["logp_entropy"][k], 3)
                                for k in ("forward_nograd_ms", "forward_ms", "fwd_bwd_ms")}
print(json.dumps(res["all_over_logp_entropy"]))
with open(os.path.join(os.environ["OUT"], "trl-fields.json"), "w") as f:
    json.dump(res, f, indent=1)
PY
echo "timing exit $? at $(( $(date +%s) - S )) s"
echo "wall $(( $(date +%s) - S )) s"
