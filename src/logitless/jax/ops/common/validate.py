"""Input checks shared by the JAX ops' public functions (trace-time, no host sync)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

#: Floating dtypes the JAX ops take for x, weight and bias.
FLOAT_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32, jnp.float64)


def check_float(name, a) -> None:
    """TypeError naming ``name`` unless ``a`` is an array of one of ``FLOAT_DTYPES``."""
    if not hasattr(a, "dtype") or not hasattr(a, "shape"):
        raise TypeError(f"{name} must be a jax or numpy array, got {type(a).__name__}")
    if jnp.dtype(a.dtype) not in [jnp.dtype(d) for d in FLOAT_DTYPES]:
        raise TypeError(f"{name} must be bfloat16, float16, float32 or float64, got {jnp.dtype(a.dtype).name}")


def check_linear_inputs(x, weight, labels, bias, *, labels_name: str, weight_layout: str = "vh",
                        vocab_shards: int = 1, layout_arg: bool = True) -> tuple[int, int, int]:
    """The checks every fused linear op makes of x (..., H), weight ((V, H) for
    ``weight_layout="vh"``, (H, V) for "hv"), the integer labels (``labels_name``:
    "target", "tokens"; shape x.shape[:-1]) and the optional bias (V_local,): float
    dtypes, ranks, matching hidden sizes and dtypes, a non-empty vocabulary. TypeError or
    ValueError naming the argument, at trace time (shapes and dtypes only, no values).
    ``vocab_shards``: how many shards the weight is of (a vocabulary split inside
    shard_map). ``layout_arg``: whether the op takes ``weight_layout=`` (the hint for a
    weight of the other layout names it, else ``weight.T``). Returns (local_classes,
    num_classes = local x shards, hidden)."""
    check_float("x", x)
    check_float("weight", weight)
    layouts = {"vh": "(V, H)", "hv": "(H, V)"}
    if weight_layout not in layouts:
        raise ValueError(f'weight_layout must be "vh" (V, H) or "hv" (H, V), got {weight_layout!r}')
    if x.ndim < 1:
        raise ValueError("x must have at least one dimension (..., H)")
    if weight.ndim != 2:
        raise ValueError(f"weight must be 2-D {layouts[weight_layout]}, got shape {tuple(weight.shape)}")
    local_classes, hidden = weight.shape if weight_layout == "vh" else weight.shape[::-1]
    num_classes = local_classes * vocab_shards
    if num_classes == 0:
        raise ValueError("weight has no classes: the vocabulary is empty")
    if x.shape[-1] != hidden:
        other = "hv" if weight_layout == "vh" else "vh"
        hint = ""
        if weight.shape[0 if weight_layout == "vh" else 1] == x.shape[-1]:
            # the shape fits the other layout: e.g. a flax Dense kernel (H, V) passed as (V, H)
            hint = (f"; it looks like a {layouts[other]} weight"
                    + (" (e.g. a flax Dense kernel)" if other == "hv" else "")
                    + (f": pass weight_layout={other!r}" if layout_arg else ": pass weight.T"))
        raise ValueError(f"x has hidden size {x.shape[-1]} but weight is {tuple(weight.shape)} "
                         f"{layouts[weight_layout]}{hint}")
    if jnp.dtype(x.dtype) != jnp.dtype(weight.dtype):
        raise TypeError(f"x is {jnp.dtype(x.dtype).name} but weight is {jnp.dtype(weight.dtype).name}; they must match")
    if not hasattr(labels, "dtype") or not jnp.issubdtype(labels.dtype, jnp.integer):
        raise TypeError(f"{labels_name} must be an integer array, got "
                        f"{getattr(labels, 'dtype', type(labels).__name__)}")
    if tuple(labels.shape) != tuple(x.shape[:-1]):
        raise ValueError(f"{labels_name} has shape {tuple(labels.shape)}, expected {tuple(x.shape[:-1])} "
                         "(the leading dimensions of x)")
    if bias is not None:
        check_float("bias", bias)
        if tuple(bias.shape) != (local_classes,):
            raise ValueError(f"bias must have shape ({local_classes},), got {tuple(bias.shape)}")
        if jnp.dtype(bias.dtype) != jnp.dtype(weight.dtype):
            raise TypeError(f"bias is {jnp.dtype(bias.dtype).name} but weight is "
                            f"{jnp.dtype(weight.dtype).name}; they must match")
    return local_classes, num_classes, hidden


_LAYOUTS = {"vh": "(V, H)", "hv": "(H, V)"}


def check_head(x_name: str, w_name: str, x, w, weight_layout: str) -> tuple[int, int]:
    """(V, H) of a hidden-states array and its LM-head weight in ``weight_layout``, or a
    TypeError / ValueError naming them (float dtypes, ranks, matching hidden sizes; a
    weight whose shape fits the other layout says so). Shapes and dtypes only."""
    if weight_layout not in _LAYOUTS:
        raise ValueError(f'weight_layout must be "vh" (V, H) or "hv" (H, V), got {weight_layout!r}')
    check_float(x_name, x)
    check_float(w_name, w)
    if x.ndim < 1:
        raise ValueError(f"{x_name} must have at least one dimension (..., H)")
    if w.ndim != 2:
        raise ValueError(f"{w_name} must be 2-D {_LAYOUTS[weight_layout]}, got shape {tuple(w.shape)}")
    v, h = w.shape if weight_layout == "vh" else w.shape[::-1]
    if x.shape[-1] != h:
        other = "hv" if weight_layout == "vh" else "vh"
        hint = ""
        if w.shape[1 if weight_layout == "hv" else 0] == x.shape[-1]:
            hint = f"; it looks like a {_LAYOUTS[other]} weight: pass weight_layout={other!r}"
        raise ValueError(f"{x_name} has hidden size {x.shape[-1]} but {w_name} is {tuple(w.shape)} "
                         f"{_LAYOUTS[weight_layout]}{hint}")
    if jnp.dtype(x.dtype) != jnp.dtype(w.dtype):
        raise TypeError(f"{x_name} is {jnp.dtype(x.dtype).name} but {w_name} is {jnp.dtype(w.dtype).name}; "
                        "they must match")
    return int(v), int(h)


def _concrete_on_cpu(a) -> bool:
    """Whether ``a``'s values can be read now without a device sync: a numpy array, or a
    concrete (not traced) jax array whose shards all live on CPU devices."""
    if isinstance(a, np.ndarray):
        return True
    if isinstance(a, jax.core.Tracer) or not isinstance(a, jax.Array):
        return False
    try:
        return a.is_fully_addressable and all(d.platform == "cpu" for d in a.devices())
    except Exception:  # a deleted or otherwise unreadable array: leave it to the op
        return False


def check_teacher_top_k(ids, log_probs, num_classes: int) -> None:
    """ValueError for a teacher id outside [0, num_classes) or repeated within a token,
    or a log-probability > 0 (logits passed by mistake), when both arrays are concrete
    CPU values (as ``check_labels_in_range``; traced or on a GPU nothing is read: a bad id
    makes that token's loss NaN, a repeated one counts twice)."""
    if getattr(ids, "size", 0) == 0 or not (_concrete_on_cpu(ids) and _concrete_on_cpu(log_probs)):
        return
    lp = np.asarray(log_probs, np.float64)
    if (lp > 0).any():
        raise ValueError(f"teacher_log_probs contains {lp[lp > 0][0]:.4g} > 0: log-probabilities are <= 0 (logits "
                         "passed by mistake? take log_softmax of the teacher's logits first)")
    values = np.asarray(ids).reshape(-1, ids.shape[-1])
    bad = (values < 0) | (values >= num_classes)
    if bad.any():
        raise ValueError(f"teacher_ids contains {int(values[bad][0])}, outside [0, {num_classes}) (eager CPU check; "
                         "under jax.jit, or on a GPU, that token's loss would be NaN)")
    ordered = np.sort(values, axis=1)
    repeated = (ordered[:, 1:] == ordered[:, :-1]).any(axis=1)
    if repeated.any():
        raise ValueError(f"teacher_ids repeats an id within token {int(np.argmax(repeated))} (flat index): the ids "
                         "of a token must be distinct (the teacher's top-k)")


def check_labels_in_range(labels, num_classes: int, ignore_index: int, name: str) -> None:
    """ValueError (naming ``name``) for a label outside [0, num_classes) that is not
    ignore_index, when the labels are concrete CPU values (not tracers: eager calls on
    a CPU, numpy arrays, constants a traced function closes over). Traced labels (jit
    arguments, inside ``shard_map``) and labels on a GPU (where reading them would be a
    host sync) are not checked: that token's outputs are NaN, as the ops document."""
    if getattr(labels, "size", 0) == 0 or not _concrete_on_cpu(labels):
        return
    values = np.asarray(labels)
    bad = (values != ignore_index) & ((values < 0) | (values >= num_classes))
    if bad.any():
        raise ValueError(f"{name} contains {int(values[bad][0])}, outside [0, {num_classes}) and not "
                         f"ignore_index={ignore_index} (eager CPU check; under jax.jit, or on a GPU, "
                         "that token's outputs would be NaN)")


def check_distill_target(target, lead: tuple, x_name: str, *, hard: bool, num_classes: int,
                         ignore_index: int) -> None:
    """TypeError/ValueError for a distillation loss's optional target (not None): an integer
    array of ``lead``, the leading shape of ``x_name``; with hard labels (``hard``) the
    labels in range (``check_labels_in_range``)."""
    if not hasattr(target, "dtype") or not jnp.issubdtype(target.dtype, jnp.integer):
        raise TypeError(f"target must be an integer array, got {getattr(target, 'dtype', type(target).__name__)}")
    if tuple(target.shape) != lead:
        raise ValueError(f"target has shape {tuple(target.shape)}, expected {lead} (the leading dimensions of "
                         f"{x_name})")
    if hard:
        check_labels_in_range(target, num_classes, ignore_index, "target")
