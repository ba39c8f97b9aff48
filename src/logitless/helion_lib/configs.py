"""Launch configs of the Helion kernels: tuned ones from ``configs/*.json`` when one matches
the device class and shape bucket, else a default from a small heuristic. Never autotunes
at call time.

``configs/<device class>.json`` (device class: ``device_class()``, e.g. ``"nvidia-h100"``;
``"default.json"`` for every device) maps a kernel name to a list of entries
``{"max_tokens": int or null, "max_hidden": int or null, "config": {...}}``, tried in order;
the first whose bounds hold wins. The config dict holds ``helion.Config`` fields
(``block_sizes`` in the order of the kernel's ``hl.tile`` loops, ``num_warps``,
``num_stages``). The files hold no tuned entries yet (GPU tuning is a later step).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Optional

import torch

_DIR = Path(__file__).parent / "configs"

#: The ``hl.tile`` loops of each kernel, in order, as the names of the dims they tile:
#: "n" tokens, "v" vocabulary, "h" hidden (the reduction of the matmul), "k" hidden (an
#: output block of dX or dW).
KERNEL_DIMS = {
    "ce_forward": ("n", "v", "h"),
    "ce_dx": ("n", "k", "v", "h"),
    "ce_dw": ("v", "k", "n", "h"),
    "logp_forward": ("n", "v", "h"),
    "logp_dx": ("n", "k", "v", "h"),
    "logp_dw": ("v", "k", "n", "h"),
    "jsd_forward": ("n", "v", "h", "h", "v", "h", "h"),  # two sweeps; student then teacher hidden
    "jsd_dx": ("n", "k", "v", "h", "h"),
    "jsd_dw": ("v", "k", "n", "h", "h"),
}

#: Default block size per dim (capped by the problem size, at least 16).
_DEFAULT_BLOCK = {"n": 64, "v": 128, "h": 64, "k": 128}


def device_class(device: torch.device) -> str:
    """"nvidia-h100", "nvidia-h200", ... from the device name; "cpu" on the CPU."""
    if device.type != "cuda":
        return device.type
    name = torch.cuda.get_device_name(device).lower()
    for tag in ("h200", "h100", "b200", "a100", "l40", "mi300"):
        if tag in name:
            return ("amd-" if tag.startswith("mi") else "nvidia-") + tag
    return "other"


@functools.lru_cache(maxsize=None)
def _load(cls: str) -> dict:
    path = _DIR / f"{cls}.json"
    if not path.exists():
        return {}
    return json.loads(path.read_text())


def _pow2_at_least(n: int, lo: int = 16) -> int:
    p = lo
    while p < n:
        p *= 2
    return p


def sizes(x: torch.Tensor, weight: torch.Tensor) -> dict:
    """The sizes a config is picked for: tokens n, vocabulary v, hidden h (of the student
    for linear_jsd) of 2-D x (N, H) and weight (V, H)."""
    return {"n": x.shape[0], "v": weight.shape[0], "h": x.shape[1]}


def default_config(kernel: str, sizes: dict) -> dict:
    """The heuristic: each dim's default block, capped by the next power of two of its size
    (at least 16, tl.dot's minimum); 4 warps, fewer stages on small problems."""
    blocks = [min(_DEFAULT_BLOCK[d], _pow2_at_least(max(int(sizes[d if d != "k" else "h"]), 1)))
              for d in KERNEL_DIMS[kernel]]
    return {"block_sizes": blocks, "num_warps": 4, "num_stages": 2}


def pick(kernel: str, sizes: dict, device: Optional[torch.device] = None) -> dict:
    """A tuned config matching (device class, tokens, hidden) if one is stored, else the default."""
    classes = (device_class(device), "default") if device is not None else ("default",)
    for cls in classes:
        for entry in _load(cls).get(kernel, ()):
            if entry.get("max_tokens") is not None and sizes["n"] > entry["max_tokens"]:
                continue
            if entry.get("max_hidden") is not None and sizes["h"] > entry["max_hidden"]:
                continue
            return dict(entry["config"])
    return default_config(kernel, sizes)
