"""Checks that a class's ``forward`` has the structure the patch relies on (by its AST).

The patch runs the model's own forward with ``labels=None`` and the head computing the
loss instead of the logits. That is exact only if, in the forward's source:

- the head is called exactly once, as ``logits = self.lm_head(...)``;
- the statements between it and ``loss = None`` are exactly the family's known logit
  transform (``registry.TRANSFORM_CODE``), or one of its transforms where transformers
  releases differ (``forward_transform`` says which one);
- the loss is ``self.loss_function(logits, labels, <vocab size>, **<forward's kwargs>)``
  (positional or keyword) under ``if labels is not None:``, plus, for mixture-of-experts
  families, exactly ``loss += <coefficient> * aux_loss.to(loss.device)`` under
  ``if labels is not None:`` (the coefficient expression is the registry's): with
  ``labels=None`` the model still computes ``aux_loss`` and returns it, and the patch adds
  it the same way;
- nothing after the head changes the logits.

Any other structure (a new transformers release changing the forward, remote code) is
refused with the reason instead of silently computing a different loss.
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap
from typing import Optional

from .registry import SUPPORTED, TRANSFORM_CODE


def _normalize(code: str) -> str:
    return ast.unparse(ast.parse(textwrap.dedent(code)))


def _assigns(stmt: ast.stmt, name: str) -> list:
    """The nodes in ``stmt`` (nested included) that assign to the variable ``name``."""
    found = []
    for node in ast.walk(stmt):
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.NamedExpr):
            targets = [node.target]
        else:
            continue
        if any(isinstance(t, ast.Name) and t.id == name for t in targets):
            found.append(node)
    return found


def _is_loss_call(stmt: ast.stmt, var_kw: Optional[str]) -> bool:
    """``loss = self.loss_function(logits, labels, <vocab>, **<var_kw>)`` (positional or keyword)."""
    if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name)
            and stmt.targets[0].id == "loss" and isinstance(stmt.value, ast.Call)):
        return False
    call = stmt.value
    if ast.unparse(call.func) != "self.loss_function":
        return False
    named = {}
    for name, arg in zip(("logits", "labels", "vocab_size"), call.args):
        named[name] = arg
    star = []
    for kw in call.keywords:
        if kw.arg is None:
            star.append(ast.unparse(kw.value))
        else:
            named[kw.arg] = kw.value
    if len(call.args) > 3 or set(named) != {"logits", "labels", "vocab_size"}:
        return False
    if ast.unparse(named["logits"]) != "logits" or ast.unparse(named["labels"]) != "labels":
        return False
    return star == ([var_kw] if var_kw else [])


def _is_aux_block(stmt: ast.stmt, coef: str) -> bool:
    """An ``if`` whose only ``loss`` change is ``if labels is not None: loss += <coef> * aux_loss.to(loss.device)``."""
    changes = _assigns(stmt, "loss")
    if len(changes) != 1:
        return False
    expected = _normalize(f"loss += {coef} * aux_loss.to(loss.device)")
    for node in ast.walk(stmt):
        if (isinstance(node, ast.If) and ast.unparse(node.test) == "labels is not None" and len(node.body) == 1
                and ast.unparse(node.body[0]) == expected and not node.orelse):
            return node.body[0] is changes[0]
    return False


#: class -> the key of the transform its forward has, set by a passing ``check_forward_source``.
_MATCHED: dict[type, str] = {}


def forward_transform(cls: type) -> str:
    """The key in ``TRANSFORM_CODE`` of the logit transform ``cls.forward`` applies (one of its
    family's ``transforms``). Raises ValueError with the reason if the source check fails."""
    reason = check_forward_source(cls)
    if reason:
        raise ValueError(f"{cls.__name__}: {reason}")
    return _MATCHED[cls]


@functools.cache
def check_forward_source(cls: type) -> Optional[str]:
    """None if ``cls.forward`` has the structure described in the module docstring, else the reason."""
    family = SUPPORTED[cls.__name__]
    fn = inspect.unwrap(cls.forward)
    try:
        body = ast.parse(textwrap.dedent(inspect.getsource(fn))).body[0].body
        var_kw = next((p.name for p in inspect.signature(fn).parameters.values()
                       if p.kind is inspect.Parameter.VAR_KEYWORD), None)
    except (OSError, TypeError, SyntaxError, IndexError, AttributeError, ValueError):
        return "its forward's source is not available to check"
    stmts = [ast.unparse(s) for s in body]
    heads = [i for i, s in enumerate(stmts) if "lm_head(" in s]
    if len(heads) != 1 or not stmts[heads[0]].startswith("logits = self.lm_head("):
        return "its forward does not compute `logits = self.lm_head(...)` exactly once"
    h = heads[0]
    try:
        loss_none = stmts.index("loss = None", h)
    except ValueError:
        return "its forward has no `loss = None` after the head"
    between = tuple(stmts[h + 1:loss_none])
    expected = {key: tuple(_normalize(code) for code in TRANSFORM_CODE[key]) for key in family.transforms}
    transform = next((key for key, code in expected.items() if between == code), None)
    if transform is None:
        wanted = " or ".join(str(list(code)) for code in expected.values())
        return f"its forward transforms the logits as {list(between)}, not as the patch expects ({wanted})"
    after = body[loss_none + 1:]
    loss_stmts = [s for s in after if _assigns(s, "loss")]
    first = loss_stmts[0] if loss_stmts else None
    ok = (isinstance(first, ast.If) and ast.unparse(first.test) == "labels is not None" and len(first.body) == 1
          and _is_loss_call(first.body[0], var_kw) and not first.orelse)
    rest = loss_stmts[1:]
    if ok and family.aux_coef is None:
        ok = not rest
    elif ok:
        ok = len(rest) == 1 and _is_aux_block(rest[0], family.aux_coef)
    if not ok:
        aux = "" if family.aux_coef is None else f" plus `loss += {family.aux_coef} * aux_loss.to(loss.device)`"
        return (f"its loss is not only `if labels is not None: loss = self.loss_function(logits, labels, "
                f"<vocab>, **{var_kw})`{aux}: {[ast.unparse(s) for s in loss_stmts]}")
    if any(_assigns(s, "logits") for s in after):
        return "its forward changes the logits after the loss"
    if family.aux_coef is not None and not any("aux_loss=aux_loss" in s for s in stmts[loss_none + 1:]):
        return "its forward does not return `aux_loss` in its output"
    _MATCHED[cls] = transform
    return None
