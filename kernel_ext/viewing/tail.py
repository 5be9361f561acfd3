"""``kernel-ext tail``: follow a conversation's tool calls live in the terminal, like ``tail -f``.

It joins the conversation's room on the ``/chat`` relay (``auth={"token": T}`` when a token
is given) and prints what arrives with the semantics of :mod:`kernel_ext.viewing.view`: one header
line per tool call, every line of a call prefixed ``[<first 8 of callId>]``, the final
answer and an end marker at the terminal. ``--json``: every ``tool_event_stream`` block as
received, one JSON object per line.

Guarantees:

* Peer text is never trusted with the terminal: control characters and bidirectional
  overrides are printed as visible escapes (every line, by :func:`clean`), a lone
  surrogate as U+FFFD (:func:`kernel_ext.protocol.well_formed`), ``--json`` lines too.
* stdout holds only the stream; messages about the connection go to stderr.
* Every (re)join catches up: what the viewer lacks is printed first, between
  ``── 同步中… ──`` and ``── 实时 ──``, and a call says how many blocks it will never get.
* Exit codes: 2 for a command line that cannot be used (a bad option, a ``--url`` where no
  relay can be reached at start; one line says why); 1 when the relay refuses the
  connection or the join; 130 after Ctrl-C, 143 after SIGTERM, 129 after SIGHUP, with one
  line and no traceback, in any phase (:class:`kernel_ext.cli._common.StopSignals`); 0
  when stdout is closed.

Design (the line formats): docs/contracts.md, "The terminal viewer".
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import re
import signal
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TextIO

from kernel_ext.cli._common import EXIT_FAILED, exit_code_after, run_until_stopped
from kernel_ext.observability._rare_log import plural
from kernel_ext.protocol import (
    CHAT_EVENT,
    JOIN_EVENT,
    NAMESPACE,
    TOOL_EVENT_STREAM,
    well_formed,
)
from kernel_ext.viewing.terminal import (
    RelayClient,
    add_connection_arguments,
    clean,
    error_of,
    ok,
)
from kernel_ext.viewing.view import (
    Applied,
    Final,
    Item,
    PaneStatus,
    PaneStore,
    final_word,
    labels_for,
    missing_text,
    trace_url,
)

__all__ = [
    "EXIT_FAILED",
    "EXIT_INTERRUPTED",
    "TailPrinter",
    "add_arguments",
    "clean",
    "follow",
    "progress_line",
    "run",
]

EXIT_INTERRUPTED = exit_code_after(signal.SIGINT)
"""After Ctrl-C (SIGINT); SIGTERM gives 143."""

_UNSAFE_IN_JSON = re.compile("[\x7f-\x9f\u2028\u2029\u200e\u200f\u202a-\u202e\u2066-\u2069]")


_BAR_CELLS = 10


def _number(value: float) -> str:
    return str(int(value)) if isinstance(value, float) and value.is_integer() else str(value)


def progress_line(item: Item) -> str:
    """One ``progress`` item as a line: a bar of ten cells, the count and percentage when the
    total is a positive number (the value clamped to ``[0, total]``, the percentage rounded
    down, as in ``renderer.js``), else dots and the progress alone; then the item's text."""
    progress, total = item.progress, item.total
    if progress is not None and total is not None and total > 0:
        value = min(max(progress, 0), total)
        filled = round(_BAR_CELLS * value / total)
        bar = "█" * filled + "░" * (_BAR_CELLS - filled)
        count = f"{_number(progress)}/{_number(total)} · {math.floor(100 * value / total)}%"
    else:
        bar = "·" * _BAR_CELLS
        count = "" if progress is None else _number(progress)
    return " ".join(part for part in (f"▕{bar}▏", count, item.text or "") if part)


def _json_line(block: object) -> str:
    text = json.dumps(block, ensure_ascii=False, separators=(",", ":"), default=str)
    # json.dumps escapes C0 controls already; escape what it leaves (valid JSON escapes).
    return _UNSAFE_IN_JSON.sub(lambda m: f"\\u{ord(m.group()):04x}", text)


@dataclass
class _Printed:
    status: PaneStatus | None = None
    final: Final | None = None
    last_kind: dict[str, str] = field(default_factory=dict)
    traced: bool = False  # the link to its span was printed


