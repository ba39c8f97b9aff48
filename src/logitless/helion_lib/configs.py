"""Launch configs of the Helion kernels: tuned ones from ``configs/*.json`` when one matches
the device class and shape bucket, else a default from a small heuristic. Never autotunes
at call time.

``configs/<device class>.json`` (device class: ``device_class()``, e.g. ``"nvidia-h100"``;
``"default.json"`` for every device) maps a kernel name to a list of entries
``{"min_tokens": int, "max_tokens": int or null, "max_hidden": int or null, "dtypes": [str],
"config": {...}}`` (each bound optional; tokens, hidden and the input dtype's name, e.g.
"bfloat16", of ``sizes()``), tried in order; the first whose bounds hold wins: a config tuned
for 16-bit inputs (its tiles and stages fill the shared memory) is not taken for fp32 ones.
The config dict holds ``helion.Config`` fields (``block_sizes`` in the order of the
kernel's ``hl.tile`` loops, ``num_warps``, ``num_stages``, and whatever else Helion's
autotuner returns: ``benchmarks/helion_gpu.py tune`` writes such files). A folder
named by ``LOGITLESS_HELION_CONFIGS`` (files of the same names) is read before the
package's, per device class: a user's own tuning wins over the shipped one (each file is
read once per process).
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from typing import Optional

import torch

_DIR = Path(__file__).parent / "configs"

#: The environment variable naming a folder of tuned configs read before the package's.
USER_DIR_ENV = "LOGITLESS_HELION_CONFIGS"

#: The ``hl.tile`` loops of each kernel, in order, as the names of the dims they tile:
#: "n" tokens, "v" vocabulary (of a chunk for the ``*_dz`` backward kernels), "h" hidden
#: (the reduction of the matmul).
KERNEL_DIMS = {
    "ce_forward": ("n", "v", "h"),
    "ce_dz": ("n", "v", "h"),
    "logp_forward": ("n", "v", "h"),
    "logp_dz": ("n", "v", "h"),
    "jsd_stats": ("n", "v"),  # both sweeps (one loop body) over a chunk's fp32 logits: no GEMM
    "jsd_dz": ("n", "v", "h", "h"),  # student then teacher hidden
}

#: Default block size per dim (capped by the problem size, at least 16).
_DEFAULT_BLOCK = {"n": 64, "v": 128, "h": 64}
#: Kernels without a GEMM (memory-bound row reductions): their own default blocks (one row
#: per program, a wide vocabulary tile; no tl.dot, so no minimum of 16) and warps.
_ROW_KERNELS = {"jsd_stats": ({"n": 1, "v": 1024}, 8)}


def device_class(device: torch.device) -> str:
    """"nvidia-h100", "nvidia-h200", ... from the device's name (``planning.device.facts``);
    the device type ("cpu") off GPUs."""
    from logitless.planning import device as _device

    facts = _device.facts(device)
    if not facts.gpu:
        return device.type
    name = facts.name.lower()
    for tag in ("h200", "h100", "b200", "a100", "l40", "mi300"):
        if tag in name:
            return ("amd-" if tag.startswith("mi") else "nvidia-") + tag
    return "other"


@functools.cache
def _load(cls: str, folder: Optional[str] = None) -> dict:
    path = Path(folder or _DIR) / f"{cls}.json"
    if not path.exists():
        return {}
    return json.loads(path.read_text())


def _sources(device: Optional[torch.device]) -> list:
    """(class, folder) in the order they are tried: the user folder's device class, the
    package's device class, the user folder's default, the package's default."""
    user = os.environ.get(USER_DIR_ENV) or None
    classes = (device_class(device), "default") if device is not None else ("default",)
    return [(cls, folder) for cls in classes for folder in ((user, None) if user else (None,))]


def _holds(entry: dict, sizes: dict) -> bool:
    for key, size, below in (("min_tokens", sizes["n"], False), ("max_tokens", sizes["n"], True),
                             ("max_hidden", sizes["h"], True)):
        bound = entry.get(key)
        if bound is not None and (size > bound if below else size < bound):
            return False
    return "dtypes" not in entry or entry["dtypes"] is None or sizes.get("dtype") in entry["dtypes"]


def _pow2_at_least(n: int, lo: int = 16) -> int:
    p = lo
    while p < n:
        p *= 2
    return p


def sizes(x: torch.Tensor, weight: torch.Tensor) -> dict:
    """The sizes a config is picked for: tokens n, vocabulary v, hidden h (of the student
    for linear_jsd) of 2-D x (N, H) and weight (V, H), and x's dtype name."""
    return {"n": x.shape[0], "v": weight.shape[0], "h": x.shape[1], "dtype": str(x.dtype).replace("torch.", "")}


def default_config(kernel: str, sizes: dict) -> dict:
    """The heuristic: each dim's default block, capped by the next power of two of its size
    (at least 16, tl.dot's minimum); 4 warps, fewer stages on small problems. The
    ``_ROW_KERNELS`` take their own blocks and warps."""
    default, warps = _ROW_KERNELS.get(kernel, (_DEFAULT_BLOCK, 4))
    blocks = [min(default[d], _pow2_at_least(max(int(sizes[d]), 1))) for d in KERNEL_DIMS[kernel]]
    return {"block_sizes": blocks, "num_warps": warps, "num_stages": 2}


def forward_span(config: dict, sizes: dict, device: Optional[torch.device] = None) -> int:
    """Vocabulary columns per program of the forward kernels (``ce_forward``, ``logp_forward``:
    a grid of row tiles x vocabulary splits, partials merged after): the Triton forward's
    split model (``planning.tiles.forward_blocks_per_split``: whole waves of one program per
    SM, a fixed cost per program) for the config's row and vocabulary tiles; a multiple of
    the vocabulary tile. One split (all V) where the row tiles alone fill the SMs."""
    from logitless.planning.tiles import forward_blocks_per_split

    block_n, block_v, block_h = (int(b) for b in config["block_sizes"][:3])
    v = int(sizes["v"])
    vocab_blocks = max(1, -(-v // block_v))
    from logitless.planning import device as _device

    facts = _device.facts(device) if device is not None else None
    sms = facts.sms if facts is not None and facts.gpu else 1
    per_split = forward_blocks_per_split(-(-int(sizes["n"]) // block_n), vocab_blocks,
                                         max(1, -(-int(sizes["h"]) // block_h)), sms, vocab_blocks)
    return min(per_split, vocab_blocks) * block_v


#: The fields of a stored config that fit every variant of its kernel. The others
#: (``indexing``, ``load_eviction_policies``, ...) have one entry per load or store, and a
#: kernel's variants (bias, soft-cap, ...) differ in those counts: a tuned ``indexing`` of 7
#: failed the variant with 8 on the H100 ("exceeds indexing config length"); Helion's
#: defaults fill them.
PORTABLE_FIELDS = ("block_sizes", "num_warps", "num_stages", "pid_type", "l2_groupings", "loop_orders")


def pick(kernel: str, sizes: dict, device: Optional[torch.device] = None) -> dict:
    """A tuned config matching (device class, tokens, hidden, dtype) if one is stored (the user
    folder first, module docstring; its ``PORTABLE_FIELDS`` only), else the default."""
    for cls, folder in _sources(device):
        for entry in _load(cls, folder).get(kernel, ()):
            if _holds(entry, sizes):
                return {k: v for k, v in entry["config"].items() if k in PORTABLE_FIELDS}
    return default_config(kernel, sizes)
