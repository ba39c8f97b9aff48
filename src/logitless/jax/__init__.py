"""logitless for JAX: the fused linear cross-entropy without the logits (needs only jax).

    from logitless.jax import linear_cross_entropy
    loss = linear_cross_entropy(hidden, lm_head_kernel, labels, weight_layout="hv")

``linear_softmax_cross_entropy_loss`` is a drop-in for tokamax's op of that name;
``linear_jsd`` and ``linear_topk_kl`` are the distillation losses (``logitless.jax.maxtext``:
drop-ins for MaxText's vocabulary-tiling loss and offline sparse KL).
Backends: "xla" (plain JAX, chunked: CPU, GPU, TPU), "mosaic_gpu" (Pallas Mosaic GPU
kernels for SM90, when present) and "triton" (the PyTorch op's Triton kernels through
jax-triton, SM80+ NVIDIA GPUs; Triton's interpreter on CPUs, for tests) and "mosaic_tpu"
(Pallas TPU kernels, automatic on TPUs; TPU interpret mode elsewhere). Under a sharded
``jax.jit`` or inside ``jax.shard_map`` (``vocab_axis_name=``, ``token_axis_name=``) each
device computes its own shard. Layout mirrors the PyTorch side: ``formulas/``
(cross_entropy, log_probs), ``planning.py`` (chunk sizes; the Triton tiles and plan from
the shared ``logitless.planning.tiles``), ``ops/<op>/`` (api, reference, one file per
backend, bench shapes): linear_cross_entropy, linear_log_probs, linear_jsd and
linear_topk_kl (the last two on ``ops/common/rows.py``); ``budget.py``
(``memory_budget=None``: 3% of a GPU's memory, at least ``DEFAULT_MEMORY_BUDGET``,
which CPUs and TPUs get).
"""

from .budget import default_memory_budget
from .formulas.cross_entropy import LossStats
from .ops.linear_cross_entropy.api import linear_cross_entropy, linear_softmax_cross_entropy_loss
from .ops.linear_jsd.api import linear_jsd
from .ops.linear_log_probs.api import linear_log_probs
from .ops.linear_topk_kl.api import linear_topk_kl
from .planning import DEFAULT_MEMORY_BUDGET

__all__ = [
    "linear_cross_entropy",
    "linear_softmax_cross_entropy_loss",
    "linear_log_probs",
    "linear_jsd",
    "linear_topk_kl",
    "LossStats",
    "DEFAULT_MEMORY_BUDGET",
    "default_memory_budget",
]