class TailPrinter:
    """Turns ``tool_event_stream`` blocks and ``chat_event`` snapshots into terminal lines.

    Feed it what the socket delivers (:meth:`block`, :meth:`snapshot`) and call :meth:`tick`
    now and then; it writes whole lines to ``out`` and flushes after each input. Around each
    join: :meth:`joining` (returns the ``have`` cursors to send), :meth:`joined` with the
    acknowledgement. With ``json_mode`` it writes each block as received, one JSON object
    per line, and ignores snapshots (the store still takes the blocks, for the cursors). With
    ``trace_url`` (a trace backend's URL template, as the browser renderer's ``traceUrl``) a
    pane's link to its span is printed once, ``↗ URL``, as soon as the pane has a trace id
    (:func:`kernel_ext.viewing.view.trace_url`). A closed ``out`` (broken pipe) sets :attr:`broken`
    instead of raising.
    """

    def __init__(
        self,
        out: TextIO,
        *,
        locale: str = "zh",
        json_mode: bool = False,
        store: PaneStore | None = None,
        trace_url: str | None = None,
    ) -> None:
        self.out = out
        self.trace_url = trace_url
        self.json_mode = json_mode
        self.labels = labels_for(locale)
        self.colon = ": " if locale == "en" else "："
        self.store = store if store is not None else PaneStore(max_panes=1_000)
        self.broken = False
        self._printed: dict[str, _Printed] = {}
        self._caught_up_lines = False  # lines printed in this join's catch-up

    # -- output --------------------------------------------------------------------------
    def _write(self, lines: list[str]) -> None:
        if not lines or self.broken:
            return
        try:
            # A lone surrogate (valid in a block) cannot be written as UTF-8: U+FFFD instead.
            self.out.write(well_formed("".join(line + "\n" for line in lines)))
            self.out.flush()
        except (BrokenPipeError, ValueError):  # ValueError: the stream was closed
            self.broken = True

    @staticmethod
    def _tag(call_id: str | None) -> str:
        return "[—]" if call_id is None else f"[{clean(call_id[:8])}]"

    def _lines(self, tag: str, text: str, gutter: str = "") -> list[str]:
        parts = clean(text).split("\n")
        if len(parts) > 1 and parts[-1] == "":
            parts.pop()
        return [f"{tag} {gutter}{part}" for part in parts]

    # -- inputs --------------------------------------------------------------------------
    def block(self, block: object) -> None:
        """Print one ``tool_event_stream`` block (the JSON object as received)."""
        applied = self.store.apply_block(block)
        if self.json_mode:
            self._write([_json_line(block)])
            return
        lines = self._render(applied)
        if lines and self.store.replaying and not self._caught_up_lines:
            self._caught_up_lines = True
            lines.insert(0, f"── {self.labels['replay']} ──")
        self._write(lines)

    def snapshot(self, event: object) -> None:
        """Take one ``chat_event`` snapshot into account (nothing in ``json_mode``)."""
        if self.json_mode:
            return
        applied = self.store.apply_snapshot(event)
        self._write(self._render(applied))

    def joining(self) -> list[dict[str, Any]]:
        """A join is being sent: the panes catch up until :meth:`joined`. Returns the
        cursors to send as the join's ``have`` (:meth:`PaneStore.begin_replay`)."""
        self._caught_up_lines = False
        return self.store.begin_replay()

    def joined(self, ack: object) -> None:
        """The join's acknowledgement as received (``None`` when none came): the panes are
        live again (:meth:`PaneStore.end_replay`). Prints a notice for each stream the
        acknowledgement says lacks blocks, then ``── 实时 ──`` if the catch-up printed lines."""
        changed = self.store.end_replay(ack)
        if self.json_mode:
            return
        lines: list[str] = []
        streams = dict.fromkeys((a.call_id, a.task_id) for a in changed if a.outcome == "missing")
        for call_id, task_id in streams:  # one notice per stream, however many entries
            pane = self.store.pane(call_id) if call_id is not None else None
            task = pane.tasks.get(task_id or "") if pane is not None else None
            if pane is None or task is None:
                continue
            text = missing_text(self.labels, task.missing)
            if len(pane.tasks) > 1:
                text = f"{self.labels['task']} {task.task_id} · {text}"
            lines += self._lines(self._tag(pane.call_id), text)
        if self._caught_up_lines:
            self._caught_up_lines = False
            lines.append(f"── {self.labels['live']} ──")
        self._write(lines)

    def tick(self, now: float | None = None) -> None:
        """Let calls without blocks reach "no process details" (see :meth:`PaneStore.tick`)."""
        if self.json_mode:
            return
        lines: list[str] = []
        for call_id in self.store.tick(now):
            lines += self._sync(call_id)
        self._write(lines)

    # -- rendering -----------------------------------------------------------------------
    def _render(self, applied: Applied) -> list[str]:
        labels = self.labels
        if applied.outcome == "orphan" and applied.final is not None:
            word = final_word(labels, applied.final.source)
            return self._lines(
                self._tag(None),
                f"{labels['unattributed']} · {word}{self.colon}{applied.final.text}",
            )
        call_id = applied.call_id
        if call_id is None or applied.outcome not in ("item", "terminal", "snapshot"):
            return []
        pane = self.store.pane(call_id)
        if pane is None:
            return []
        tag = self._tag(call_id)
        lines: list[str] = []
        printed = self._printed.get(call_id)
        if printed is None or applied.new_pane:
            printed = self._printed[call_id] = _Printed()
            self._forget_evicted()
            name = f"{pane.tool} " if pane.tool else ""
            lines += self._lines(tag, f"── {name}{call_id}")
        if self.trace_url is not None and not printed.traced:
            url = trace_url(self.trace_url, pane.trace_id, call_id)
            if url is not None:
                printed.traced = True
                lines += self._lines(tag, f"↗ {url}")
        task_id = applied.task_id
        if applied.new_task and task_id is not None and len(pane.tasks) > 1:
            lines += self._lines(tag, f"{labels['task']} {task_id}")
        if applied.item is not None and task_id is not None:
            lines += self._item(tag, applied.item, printed.last_kind.get(task_id))
            printed.last_kind[task_id] = applied.item.kind
        return lines + self._sync(call_id)

    def _item(self, tag: str, item: Item, previous: str | None) -> list[str]:
        labels = self.labels
        if item.kind == "thinking":
            return [] if previous == "thinking" else self._lines(tag, labels["thinking"])
        if item.kind == "tool_call":
            return self._lines(tag, f"▶ {item.tool or '?'} {labels['toolStart']}")
        if item.kind == "tool_output_append":
            return self._lines(tag, item.text or "", gutter="│ ")
        if item.kind == "progress":
            return self._lines(tag, progress_line(item))
        if item.kind == "other":
            extra = f" {item.text}" if item.text is not None else ""
            return self._lines(tag, f"[{labels['unknownKind']}: {item.envelope_kind}]{extra}")
        return self._lines(tag, item.text or "")

    def _sync(self, call_id: str) -> list[str]:
        """Lines for what changed in the pane since it was last printed: the "no details"
        note, the final answer, the end marker."""
        pane = self.store.pane(call_id)
        printed = self._printed.get(call_id)
        if pane is None or printed is None:
            return []
        tag = self._tag(call_id)
        labels = self.labels
        lines: list[str] = []
        status, final = pane.status, pane.final
        if status != printed.status and status == "no_details":
            lines += self._lines(tag, labels["noDetails"])
        if final is not None and final != printed.final:
            word = final_word(labels, final.source)
            lines += self._lines(tag, f"{word}{self.colon}{final.text}")
        if status != printed.status and status == "ended":
            lines += self._lines(tag, f"── {labels['ended']} ──")
        printed.status, printed.final = status, final
        return lines

    def _forget_evicted(self) -> None:
        if len(self._printed) > len(self.store.panes) + 64:
            live = {pane.call_id for pane in self.store.panes}
            for call_id in [key for key in self._printed if key not in live]:
                del self._printed[call_id]


