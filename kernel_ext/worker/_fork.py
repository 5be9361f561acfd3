"""What a fork leaves behind, made whole again in the child.

A process forked after :func:`kernel_ext.enable` (gunicorn ``--preload``, Celery's prefork
pool, ``multiprocessing`` with the ``fork`` start method, a bare :func:`os.fork`) inherits a
copy of the parent's memory but only the thread that forked: the sender's loop thread is
gone, its sockets are the parent's, and a lock some other thread held stays held forever.
The OpenTelemetry SDK's ``BatchSpanProcessor`` is the model: one
:func:`os.register_at_fork` hook re-creates in the child what the fork left dead.

Guarantees, in a child forked by :func:`os.fork` (spawned and forkserver children import
everything afresh and need none of this):

* every object's reset given to :func:`reset_in_child` is called (fresh locks, state
  emptied of the parent's work), in the order they were registered;
* then every function given to :func:`call_in_child` runs, in the order registered (the
  plugin builds the child's own sender here, on state already reset);
* a hook that raises is logged and the others still run: a fork never fails because of us.

Objects are held weakly: registering one does not keep it alive.
"""

from __future__ import annotations

import itertools
import logging
import os
import weakref
from collections.abc import Callable
from typing import Any

__all__ = ["call_in_child", "reset_in_child"]

logger = logging.getLogger("kernel_ext")


_objects: weakref.WeakValueDictionary[int, object] = weakref.WeakValueDictionary()
_resets: dict[int, Callable[[Any], None]] = {}  # by the key of the object in _objects
_ids = itertools.count()
_functions: list[Callable[[], None]] = []


def reset_in_child(reset: Callable[[], None]) -> None:
    """Call ``reset()``, a bound method (an object's own reset), in every child forked from
    now on. Its object is held weakly: forgotten when nothing else holds it."""
    method: Any = reset
    key = next(_ids)
    _objects[key] = method.__self__
    _resets[key] = method.__func__
    if len(_resets) > 2 * len(_objects) + 64:  # forget the resets of objects gone
        for gone in _resets.keys() - _objects.keys():
            del _resets[gone]


def call_in_child(function: Callable[[], None]) -> None:
    """Call ``function()`` in every child forked from now on, after the objects' resets."""
    if function not in _functions:
        _functions.append(function)


def _after_fork_in_child() -> None:
    for key, obj in list(_objects.items()):  # insertion order: registration order
        try:
            _resets[key](obj)
        except Exception:
            logger.exception("kernel_ext: resetting %r after a fork failed", obj)
    for function in list(_functions):
        try:
            function()
        except Exception:
            logger.exception("kernel_ext: %r after a fork failed", function)


if hasattr(os, "register_at_fork"):  # not on Windows
    os.register_at_fork(after_in_child=_after_fork_in_child)
