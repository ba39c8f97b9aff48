#!/usr/bin/env bash
# Sourced first by every GPU script (the lent GPU machine is bare and offline):
#   . benchmarks/gpu/prelude.sh
# Installs the peers' wheels carried in .peers/ (bash ../shared/tools/peer-wheels.sh .peers)
# into /tmp/peers, adds a stub for tokamax's xprof import, sets PYTHONPATH and prints the
# versions. Safe to source twice.
export PYTHONUNBUFFERED=1
# NVLink multicast off (NCCL and torch symmetric memory): see the machines' notes.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
if [ -d .peers ] && [ ! -e /tmp/peers/.done ]; then
  python3 -m pip install -q --no-deps --no-index --no-compile --target /tmp/peers .peers/*.whl \
    && mkdir -p /tmp/peers/xprof/cli \
    && touch /tmp/peers/xprof/__init__.py /tmp/peers/xprof/cli/__init__.py \
    && echo 'get_kernel_stats_tool = lambda *a, **k: None' > /tmp/peers/xprof/cli/tools.py \
    && touch /tmp/peers/.done
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
[ -d /tmp/peers ] && export PYTHONPATH="$PYTHONPATH:/tmp/peers"
# JAX must not take 75% of the GPU from torch in the same machine.
export XLA_PYTHON_CLIENT_PREALLOCATE=false
python3 - <<'PY'
import importlib
mods = ["torch", "triton", "jax", "transformers", "peft", "liger_kernel", "cut_cross_entropy", "tokamax", "trl"]
out = []
for m in mods:
    try:
        out.append(f"{m} {getattr(importlib.import_module(m), '__version__', '?')}")
    except Exception as exc:  # noqa: BLE001
        out.append(f"{m} MISSING ({type(exc).__name__})")
import torch
dev = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
print("prelude:", dev, "|", ", ".join(out), flush=True)
PY
