"""Docstring text that several public ops share, written once; ``shared_doc`` puts it in.

In a docstring decorated with ``shared_doc``, a line that holds only ``{name}`` (at any
indentation) stands for the fragment ``name`` of ``FRAGMENTS``, indented as that line.
``help()`` and ``inspect.getdoc`` show the filled text.
"""

from __future__ import annotations

import re
import textwrap

FRAGMENTS = {
    # the cross-entropy options of cross_entropy and linear_cross_entropy
    "ce_options": """\
ignore_index: targets equal to it contribute no loss and no gradient.
reduction: "mean" (over non-ignored tokens, weighted by class_weight as torch),
    "sum" or "none" (per-token loss in the shape of target, 0 at ignored tokens).
label_smoothing: in [0, 1], as in ``F.cross_entropy``.
class_weight: optional (V,) per-class weight, as ``weight=`` of ``F.cross_entropy``
    (receives no gradient).
softcap: optional s > 0: logits become s * tanh(z / s) (Gemma 2).
z_loss: coefficient of the z-loss term lse**2 (0 disables it).""",
    "return_stats": """\
return_stats: also return a ``LossStats`` (per-token lse, per-token
    argmax == target, number of non-ignored tokens, per-token argmax id, -1 at
    ignored tokens) computed in the same pass.""",
    "backend": """\
backend: "auto" (Triton on CUDA, PyTorch elsewhere), "triton" or "torch".""",
    # what cross_entropy and linear_cross_entropy return, and do with bad input
    "ce_returns": """\
Returns:
    The loss (a scalar, or per-token for "none"), or ``(loss, stats)`` with
    ``return_stats=True``.

Errors and special values:
    Wrong ranks, shapes, dtypes or devices, an unknown reduction or backend, and
    options out of range raise ``ValueError``/``TypeError``. A target outside
    [0, V) that is not ``ignore_index`` raises ``ValueError`` on the CPU; on a GPU
    (where checking would stall on a host sync) that token's loss is NaN, and so
    is the reduced loss. NaN or inf in the inputs give a NaN loss, never a finite
    one. Empty inputs and batches with every token ignored behave as torch:
    "mean" gives NaN with zero gradients, "sum" gives 0.""",
}

_PLACEHOLDER = re.compile(r"^([ \t]*)\{(\w+)\}$", re.MULTILINE)


def shared_doc(obj):
    """Decorator: ``obj.__doc__`` with its ``{name}`` lines replaced by ``FRAGMENTS``
    (nothing to do when docstrings are stripped, ``python -OO``)."""
    if obj.__doc__:
        obj.__doc__ = _PLACEHOLDER.sub(lambda m: textwrap.indent(FRAGMENTS[m.group(2)], m.group(1)), obj.__doc__)
    return obj