async def follow(
    url: str,
    conversation_id: str,
    printer: TailPrinter,
    *,
    token: str | None = None,
    namespace: str = NAMESPACE,
    timeout: float = 10.0,
    err: TextIO | None = None,
    tick_interval: float = 0.5,
) -> int:
    """Join ``conversation_id``'s room at ``url`` and feed ``printer`` until cancelled.

    Returns 2 (after a one-line message on ``err``) when no relay can be reached at ``url``
    within ``timeout`` seconds, :data:`EXIT_FAILED` when it refuses the connection or the
    join; 0 when the printer's output is closed. On a dropped connection it reconnects and joins
    again (the relay forgets rooms with the old connection). Every join sends what the
    printer already holds (``have``) and lets it catch up until the acknowledgement
    (:meth:`TailPrinter.joining`, :meth:`TailPrinter.joined`); a join superseded by a newer
    one leaves the catch-up to the newer. Cancelling it disconnects.
    """
    follower = _Follower(url, conversation_id, printer, namespace, timeout, err)
    try:
        failed = await follower.connect(token)
        if failed is None:
            failed = await follower.first_join()
        if failed is not None:
            return failed
        while not printer.broken:
            await asyncio.sleep(tick_interval)  # the viewer's clock, not synchronisation
            printer.tick()
        return 0
    finally:
        await follower.close()


