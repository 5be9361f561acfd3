"""The one retry schedule of kernel_ext: jittered exponential backoff with a cap.

Senders reconnecting to a relay, a sender re-sending terminals to Redis and a relay
re-publishing terminals after a Redis outage all wait like this, so the rule lives once:
the n-th wait is ``initial * factor**(n-1)``, capped at ``maximum``, times a random factor
in ``[1 - jitter/2, 1 + jitter/2]`` (python-socketio's client uses the same shape, jitter
0.5 by default), and :meth:`Backoff.reset` starts over after a success.
"""

from __future__ import annotations

import random

from kernel_ext.errors import ConfigError, check_positive_numbers

__all__ = ["Backoff"]


class Backoff:
    """Successive waits between attempts (module docstring).

    Raises:
        ConfigError: a non-positive ``initial``/``maximum``/``factor``, ``maximum`` below
            ``initial``, a ``factor`` below 1, or a ``jitter`` outside [0, 1].
    """

    __slots__ = ("_current", "factor", "initial", "jitter", "maximum")

    def __init__(
        self, initial: float, maximum: float, *, factor: float = 2.0, jitter: float = 0.5
    ) -> None:
        check_positive_numbers(initial=initial, maximum=maximum, factor=factor)
        if maximum < initial:
            raise ConfigError(f"maximum must be at least initial, got {maximum!r} < {initial!r}")
        if factor < 1:
            raise ConfigError(f"factor must be at least 1, got {factor!r}")
        if not 0 <= jitter <= 1:
            raise ConfigError(f"jitter must be within [0, 1], got {jitter!r}")
        self.initial = float(initial)
        self.maximum = float(maximum)
        self.factor = float(factor)
        self.jitter = float(jitter)
        self._current = self.initial

    def next(self) -> float:
        """The next wait in seconds (jittered); the one after it grows, up to the cap."""
        wait = self._current
        self._current = min(self._current * self.factor, self.maximum)
        return wait * (1 - self.jitter / 2 + random.random() * self.jitter)

    def peek(self) -> float:
        """The next wait without jitter, without taking it."""
        return self._current

    def reset(self) -> None:
        """Start over from ``initial`` (after a success)."""
        self._current = self.initial
