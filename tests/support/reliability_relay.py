"""A relay web process for the reliability suite (run as a script, never imported by tests).

``kernel_ext.relay.create_app`` as ``python -m kernel_ext.relay`` serves it, plus:

* short Engine.IO pings (``--ping-interval``/``--ping-timeout``), so a frozen process is
  noticed by its clients in about a second instead of 45;
* ``GET /stats``: the relay's counters and the sizes of everything it keeps (held
  terminals, remembered terminals, per-connection frame queues, rooms, workers with open
  streams), of what the server's client manager and Engine.IO server hold (namespace and
  room entries, pending connections, environs, sockets) and the process's resident memory,
  so a test can check that nothing grows;
* ``--worker-grace``: the relay's (and its Redis manager's) grace period for gone workers.

Usage: ``KERNEL_EXT_SECRET=… python tests/support/reliability_relay.py --port P [--redis-url U]``.
"""

from __future__ import annotations

import argparse
import logging
import os
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from kernel_ext.relay import ChatRelay, allow_all, create_app


def rss_kb() -> int | None:
    """The process's resident memory now, KiB (Linux; ``None`` elsewhere)."""
    try:
        with open("/proc/self/statm", encoding="ascii") as statm:
            pages = int(statm.read().split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return pages * os.sysconf("SC_PAGE_SIZE") // 1024


def sizes(relay: ChatRelay, sio: Any) -> dict[str, Any]:
    """What the relay and its server hold right now."""
    manager = sio.manager
    rooms = manager.rooms.get(relay.namespace, {})
    return {
        "counts": relay.stats(),
        "held_terminals": relay.terminals.held,
        "remembered_terminals": relay.terminals.remembered,
        "queued_frames": sum(conn.queue.qsize() for conn in relay._internal.values()),
        "rooms": len(rooms),
        "namespace_entries": sum(len(ns.get(None, ())) for ns in manager.rooms.values()),
        "room_entries": sum(len(room) for ns in manager.rooms.values() for room in ns.values()),
        "pending_connects": sum(len(sids) for sids in manager.pending_connect.values()),
        "pending_disconnects": sum(len(sids) for sids in manager.pending_disconnect.values()),
        "callbacks": len(manager.callbacks),
        "environs": len(sio.environ),
        "eio_sockets": len(sio.eio.sockets),
        "rss_kb": rss_kb(),
        "pid": os.getpid(),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--redis-url", default=None)
    parser.add_argument("--ping-interval", type=int, default=1)
    parser.add_argument("--ping-timeout", type=float, default=0.5)
    parser.add_argument("--worker-grace", type=float, default=None)
    args = parser.parse_args()
    options: dict[str, Any] = {}
    if args.worker_grace is not None:
        options["worker_grace"] = args.worker_grace
    holder: dict[str, Any] = {}

    async def stats(request: Request) -> JSONResponse:
        return JSONResponse(sizes(holder["relay"], holder["sio"]))

    ready = create_app(
        os.environ["KERNEL_EXT_SECRET"],
        redis_url=args.redis_url,
        authorize_join=allow_all,
        other_asgi_app=Starlette(routes=[Route("/stats", stats)]),
        **options,
    )
    holder.update(relay=ready.relay, sio=ready.sio)
    ready.sio.eio.ping_interval = args.ping_interval
    ready.sio.eio.ping_timeout = args.ping_timeout
    logging.basicConfig(level=logging.WARNING, format="relay %(levelname)s %(name)s %(message)s")
    import uvicorn

    uvicorn.run(ready.app, host="127.0.0.1", port=args.port, log_level="warning", lifespan="off")


if __name__ == "__main__":
    main()
