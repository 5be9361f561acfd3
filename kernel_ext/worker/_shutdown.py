"""The worker's ways out besides a direct ``disable()``: the sender's own event-loop thread,
the interpreter-exit hook, and the ``SIGTERM`` handler that flushes before the process dies.

This module knows nothing of what it flushes: :mod:`kernel_ext.worker.wiring` hands it the flush.

Guarantees:

* :class:`LoopThread` runs an event loop on a daemon thread until :meth:`LoopThread.stop`;
  the process's asynchronous signals (``SIGTERM``, ``SIGINT`` …) are blocked there, so that
  they reach the application's threads.
* :func:`at_exit` registers a hook with :mod:`atexit` once, however often it is called.
* :class:`SigtermFlush` installs itself only on the main thread and only while ``SIGTERM``
  has its default action (an application with its own handler keeps it). On ``SIGTERM`` it
  runs the flush, bounded by its timeout (plus 5 s for a flush that overruns it), then
  ends the process of ``SIGTERM`` as the default action would have (exit status 143 in a
  shell). :meth:`SigtermFlush.restore` puts the default action back, once.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import os
import signal
import sys
import threading
from collections.abc import Awaitable, Callable, Coroutine
from types import FrameType
from typing import Any, TypeVar

__all__ = [
    "LoopThread",
    "SigtermFlush",
    "at_exit",
    "at_multiprocessing_start",
    "forking_for_multiprocessing",
    "in_multiprocessing_child",
]

# The plugin's logger: these lines are the plugin's shutdown paths, as operators know them.
logger = logging.getLogger("kernel_ext.worker.wiring")

_T = TypeVar("_T")


_ASYNC_SIGNALS = {
    getattr(signal, name)
    for name in (
        "SIGINT",
        "SIGTERM",
        "SIGHUP",
        "SIGQUIT",
        "SIGUSR1",
        "SIGUSR2",
        "SIGALRM",
        "SIGCHLD",
        "SIGWINCH",
    )
    if hasattr(signal, name)
}


class LoopThread:
    """A daemon thread running an event loop for the sender when the kernel has none."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name="kernel_ext-sender", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        # Process signals go to the application's threads, never to this one: a signal
        # the kernel hands this thread would not interrupt the main thread's blocking wait
        # (a multiprocessing worker's queue), so its handler would never run.
        if hasattr(signal, "pthread_sigmask"):
            signal.pthread_sigmask(signal.SIG_BLOCK, _ASYNC_SIGNALS)
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def run(self, coro: Coroutine[Any, Any, _T], timeout: float) -> _T:
        """Run ``coro`` on the thread's loop and wait for it (at most ``timeout`` s)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the loop and wait (at most ``timeout`` s) for the thread; close the loop
        if the thread ended. Idempotent."""
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self.loop.close()


_registered: set[Callable[[], None]] = set()


def at_exit(hook: Callable[[], None]) -> None:
    """Run ``hook`` at normal interpreter exit (registered once per hook)."""
    if hook not in _registered:
        atexit.register(hook)
        _registered.add(hook)


class _Key:
    """A weak-referenceable key for ``multiprocessing.util.register_after_fork``."""


_MULTIPROCESSING_KEY = _Key()
_MULTIPROCESSING_UTILS = ("multiprocessing.util", "billiard.util")  # billiard: Celery's fork
_multiprocessing_pid = 0


def in_multiprocessing_child() -> bool:
    """Whether ``multiprocessing`` (or ``billiard``) started this process and its bootstrap
    has run."""
    for name in ("multiprocessing.process", "billiard.process"):
        process = sys.modules.get(name)
        parent = getattr(process, "parent_process", None)
        if parent is not None and parent() is not None:
            return True
    return False


def forking_for_multiprocessing() -> bool:
    """In an at-fork hook of the child: whether ``multiprocessing`` (or ``billiard``) forked
    this process (its code is on the stack of the fork)."""
    frame = sys._getframe(1)
    while frame is not None:
        name = frame.f_globals.get("__name__")
        if isinstance(name, str) and name.startswith(("multiprocessing.", "billiard.")):
            return True
        frame = frame.f_back  # type: ignore[assignment]
    return False


def at_multiprocessing_start(start: Callable[[], None], end: Callable[[], None]) -> None:
    """For the processes ``multiprocessing`` (or Celery's ``billiard``) starts — with any
    start method: ``start()`` when the process's bootstrap runs, and ``end()`` when it
    ends. Such a process ends with ``os._exit`` under the fork and forkserver methods, so
    ``atexit`` hooks never run there, but its finalizers do.

    Covers the children this process forks, a process whose bootstrap is still to come (an
    application imported afresh by a spawn or forkserver child: the bootstrap drops the
    finalizers registered before it), and this process when multiprocessing started it
    and its bootstrap has run. Once per process; nothing when no such module is imported
    yet (the fork hook calls it again in each child).
    """
    global _multiprocessing_pid
    if _multiprocessing_pid == os.getpid():
        return
    for name in _MULTIPROCESSING_UTILS:
        util = sys.modules.get(name)
        if util is None:
            continue
        _multiprocessing_pid = os.getpid()

        def started(_key: object, util: Any = util) -> None:
            start()
            util.Finalize(None, end, exitpriority=0)

        util.register_after_fork(_MULTIPROCESSING_KEY, started)
        util.Finalize(None, end, exitpriority=0)


