"""Small tiles for the Helion kernel tests, on the CPU and on a GPU alike.

Helion's ref mode (HELION_INTERPRET=1, the CPU) runs each ``hl.tile`` loop as one tile
unless told otherwise (``interpret_block_size``); compiled (CUDA) the configs' blocks
(64 to 128 wide) would hold the tests' small sizes in one tile too. Either way the online
merges across vocabulary tiles, the accumulations over row / hidden tiles and partial last
tiles would go untested. ``small_tiles`` splits them: tiles of ``size`` in the ref mode, and
on CUDA every launch's block sizes set to 16 (``tl.dot``'s least), through the launch
modules' ``launch`` (the configs' lookup itself stays as it is).
"""

from __future__ import annotations

import contextlib
import importlib

import torch

#: The modules of logitless.helion_lib that call ``runtime.launch``.
LAUNCHING = ("linear_cross_entropy", "linear_jsd", "linear_log_probs", "grad_kernels")


@contextlib.contextmanager
def interpret_block_size(size: int):
    """Within this context, Helion's ref mode splits every ``hl.tile`` loop that has no
    explicit block size into tiles of ``size`` (it otherwise runs each loop as ONE tile of
    the whole range, so that a CPU run would never exercise the online merges across
    vocabulary tiles, the accumulation of dX over vocabulary tiles or of dW over row tiles,
    nor partial last tiles): ``hl.tile``'s ref implementation wrapped (Helion's internals,
    test-side only)."""
    import helion.language as hl

    original = hl.tile._ref_fn

    def tiled(begin_or_end, end_or_none=None, block_size=None):
        return original(begin_or_end, end_or_none, size if block_size is None else block_size)

    hl.tile._ref_fn = tiled
    try:
        yield
    finally:
        hl.tile._ref_fn = original


@contextlib.contextmanager
def small_tiles(monkeypatch, size: int = 8):
    if torch.cuda.is_available():
        for name in LAUNCHING:
            module = importlib.import_module(f"logitless.helion_lib.{name}")

            def blocks_of_16(kernel, args, config, _original=module.launch):
                return _original(kernel, args, dict(config, block_sizes=[16] * len(config["block_sizes"])))

            monkeypatch.setattr(module, "launch", blocks_of_16)
    with interpret_block_size(size):
        yield
