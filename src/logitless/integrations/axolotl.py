"""axolotl: one line in the YAML turns logitless on.

::

    plugins:
      - logitless.integrations.axolotl.LogitlessPlugin
    logitless_memory_budget: 268435456   # optional (bytes; default 256 MiB)

:class:`LogitlessPlugin` is an axolotl plugin (``axolotl.integrations.base.BasePlugin``):

- ``post_model_load``: ``logitless.transformers.patch(model, ...)`` on every model axolotl
  loads (adapters included: a ``PeftModel`` is patched through its base model). axolotl's
  SFT trainer (``AxolotlTrainer``, a transformers ``Trainer``) calls the model with
  ``labels``, so its loss is transformers' ``ForCausalLMLoss`` computed without logits.
  A model ``patch`` does not support raises ``ValueError`` with its reason.
- ``pre_model_load`` (``rl:`` set): ``logitless.integrations.trl.patch_trl()`` when the
  installed TRL has the fused-LM-head protocol (``trl.trainer.utils.add_fused_lm_head``,
  TRL >= 1.16): every TRL trainer axolotl builds afterwards (DPO, KTO, GRPO, RLOO) gets
  logitless' head. With an older TRL (axolotl 0.19 pins 1.9) those trainers compute
  their logits themselves, without ``labels``, which no patch reaches: a warning says so
  and the model is still patched (its forward is unchanged without labels).

Options (axolotl config keys, declared by :data:`LogitlessArgs` through
``get_input_args``): ``logitless`` (default true; false turns the plugin off),
``logitless_memory_budget``, ``logitless_backend``, ``logitless_z_loss``,
``logitless_label_smoothing`` (the options of ``logitless.transformers.patch``).

Refused at config validation (``ValueError`` naming the option), because both would
replace the LM head's loss: ``cut_cross_entropy`` (axolotl's CutCrossEntropyPlugin,
on by default once that plugin is listed), ``liger_fused_linear_cross_entropy`` and
``chunked_cross_entropy``.

The first model patched in a process logs, at INFO on ``axolotl.integrations.logitless`` (axolotl
shows INFO only from its own loggers), that logitless is active.

Importing this module imports axolotl's ``BasePlugin`` when axolotl is installed (never
from ``import logitless``); without axolotl, creating the plugin raises ImportError.
"""

from __future__ import annotations

import warnings
from typing import Any, Optional

from logitless.options import check_memory_budget

from ._announce import announce

#: axolotl's dotted name of this plugin, as written in a YAML ``plugins:`` list.
PLUGIN = "logitless.integrations.axolotl.LogitlessPlugin"

#: The logger of the plugin's line saying logitless is active: axolotl shows INFO lines only from
#: its own ``axolotl.*`` loggers.
LOGGER = "axolotl.integrations.logitless"

#: The plugins axolotl ships whose option replaces the LM head's loss too.
CCE_PLUGIN = "axolotl.integrations.cut_cross_entropy.CutCrossEntropyPlugin"

#: The config keys this plugin reads (besides ``rl``) and the ``patch`` option each sets.
OPTION_KEYS = {"logitless_memory_budget": "memory_budget", "logitless_backend": "backend",
               "logitless_z_loss": "z_loss", "logitless_label_smoothing": "label_smoothing"}


def _get(cfg, key: str, default=None):
    getter = getattr(cfg, "get", None)
    value = getter(key, default) if getter is not None else getattr(cfg, key, default)
    return default if value is None else value


def enabled(cfg) -> bool:
    """The plugin's switch: ``logitless`` (default true)."""
    return bool(_get(cfg, "logitless", True))


def conflicts(cfg) -> Optional[str]:
    """Why ``cfg`` cannot run with logitless (another fused head or loss patch), or None."""
    if not enabled(cfg):
        return None
    plugins = list(_get(cfg, "plugins", []) or [])
    if _get(cfg, "cut_cross_entropy", CCE_PLUGIN in plugins):
        return ("cut_cross_entropy is on (axolotl's CutCrossEntropyPlugin replaces the model's forward and its "
                "head's loss, as logitless does): remove that plugin or set cut_cross_entropy: false, or set "
                "logitless: false")
    for key in ("liger_fused_linear_cross_entropy", "chunked_cross_entropy"):
        if _get(cfg, key, False):
            return (f"{key} is on (it replaces the LM head's loss, as logitless does): set {key}: false "
                    f"(logitless computes the same loss without logits), or set logitless: false")
    return None


