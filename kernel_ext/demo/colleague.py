"""One of the demo's A2A colleagues: the scripted a2a-sdk peer (:mod:`kernel_ext.a2a_peer`)
under its own name, quiet, on 127.0.0.1 unless ``--host`` says otherwise.

The worker picks the peer's script per request (``kx.script``): ``work`` for the orders
desk (envelopes: thinking, its own tool calls, text), ``text`` for the third-party carrier
(plain text only). ``--delay`` is the pause between steps, so streaming is visibly live.

``python -m kernel_ext.demo.colleague --port 8801 --name "Orders desk" --delay 0.4``
"""

from __future__ import annotations

import argparse
import asyncio
import logging

from kernel_ext.a2a_peer import ScriptedPeer

__all__ = ["main", "serve"]


async def serve(host: str, port: int, name: str, delay: float, log_level: str) -> None:
    """Serve one scripted colleague until uvicorn is told to stop (SIGINT/SIGTERM); every
    execution still running is ended on the way out."""
    import uvicorn

    peer = ScriptedPeer(f"http://{host}:{port}/", delay=delay, name=name)
    config = uvicorn.Config(
        peer.app,
        host=host,
        port=port,
        log_level=log_level,
        access_log=False,
        lifespan="off",
        timeout_graceful_shutdown=3,
    )
    try:
        await uvicorn.Server(config).serve()
    finally:
        await peer.aclose()


def main(argv: list[str] | None = None) -> int:
    """``python -m kernel_ext.demo.colleague --port P [--name N] [--delay S]``."""
    parser = argparse.ArgumentParser(prog="python -m kernel_ext.demo.colleague")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--name", default="Scripted colleague")
    parser.add_argument("--delay", type=float, default=0.4, help="seconds between steps")
    parser.add_argument("--log-level", default="warning")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="colleague %(levelname)s %(message)s")
    asyncio.run(serve(args.host, args.port, args.name, args.delay, args.log_level))
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
