"""Where the relay reports: one logger for the whole package, named ``kernel_ext.relay``
(operators and tests filter on that name, whichever module of the package logs), the rare
log that counts each fault and logs its 1st, 2nd, 4th … occurrence, and the
``kernel_ext.relay.frames`` metric."""

from __future__ import annotations

import contextlib
import logging

from kernel_ext import metrics
from kernel_ext._telemetry import RareLog

__all__ = ["count_frame", "logger", "rare"]

logger = logging.getLogger("kernel_ext.relay")
rare = RareLog(logger)


def count_frame(outcome: str) -> None:
    """Add one to ``kernel_ext.relay.frames`` for ``outcome``; never raises."""
    with contextlib.suppress(Exception):
        metrics.relay_frames.add(1, {"outcome": outcome})
