"""The one exception family of kernel_ext.

Every error this package raises on purpose derives from :class:`KernelExtError`.
Errors are raised at construction or at the edges (decoding, configuration), never
from the tool's hot path: ``publish()`` and friends swallow and count instead.
"""

from __future__ import annotations

import math

__all__ = [
    "BlockTooLargeError",
    "ColleagueError",
    "ConfigError",
    "DecodeError",
    "KernelExtError",
    "check_positive_ints",
    "check_positive_numbers",
]


class KernelExtError(Exception):
    """Base class of every error raised by kernel_ext."""


class ConfigError(KernelExtError, ValueError):
    """An argument or environment variable has a value kernel_ext cannot use."""


class DecodeError(KernelExtError, ValueError):
    """A block or envelope could not be decoded.

    ``field`` names the offending field as a dotted wire path (``envelope.seq``),
    or is ``None`` when the input as a whole is bad (not JSON, not an object).
    """

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class BlockTooLargeError(DecodeError):
    """An encoded block stays over the size bound even after truncation."""


class ColleagueError(KernelExtError):
    """A colleague asked over A2A gave no answer (``kernel_ext.a2a.ask_colleague``).

    Raised only after the stream's ``aborted`` terminal block was published. ``state``
    says why: ``failed``, ``canceled``, ``rejected``, ``auth_required`` (the colleague's
    own terminal state), ``incomplete`` (its stream ended without one), ``error``
    (transport or protocol error) or ``timeout``; ``task_id`` and ``context_id`` are the
    A2A ids when the colleague created a task.
    """

    def __init__(
        self,
        message: str,
        *,
        state: str,
        task_id: str | None = None,
        context_id: str | None = None,
    ) -> None:
        super().__init__(message)
        self.state = state
        self.task_id = task_id
        self.context_id = context_id


def check_positive_ints(**values: object) -> None:
    """Raise :class:`ConfigError` naming the first argument that is not an int ≥ 1 (bools
    are not ints here). For constructors, never for hot paths."""
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{name} must be a positive int, got {value!r}")


def check_positive_numbers(**values: object) -> None:
    """Raise :class:`ConfigError` naming the first argument that is not a finite number
    > 0 (seconds, rates). For constructors, never for hot paths."""
    for name, value in values.items():
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not math.isfinite(value)
            or not value > 0
        ):
            raise ConfigError(f"{name} must be a positive number, got {value!r}")
