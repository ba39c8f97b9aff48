"""Tuned Triton tile configurations, as data: shipped per GPU class, cached per machine.

Where ``plans.triton_plan`` gets its tiles (block_n, block_v, block_h, num_warps,
num_stages) on a GPU, first match wins:

1. ``overrides.override(tiles=...)`` (the tuner and tests; never set by the library);
2. the tuner's cache on this machine, ``$LOGITLESS_CACHE_DIR`` or
   ``~/.cache/logitless/<gpu>-torch<version>-triton<version>.json``, written only by
   ``python -m logitless.tune`` (opt-in, never during training);
3. the file shipped in the package for the GPU class, ``logitless/configs/<class>.json``;
4. ``tiles.CUDA_TILES`` by itemsize.

Set ``LOGITLESS_TUNED=0`` to skip 2 and 3. Keys are ``"<dtype class>/<shape class>"``
(``16-bit`` for bf16/fp16, ``32-bit``, and ``32-bit-tf32-prerounded`` for fp32 at matmul
precision "high" on operands rounded to TF32 beforehand; ``shape_class`` below; ``*``
matches any).

Determinism: a config is chosen from the device class, dtype and shape only, never by
timing at run time. The same config gives bitwise identical results run to run; two
different configs give the same loss and gradients up to fp32 summation order (the
tile sizes change the order of the partial sums), not bitwise.
"""

from __future__ import annotations

import functools
import json
import os
import re
from pathlib import Path
from typing import Optional

from logitless.planning import device as _device
from logitless.planning.overrides import current as _overrides

SHIPPED_DIR = Path(__file__).resolve().parent / "configs"


def dtype_class(itemsize: int) -> str:
    return "32-bit" if itemsize >= 4 else "16-bit"


def shape_class(num_tokens: int, hidden: int, vocab: int) -> str:
    """Buckets where the best tiles may differ: tokens (waves of row blocks) and hidden
    (K-loop length). The vocabulary only sets the number of column tiles."""
    t = "n1k" if num_tokens <= 1024 else ("n8k" if num_tokens <= 8192 else "nbig")
    h = "h2k" if hidden < 2048 else "hbig"
    return f"{t}-{h}"


#: The dtype class of fp32 plans on operands rounded to TF32 beforehand (matmul
#: precision "high", ``tiles.TritonPlan.w_chunk``): other kernels' tiles than "32-bit"
#: (3xTF32 at "highest", TF32 rounded in registers), so a key of their own, never
#: matched by "32-bit/*" (nor the reverse).
PREROUNDED_CLASS = "32-bit-tf32-prerounded"


def config_key(itemsize: int, num_tokens: int, hidden: int, vocab: int, prerounded: bool = False) -> str:
    cls = PREROUNDED_CLASS if prerounded and itemsize == 4 else dtype_class(itemsize)
    return f"{cls}/{shape_class(num_tokens, hidden, vocab)}"


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9.+]+", "-", text).strip("-")


def cache_path(device) -> Path:
    """This machine's tuner cache for ``device`` (a torch device or its ``DeviceFacts``):
    keyed by GPU name ("cpu" off GPUs), torch and triton."""
    import torch
    import triton

    root = Path(os.environ.get("LOGITLESS_CACHE_DIR") or Path.home() / ".cache" / "logitless")
    name = _device.facts(device).name
    return root / f"{_slug(name)}-torch{_slug(torch.__version__)}-triton{_slug(triton.__version__)}.json"


@functools.lru_cache(maxsize=32)
def _read(path: str) -> dict:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}
    return data.get("configs", {}) if isinstance(data, dict) else {}


def clear() -> None:
    """Forget the files read so far (after the tuner wrote a new cache)."""
    _read.cache_clear()
    _device_tables.cache_clear()
    from logitless.planning import memo

    memo.clear()  # plans made from the old tables


def _lookup(table: dict, key: str) -> Optional[tuple]:
    entry = table.get(key) or table.get(key.split("/")[0] + "/*")
    if not entry:
        return None
    tiles = entry.get("tiles") if isinstance(entry, dict) else entry
    if not (isinstance(tiles, (list, tuple)) and len(tiles) == 5 and all(isinstance(t, int) and t > 0 for t in tiles)):
        return None
    return tuple(tiles)


@functools.lru_cache(maxsize=16)
def _device_tables(device_key: str, cache_file: str, device_class: str) -> tuple:
    tables = [_read(cache_file)]
    shipped = SHIPPED_DIR / f"{device_class.lower()}.json"
    if shipped.exists():
        tables.append(_read(str(shipped)))
    return tuple(tables)


def tiles_for(device, itemsize: int, num_tokens: int, hidden: int, vocab: int,
              prerounded: bool = False) -> Optional[tuple]:
    """Tiles from the forced context, this machine's cache or the shipped file; None
    when none applies (the caller falls back to ``tiles.CUDA_TILES``), always off GPUs
    (``device``: a torch device or its ``DeviceFacts``). ``prerounded``: the fp32
    pre-rounded path's entries (``PREROUNDED_CLASS``) instead of "32-bit"."""
    forced = _overrides().tiles
    if forced is not None:
        return forced
    if os.environ.get("LOGITLESS_TUNED", "1") == "0":
        return None
    from logitless.planning.cost_model import device_class

    found = _device.facts(device)
    if not found.gpu:
        return None
    name = found.name
    tables = _device_tables(name, str(cache_path(found)), device_class(name))
    key = config_key(itemsize, num_tokens, hidden, vocab, prerounded)
    for table in tables:
        found = _lookup(table, key)
        if found is not None:
            return found
    return None
