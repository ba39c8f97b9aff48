"""What the probe scripts share: the run's metadata (device, versions, date, command) and
writing their JSON as they go. Imported as ``_probe_common`` by a probe run as
``python benchmarks/probe_X.py`` (its folder is then on sys.path)."""

from __future__ import annotations

import datetime
import json
import os
import platform
import sys


def probe_meta(device: str | None = None, **extra) -> dict:
    """device (the CUDA device's name, "cpu" without one, or ``device``), torch, triton and
    Python versions, UTC date, the command line; then ``extra`` in its order."""
    import torch
    import triton

    if device is None:
        device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return dict(device=device, torch=torch.__version__, triton=triton.__version__,
                python=platform.python_version(),
                date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                command=" ".join([os.path.basename(sys.executable)] + sys.argv), **extra)


def write_json(path: str, obj) -> None:
    """``obj`` as indented JSON at ``path`` (its folder created): called after each row,
    so that a run cut off keeps what it measured."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(obj, f, indent=1)
