"""Where the relay reports: one logger for the whole package, named ``kernel_ext.relay``
(operators and tests filter on that name, whichever module of the package logs), the rare
log on it, the ``kernel_ext.relay.frames`` metric, and how ``kernel-ext relay`` writes every
log record on stderr (:func:`log_as_command`).

It holds no counting of its own: the mechanisms live in :mod:`kernel_ext.observability`
(``RareLog`` counts each fault and logs its 1st, 2nd, 4th … occurrence; ``otel_metrics``
the instruments). This module only binds them to the relay's one logger name, so that the
relay's modules and :mod:`kernel_ext.redis`'s web-process parts log under it."""

from __future__ import annotations

import contextlib
import logging

from kernel_ext.observability import otel_metrics as metrics
from kernel_ext.observability._rare_log import RareLog

__all__ = ["count_frame", "log_as_command", "logger", "rare"]

logger = logging.getLogger("kernel_ext.relay")
rare = RareLog(logger)


def count_frame(outcome: str) -> None:
    """Add one to ``kernel_ext.relay.frames`` for ``outcome``; never raises."""
    with contextlib.suppress(Exception):
        metrics.relay_frames.add(1, {"outcome": outcome})


class _CommandFormatter(logging.Formatter):
    """A record as a command writes its lines on stderr: ``<prog>: <level>: <message>``, the
    level in lower case as in a refusal's ``<prog>: error: …`` (a traceback, when the record
    has one, on the lines after)."""

    def __init__(self, prog: str) -> None:
        super().__init__()
        self.prog = prog

    def format(self, record: logging.LogRecord) -> str:
        return f"{self.prog}: {record.levelname.lower()}: {super().format(record)}"


def log_as_command(prog: str, level: str) -> None:
    """Log every record of ``level`` or above — the relay's, uvicorn's (when it is told
    ``log_config=None``), any library's — to stderr through :class:`_CommandFormatter`, as
    :func:`logging.basicConfig` does: nothing changes when the root logger already has a
    handler (an application, a test runner)."""
    handler = logging.StreamHandler()
    handler.setFormatter(_CommandFormatter(prog))
    logging.basicConfig(level=level.upper(), handlers=[handler])