class SigtermFlush:
    """Flush on ``SIGTERM``, then die of it (module docstring).

    ``flush(timeout)`` runs on a helper thread when the signal reaches a sync kernel, so a
    lock the interrupted code holds cannot keep the process alive; ``aflush(timeout)`` is
    awaited on the sender's loop when that loop is the main thread's running loop at
    :meth:`install` (an async kernel).
    """

    def __init__(
        self,
        flush: Callable[[float], object],
        aflush: Callable[[float], Awaitable[object]],
        timeout: float,
    ) -> None:
        self._flush = flush
        self._aflush = aflush
        self._timeout = timeout
        self._handler = self._on_signal  # one bound method: restore() compares identity
        self._loop: asyncio.AbstractEventLoop | None = None
        self._installed = False
        self._pid = os.getpid()  # the process whose sender the handler flushes

    def install(self, sender_loop: asyncio.AbstractEventLoop | None) -> None:
        """Take ``SIGTERM`` if this is the main thread and it still has its default action;
        on ``sender_loop`` when that is this thread's running loop."""
        if threading.current_thread() is not threading.main_thread():
            return
        try:
            if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
                return  # the application handles SIGTERM: it should call (a)disable itself
            try:
                running: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
            except RuntimeError:
                running = None
            self._pid = os.getpid()
            if running is not None and running is sender_loop:
                running.add_signal_handler(signal.SIGTERM, self._on_signal_in_loop, running)
                self._loop = running
            else:
                signal.signal(signal.SIGTERM, self._handler)
            self._installed = True
        except (ValueError, OSError, RuntimeError, NotImplementedError) as exc:
            logger.info("kernel_ext: no SIGTERM flush (%s)", exc)

    def restore(self) -> None:
        """Give ``SIGTERM`` its default action back, if this installed a handler and it is
        still in place. Idempotent; call it on the main thread."""
        if not self._installed:
            return
        if threading.current_thread() is not threading.main_thread():
            # Left in place: with nothing enabled any more it just terminates the process.
            logger.debug("kernel_ext: SIGTERM handler left in place (not the main thread)")
            return
        self._installed = False
        loop, self._loop = self._loop, None
        try:
            if loop is not None:
                if not loop.is_closed():
                    loop.remove_signal_handler(signal.SIGTERM)  # back to SIG_DFL
            elif signal.getsignal(signal.SIGTERM) is self._handler:
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
        except (ValueError, OSError, RuntimeError) as exc:
            logger.info("kernel_ext: SIGTERM handler not restored (%s)", exc)

    def after_fork(self) -> SigtermFlush | None:
        """In a forked child: the flush for the child, or ``None``. A handler on the
        parent's event loop is taken off — that loop's wake-up pipe is shared with the
        parent, so a ``SIGTERM`` to the child would reach the parent's loop — and a plain
        one installed (the child's forking thread is its main thread); a plain handler
        works in the child as it is (it flushes the child's sender)."""
        if not self._installed:
            return None
        if self._loop is None:
            self._pid = os.getpid()  # the child's own now: it flushes the child's sender
            return self
        self._installed = False
        self._loop = None
        try:
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
        except (ValueError, OSError) as exc:
            logger.info("kernel_ext: no SIGTERM flush in this forked process (%s)", exc)
            return None
        child = SigtermFlush(self._flush, self._aflush, self._timeout)
        child.install(None)
        return child if child._installed else None

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        """SIGTERM in a sync kernel (the sender on its own thread): flush, then terminate.
        In a forked child before its fork hook took the handler over (a pool terminating a
        worker that is still starting), terminate at once: the default action."""
        if os.getpid() != self._pid:
            _terminate()
            return
        logger.warning("kernel_ext: SIGTERM; flushing the sender (at most %g s)", self._timeout)
        helper = threading.Thread(target=self._flush, args=(self._timeout,), daemon=True)
        helper.start()
        helper.join(self._timeout + 5)
        _terminate()

    def _on_signal_in_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        """SIGTERM in an async kernel whose loop runs the sender: flush there, terminate."""
        logger.warning("kernel_ext: SIGTERM; flushing the sender (at most %g s)", self._timeout)

        async def flush_then_terminate() -> None:
            try:
                await self._aflush(self._timeout)
            finally:
                _terminate()

        task = loop.create_task(flush_then_terminate())
        _tasks.add(task)  # a task nobody references may be collected before it runs
        task.add_done_callback(_tasks.discard)


_tasks: set[asyncio.Task[None]] = set()


def _terminate() -> None:
    """Die of SIGTERM, as its default action would have made us."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)