class _Follower(RelayClient):
    """One :func:`follow`: its Socket.IO client, its joins, what it tells the person."""

    def __init__(
        self,
        url: str,
        conversation_id: str,
        printer: TailPrinter,
        namespace: str,
        timeout: float,
        err: TextIO | None,
    ) -> None:
        super().__init__("kernel-ext tail", url, namespace=namespace, timeout=timeout, err=err)
        self.conversation_id = conversation_id
        self.printer = printer
        self.joined_once = False
        self.closing = False
        self.joins = 0  # the latest join ends the catch-up, not one it superseded
        self.sio.on("connect", self.on_connect, namespace=namespace)
        self.sio.on("disconnect", self.on_disconnect, namespace=namespace)
        self.sio.on(TOOL_EVENT_STREAM, printer.block, namespace=namespace)
        self.sio.on(CHAT_EVENT, printer.snapshot, namespace=namespace)

    async def first_join(self) -> int | None:
        """Join the room; ``None``, else the exit status (the reason said)."""
        import socketio

        try:
            ack = await self.join()
        except socketio.exceptions.TimeoutError:
            self.say(f"the relay did not answer join_conversation within {self.timeout:g} s")
            return EXIT_FAILED
        if not ok(ack):
            self.say(f"joining conversation {self.conversation_id!r} was refused: {error_of(ack)}")
            return EXIT_FAILED
        self.joined_once = True
        self.say(
            f"following conversation {self.conversation_id!r} at {self.url}"
            f"{_caught_up(ack)} (Ctrl-C to stop)"
        )
        return None

    async def join(self) -> Any:
        self.joins += 1
        this_join = self.joins
        # ``have`` even when empty: a relay that catches up answers it with ``replay``.
        request = {"conversationId": self.conversation_id, "have": self.printer.joining()}
        ack: Any = None
        try:
            ack = await self.sio.call(
                JOIN_EVENT, request, namespace=self.namespace, timeout=self.timeout
            )
        finally:
            if this_join == self.joins:
                self.printer.joined(ack)
        return ack

    async def rejoin(self) -> None:
        conversation = self.conversation_id
        try:
            ack = await self.join()
        except Exception as exc:  # reported, and the next reconnect tries again
            self.say(f"re-joining {conversation!r} failed: {exc or type(exc).__name__}")
            return
        if ok(ack):
            self.say(f"reconnected; following {conversation!r} again{_caught_up(ack)}")
        else:
            self.say(f"re-joining {conversation!r} was refused: {error_of(ack)}")

    def on_connect(self) -> None:
        if self.joined_once:
            self.sio.start_background_task(self.rejoin)

    def on_disconnect(self, *args: Any) -> None:
        if self.joined_once and not self.closing:
            self.say("connection lost; reconnecting…")

    async def close(self) -> None:
        self.closing = True
        await super().close()


def _caught_up(ack: Any) -> str:
    """``, caught up on N blocks`` when the acknowledgement reports a catch-up that sent
    blocks, else nothing."""
    replay = ack.get("replay") if isinstance(ack, Mapping) else None
    blocks = replay.get("blocks") if isinstance(replay, Mapping) else None
    if isinstance(blocks, int) and not isinstance(blocks, bool) and 0 < blocks < 2**53:
        return f", caught up on {plural(blocks, 'block')}"
    return ""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``tail``'s options to ``parser``."""
    add_connection_arguments(parser, "seconds to connect and to join")
    parser.add_argument(
        "--json",
        action="store_true",
        help="print each raw block as one JSON line (default: off, human-readable)",
    )
    parser.add_argument(
        "--lang", choices=("zh", "en"), default="zh", help="labels (default: %(default)s)"
    )
    parser.add_argument(
        "--trace-url",
        default=None,
        metavar="TEMPLATE",
        help="print each call's link to its span: a trace backend's URL template with "
        "{traceId} and {spanId} (default: none)",
    )


def run(args: argparse.Namespace, out: TextIO | None = None, err: TextIO | None = None) -> int:
    """Run ``kernel-ext tail`` with parsed ``args``; returns the exit code. A stop signal
    ends it as every command's does (:func:`kernel_ext.cli._common.run_until_stopped`)."""
    out = out if out is not None else sys.stdout
    err = err if err is not None else sys.stderr
    printer = TailPrinter(out, locale=args.lang, json_mode=args.json, trace_url=args.trace_url)
    code = run_until_stopped(
        follow(
            args.url,
            args.conversation,
            printer,
            token=args.token,
            namespace=args.namespace,
            timeout=args.timeout,
            err=err,
        )
    )
    if printer.broken and out is sys.stdout:
        # Keep the interpreter's final flush from complaining about the closed pipe.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    return code
