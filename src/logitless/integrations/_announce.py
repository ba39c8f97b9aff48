"""One INFO line per process per integration saying that logitless is active.

Each integration calls :func:`announce` where it takes over a framework's loss (a config
built, a model or trainer patched): the line tells a user reading the framework's log that
the loss runs on logitless, once, whatever the number of models, steps or calls. It goes to
the ``logitless`` logger unless the framework shows INFO lines only from its own loggers
(axolotl: ``axolotl.*``), where the integration names a logger under the framework's.
"""

from __future__ import annotations

import logging

#: The integrations that announced themselves in this process.
_announced: set[str] = set()


def announce(integration: str, what: str, logger: str = "logitless") -> bool:
    """Log ``logitless is active (integration): what`` at INFO, the first time only;
    True when this call logged."""
    if integration in _announced:
        return False
    _announced.add(integration)
    logging.getLogger(logger).info("logitless is active (%s): %s", integration, what)
    return True
