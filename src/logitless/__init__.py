"""logitless: cross-entropy and distillation losses of language models without materialising the logits."""

# The PyTorch ops are exported when torch is installed. Without torch the package still
# imports, so that ``logitless.jax`` (which needs only jax) works in a torch-free
# environment; then only the JAX side is usable. Any other import error propagates.
# (Lazy PEP 562 exports were tried: a subpackage import such as
# ``logitless.ops.linear_cross_entropy.reference`` then replaces the same-named function.)
try:
    import torch as _torch  # noqa: F401
except ImportError as _exc:  # pragma: no cover - exercised in the torch-free environment
    if _exc.name != "torch":
        raise
    __all__: list = []
    del _exc

    #: The PyTorch ops' names: without torch, asking for one says what to install.
    _TORCH_NAMES = frozenset({
        "linear_cross_entropy", "LinearCrossEntropyLoss", "cross_entropy", "CrossEntropyLoss", "linear_jsd",
        "LinearJSDLoss", "jsd", "JSDLoss", "linear_log_probs", "LinearLogProbs", "log_probs", "LogProbs",
        "linear_topk_kl", "LinearTopKKLLoss", "LossStats", "DEFAULT_MEMORY_BUDGET", "patch_torch", "unpatch_torch"})

    def __getattr__(name: str):
        """``logitless.<name>`` (and ``from logitless import <name>``) for a PyTorch op without torch:
        a ModuleNotFoundError (an ImportError, name "torch") that says what to install."""
        if name in _TORCH_NAMES:
            raise ModuleNotFoundError(
                f"logitless.{name} needs PyTorch: pip install torch (or pip install logitless[torch]); "
                "the JAX ops are in logitless.jax", name="torch")
        raise AttributeError(f"module 'logitless' has no attribute {name!r}")
else:
    del _torch
    from .formulas.cross_entropy import LossStats
    from .integrations.torch_api import patch_torch, unpatch_torch
    from .ops.cross_entropy import CrossEntropyLoss, cross_entropy
    from .ops.jsd import JSDLoss, jsd
    from .ops.linear_cross_entropy import LinearCrossEntropyLoss, linear_cross_entropy
    from .ops.linear_jsd import LinearJSDLoss, linear_jsd
    from .ops.linear_log_probs import LinearLogProbs, linear_log_probs
    from .ops.linear_topk_kl import LinearTopKKLLoss, linear_topk_kl
    from .ops.log_probs import LogProbs, log_probs
    from .options import DEFAULT_MEMORY_BUDGET

    __all__ = [
        "linear_cross_entropy",
        "LinearCrossEntropyLoss",
        "cross_entropy",
        "CrossEntropyLoss",
        "linear_jsd",
        "LinearJSDLoss",
        "jsd",
        "JSDLoss",
        "linear_log_probs",
        "LinearLogProbs",
        "log_probs",
        "LogProbs",
        "linear_topk_kl",
        "LinearTopKKLLoss",
        "LossStats",
        "DEFAULT_MEMORY_BUDGET",
        "patch_torch",
        "unpatch_torch",
    ]

__version__ = "0.1.0"