def patch_options(cfg) -> dict:
    """The ``logitless.transformers.patch`` options ``cfg`` sets (checked: ValueError names the key)."""
    options = {}
    for key, option in OPTION_KEYS.items():
        value = _get(cfg, key)
        if value is not None:
            options[option] = value
    if "memory_budget" in options:
        try:
            check_memory_budget(options["memory_budget"])
        except ValueError as e:
            raise ValueError(f"logitless_memory_budget: {e}") from None
    return options


def check_config(cfg) -> None:
    """Raise ValueError if ``cfg`` combines logitless with another head-loss patch or has a bad option."""
    reason = conflicts(cfg)
    if reason:
        raise ValueError(f"{PLUGIN}: {reason}")
    patch_options(cfg)


def trl_has_fused_head() -> bool:
    """Whether the installed TRL has the fused-LM-head protocol ``patch_trl`` replaces."""
    try:
        from trl.trainer import utils
    except Exception:
        return False
    return hasattr(utils, "add_fused_lm_head")


def patch_model(cfg, model):
    """``logitless.transformers.patch(model, **patch_options(cfg))`` unless disabled; ``model``."""
    if not enabled(cfg):
        return model
    import logitless.transformers as lt

    try:
        patched = lt.patch(model, **patch_options(cfg))
    except ValueError as e:
        raise ValueError(f"{PLUGIN}: {e} (remove the plugin or set logitless: false for this model)") from e
    announce("axolotl", f"the model's loss computed by logitless (no logits), {type(model).__name__}",
             logger=LOGGER)
    return patched


def route_trl(cfg) -> bool:
    """For ``rl:`` configs: ``patch_trl()`` if TRL has the fused-head protocol (True), else warn (False)."""
    if not enabled(cfg) or not _get(cfg, "rl"):
        return False
    if not trl_has_fused_head():
        warnings.warn(f"{PLUGIN}: rl: {_get(cfg, 'rl')} with a TRL without add_fused_lm_head (TRL >= 1.16 has "
                      f"it): its trainers compute logits themselves and are not routed through logitless; "
                      f"only forwards called with labels are", stacklevel=2)
        return False
    from .trl import patch_trl

    patch_trl()
    return True


try:  # pydantic comes with axolotl (its configs are pydantic models)
    from pydantic import BaseModel as _ArgsBase
    from pydantic import model_validator as _model_validator
except ImportError:  # pragma: no cover - without pydantic there is no axolotl to read LogitlessArgs
    _ArgsBase = object

    def _model_validator(**_):
        return lambda fn: fn

try:
    from axolotl.integrations.base import BasePlugin as _PluginBase
except ImportError:
    _PluginBase = None


class LogitlessArgs(_ArgsBase):
    """axolotl config keys of the logitless plugin (returned by ``LogitlessPlugin.get_input_args``)."""

    logitless: Optional[bool] = True
    logitless_memory_budget: Optional[int] = None
    logitless_backend: Optional[str] = None
    logitless_z_loss: Optional[float] = None
    logitless_label_smoothing: Optional[float] = None

    @_model_validator(mode="before")
    @classmethod
    def check_logitless(cls, data: Any):
        if isinstance(data, dict):
            check_config(data)
        return data


class LogitlessPlugin(_PluginBase or object):
    """axolotl plugin: the model's loss (and TRL's fused head) computed by logitless (module docstring)."""

    def __init__(self):
        if _PluginBase is None:
            raise ImportError(f"{PLUGIN} needs axolotl (pip install axolotl)")
        super().__init__()

    def get_input_args(self) -> str:
        return f"{__name__}.LogitlessArgs"

    def register(self, cfg):
        check_config(cfg)

    def pre_model_load(self, cfg):
        check_config(cfg)
        route_trl(cfg)

    def post_model_load(self, cfg, model):
        patch_model(cfg, model)
