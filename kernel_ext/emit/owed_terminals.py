"""The terminals a sender owes: held until their delivery is confirmed, within bounds, and
made smaller when the relay refuses them.

A terminal is sent exactly once per stream, so a sender never forgets one it could not
deliver: it holds it (:class:`OwedTerminals`) and tries again — after a reconnect (loopback)
or once Redis answers (Redis). Guarantees:

* Bounded: at most ``max_pending_terminals`` terminals are held (beyond, the oldest is
  given up, counted ``terminal_overflow``); a terminal is given up once it was tried
  ``terminal_max_attempts`` times or ``terminal_max_age`` seconds after its first attempt
  (counted ``terminal_expired``). Each is counted on the hub (on its call too) and logged
  at ERROR (rarely: a flood of them costs a handful of lines).
* Age counts from the first attempt, whatever happened since: it is checked on the terminal
  whenever it is held or taken (:meth:`OwedTerminals.hold`, :meth:`OwedTerminals.take`,
  :meth:`OwedTerminals.expire`), not by the map's time to live, which would count from the
  last time it was held.
* Refused (loopback): a terminal the relay refused is never counted delivered. It is made
  smaller one step per refusal (:meth:`OwedTerminal.degrade`: cut to the relay's size bound,
  then the protocol's short fallback terminal) and held again; when both were refused it
  is given up (counted ``rejected``, logged at ERROR).
"""

from __future__ import annotations

import copy
import itertools
import logging
import time
from collections.abc import Callable, Mapping
from typing import Literal

from kernel_ext._shared.bounded import OVERFLOW, BoundedMap
from kernel_ext.emit.base import REJECTED, TERMINAL_EXPIRED, TERMINAL_OVERFLOW, rare
from kernel_ext.errors import BlockTooLargeError, check_positive_ints, check_positive_numbers
from kernel_ext.observability._rare_log import plural
from kernel_ext.protocol import encode_wire, fallback_terminal
from kernel_ext.stream import OutgoingBlock, SenderPort

__all__ = ["OwedTerminal", "OwedTerminals"]


class OwedTerminal:
    """A terminal block a sender owes: ``first`` is when it was first tried (monotonic
    clock), ``attempts`` how often it was sent, ``level`` how often a refusal made it
    smaller (:meth:`degrade`)."""

    __slots__ = ("attempts", "first", "item", "level")

    def __init__(self, item: OutgoingBlock, first: float, attempts: int = 0) -> None:
        self.item = item
        self.first = first
        self.attempts = attempts
        self.level = 0

    def degrade(self, reason: str, relay_bound: int | None) -> bool:
        """Make a refused terminal more likely to pass, one step per refusal: first cut to
        the relay's size bound (when it was refused as ``too_large`` and the relay said its
        bound), then the protocol's short fallback terminal; ``False`` when both were
        refused (nothing smaller is left)."""
        item = self.item
        self.level += 1
        wire = item.block
        if self.level == 1 and reason == "too_large" and relay_bound is not None:
            cut = copy.deepcopy(wire)
            try:
                encoded = encode_wire(cut, max_bytes=relay_bound)
            except (BlockTooLargeError, KeyError, TypeError, ValueError):
                self.level += 1
            else:
                item.block = cut
                item.size = len(encoded)
                return True
        if self.level <= 2:
            state: Literal["done", "aborted"] = "done" if wire.get("state") == "done" else "aborted"
            envelope = wire.get("envelope")
            seq = envelope.get("seq") if isinstance(envelope, Mapping) else None
            item.block = fallback_terminal(
                item.call_id,
                str(item.task_id),
                state,
                int(time.time() * 1000),
                seq if isinstance(seq, int) and not isinstance(seq, bool) and seq >= 0 else 0,
                too_large=reason == "too_large",
            )
            item.size = len(repr(item.block))
            self.level = 2
            return True
        return False


