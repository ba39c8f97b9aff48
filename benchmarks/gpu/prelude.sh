#!/usr/bin/env bash
# Sourced first by benchmarks/gpu/suite.sh (the lent GPU machine is bare and offline):
#   . benchmarks/gpu/prelude.sh
# Installs the peers' wheels carried in .peers/ (bash ../shared/tools/peer-wheels.sh .peers)
# into /tmp/peers, adds a stub for tokamax's xprof import, sets PYTHONPATH and prints the
# versions. Safe to source twice.
export PYTHONUNBUFFERED=1
# NVLink multicast off (NCCL and torch symmetric memory): see the machines' notes.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
if ls .peers/*.whl >/dev/null 2>&1 && [ ! -e /tmp/peers/.done ]; then
  python3 -m pip install -q --no-deps --no-index --no-compile --target /tmp/peers .peers/*.whl \
    && mkdir -p /tmp/peers/xprof/cli \
    && touch /tmp/peers/xprof/__init__.py /tmp/peers/xprof/cli/__init__.py \
    && echo 'get_kernel_stats_tool = lambda *a, **k: None' > /tmp/peers/xprof/cli/tools.py \
    && touch /tmp/peers/.done
fi
export PYTHONPATH="$PWD/src:$PWD/benchmarks${PYTHONPATH:+:$PYTHONPATH}"
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

# verl_kernels: VERL_PATH ("" or "/tmp/verl-stub:", to put before PYTHONPATH) such that
# verl.utils.kernel.linear_cross_entropy imports: verl itself if installed, else its kernel
# files from the first of $VERL_KERNEL_DIR, /tmp/peers, .peers holding verl/utils/kernel/*.py,
# with a stub verl/utils/device.py (verl's own __init__ pulls in ray & co).
verl_kernels() {
    VERL_PATH=""
    python3 -c "import verl.utils.kernel.linear_cross_entropy" >/dev/null 2>&1 && return 0
    local d
    for d in "$VERL_KERNEL_DIR" /tmp/peers .peers; do
        if [ -n "$d" ] && ls "$d"/verl/utils/kernel/*.py >/dev/null 2>&1; then
            rm -rf /tmp/verl-stub && mkdir -p /tmp/verl-stub/verl/utils/kernel
            cp "$d"/verl/utils/kernel/*.py /tmp/verl-stub/verl/utils/kernel/
            touch /tmp/verl-stub/verl/__init__.py /tmp/verl-stub/verl/utils/__init__.py
            cat > /tmp/verl-stub/verl/utils/device.py <<'PY'
import torch
is_cuda_available = torch.cuda.is_available()
def is_npu_available(): return False
def get_device_name(): return "cuda"
def get_torch_device(): return torch.cuda
def get_device_id(): return torch.cuda.current_device()
def get_nccl_backend(): return "nccl"
def get_device_capability(device_id=0): return torch.cuda.get_device_capability(device_id)
PY
            VERL_PATH="/tmp/verl-stub:"
            echo "verl kernel files from $d"
            return 0
        fi
    done
}