class OwedTerminals:
    """The terminals a sender holds for a later attempt, oldest first (module docstring).

    The bounds are the senders' arguments of the same names.

    Args:
        port: returns the sender's :class:`~kernel_ext.stream.SenderPort`, where a
            terminal given up is reported (read when that happens).
        max_pending_terminals: terminals held at most.
        terminal_max_age: seconds after its first attempt a terminal is given up.
        terminal_max_attempts: attempts after which a terminal is given up.
        clock: the monotonic clock of the age (tests pass a fake).

    Raises:
        ConfigError: a bound that is not positive (naming it).
    """

    def __init__(
        self,
        port: Callable[[], SenderPort],
        *,
        max_pending_terminals: int,
        terminal_max_age: float,
        terminal_max_attempts: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        check_positive_ints(
            max_pending_terminals=max_pending_terminals,
            terminal_max_attempts=terminal_max_attempts,
        )
        check_positive_numbers(terminal_max_age=terminal_max_age)
        self._port = port
        self.max_age = float(terminal_max_age)
        self.max_attempts = terminal_max_attempts
        self._clock = clock
        self._keys = itertools.count()
        self._held: BoundedMap[int, OwedTerminal] = BoundedMap(
            max_pending_terminals, on_forget=self._forgotten
        )

    @property
    def max_count(self) -> int:
        """Terminals held at most."""
        return self._held.max_size

    def __len__(self) -> int:
        return len(self._held)

    def new(self, item: OutgoingBlock, attempts: int = 0) -> OwedTerminal:
        """A terminal about to be tried for the first time (or just tried, ``attempts``)."""
        return OwedTerminal(item, self._clock(), attempts)

    def hold(self, entry: OwedTerminal) -> None:
        """Keep ``entry`` for a later attempt; give it up (counted) when it is spent, or the
        oldest held one when over ``max_count``."""
        if self._spent(entry, self._clock()):
            self._give_up(entry, TERMINAL_EXPIRED)
        else:
            self._held.set(next(self._keys), entry)

    def take(self) -> list[OwedTerminal]:
        """Every held terminal still within its bounds, oldest first, no longer held (the
        spent ones are given up, counted)."""
        now = self._clock()
        fresh = []
        for _, entry in self._held.take():
            if self._spent(entry, now):
                self._give_up(entry, TERMINAL_EXPIRED)
            else:
                fresh.append(entry)
        return fresh

    def expire(self) -> None:
        """Give up (counted) the held terminals that are spent; keep the rest."""
        for entry in self.take():
            self._held.set(next(self._keys), entry)

    def abandon(self) -> int:
        """Forget every held terminal, not counted (the caller counts them); how many."""
        n = len(self._held)
        self._held.clear()
        return n

    def refused(self, entry: OwedTerminal, reason: str, relay_bound: int | None) -> bool:
        """The relay refused ``entry`` (``reason``, the relay's size bound if it said it):
        degrade it one step and hold it (``True``), or give it up when nothing smaller is
        left (counted ``rejected``, logged at ERROR)."""
        if entry.degrade(reason, relay_bound):
            self.hold(entry)
            return True
        self._port().dropped(REJECTED, 1, entry.item.call_id)
        rare(
            "terminal_refused",
            "emitter: the relay refused the terminal of (%s, %s) even degraded (%s); it is lost",
            entry.item.call_id,
            entry.item.task_id,
            reason,
            level=logging.ERROR,
        )
        return False

    def _spent(self, entry: OwedTerminal, now: float) -> bool:
        return entry.attempts >= self.max_attempts or now - entry.first > self.max_age

    def _forgotten(self, _key: int, entry: OwedTerminal, reason: str) -> None:
        self._give_up(entry, TERMINAL_OVERFLOW if reason == OVERFLOW else TERMINAL_EXPIRED)

    def _give_up(self, entry: OwedTerminal, reason: str) -> None:
        item = entry.item
        self._port().dropped(reason, 1, item.call_id)
        rare(
            reason,
            "emitter: terminal of (%s, %s) given up after %s (%s)",
            item.call_id,
            item.task_id,
            plural(entry.attempts, "attempt"),
            reason,
            level=logging.ERROR,
        )
