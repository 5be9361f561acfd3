"""``python -m kernel_ext.relay``: serve a standalone relay with uvicorn.

``python -m kernel_ext.relay --port 8765 --authenticate pkg.mod:fn --authorize-join
pkg.mod:fn`` serves :func:`~kernel_ext.relay.create_app` (secret from
``KERNEL_EXT_SECRET``; ``--redis-url``, default ``KERNEL_EXT_REDIS_URL``, for a Redis
client manager; both read through :func:`kernel_ext.settings.load_settings`). It binds
127.0.0.1 unless ``--host`` says otherwise, and it is never open by accident: without both
hooks it refuses to start unless ``--allow-anyone`` is given, and on a host other than a
loopback one even then (:func:`main`).
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
from collections.abc import Callable
from typing import Any, NoReturn

from kernel_ext.errors import ConfigError
from kernel_ext.protocol import NAMESPACE
from kernel_ext.relay._log import logger
from kernel_ext.relay.app import create_app
from kernel_ext.relay.auth import allow_all
from kernel_ext.settings import env_name, load_callable, load_settings

__all__ = ["is_loopback_host", "main"]

_SECRET = env_name("secret")
_REDIS_URL = env_name("redis_url")


def is_loopback_host(host: str) -> bool:
    """Whether ``--host`` binds to this machine only: ``localhost`` (any case) or an IP
    literal in 127.0.0.0/8 or ``::1``. Anything else — ``0.0.0.0``, ``::``, an empty host,
    another name (not resolved) — may be reachable from the network."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m kernel_ext.relay",
        description="Serve the kernel_ext /chat relay on its own (uvicorn): blocks from "
        "internal senders to the browsers in each conversation's room.",
        epilog=f"The internal senders' secret comes from {_SECRET}. Without both "
        "--authenticate and --authorize-join the relay refuses to start, unless "
        "--allow-anyone is given on a loopback --host.",
    )
    parser.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to bind; one other than localhost, 127.0.0.0/8 or ::1 needs both "
        "hooks (default: %(default)s)",
    )
    parser.add_argument("--port", type=int, default=8765, help="port (default: %(default)s)")
    parser.add_argument(
        "--redis-url",
        default=None,
        help=f"redis:// URL of a Redis client manager shared by several web processes "
        f"(default: ${_REDIS_URL} if set, else none: this process only)",
    )
    parser.add_argument(
        "--namespace", default=NAMESPACE, help="Socket.IO namespace (default: %(default)s)"
    )
    parser.add_argument(
        "--log-level",
        default="warning",
        choices=["critical", "error", "warning", "info", "debug"],
        help="log level (default: %(default)s)",
    )
    parser.add_argument(
        "--authenticate",
        metavar="MODULE:FUNCTION",
        help="browser authentication hook, authenticate(auth, environ) -> identity or None "
        "(default: none, every browser is accepted)",
    )
    parser.add_argument(
        "--authorize-join",
        metavar="MODULE:FUNCTION",
        help="room hook, authorize_join(identity, conversation_id) -> bool "
        "(default: none, every join is allowed)",
    )
    parser.add_argument(
        "--allow-anyone",
        action="store_true",
        help="start without both hooks, on a loopback --host only: every browser may then "
        "join any conversation (default: off, refuse to start)",
    )
    return parser


def _openness(authenticate: str | None, authorize_join: str | None) -> str:
    """What a relay without these hooks lets browsers do ('' when both are given)."""
    if not authenticate and not authorize_join:
        return "without hooks every browser may join any conversation"
    if not authorize_join:
        return "without --authorize-join every authenticated browser may join any conversation"
    if not authenticate:
        return (
            "without --authenticate every browser is accepted and looks the same to "
            "--authorize-join"
        )
    return ""


def _refuse(parser: argparse.ArgumentParser, message: str) -> NoReturn:
    parser.exit(2, f"{parser.prog}: error: {message}\n")


def _load_hook(parser: argparse.ArgumentParser, option: str, spec: str) -> Callable[..., Any]:
    try:
        return load_callable(spec, option)
    except ConfigError as exc:
        _refuse(parser, str(exc))
    except Exception as exc:  # the module itself failed while importing
        _refuse(parser, f"{option} {spec!r} cannot be loaded ({type(exc).__name__}: {exc})")


def main(argv: list[str] | None = None) -> int:
    """``python -m kernel_ext.relay``: serve a standalone relay with uvicorn.

    Refuses to start (a one-line error, exit status 2) without both hooks unless
    ``--allow-anyone`` is given, and without both hooks on a non-loopback ``--host``
    (:func:`is_loopback_host`) even then; a hook that cannot be loaded, a missing
    ``KERNEL_EXT_SECRET`` or a ``KERNEL_EXT_*`` variable that does not parse is refused
    the same way."""
    parser = _parser()
    args = parser.parse_args(argv)
    openness = _openness(args.authenticate, args.authorize_join)
    if openness and not is_loopback_host(args.host):
        _refuse(
            parser,
            f"--host {args.host} may be reachable from the network and {openness}: give both "
            "--authenticate and --authorize-join (--allow-anyone is for loopback hosts only)",
        )
    if openness and not args.allow_anyone:
        _refuse(
            parser,
            f"{openness}: give both --authenticate and --authorize-join (MODULE:FUNCTION), "
            "or --allow-anyone to accept that",
        )
    try:
        settings = load_settings()
    except ConfigError as exc:
        _refuse(parser, str(exc))
    secret = settings.secret_value()
    if not secret:
        _refuse(parser, f"set {_SECRET} to the internal senders' shared secret")
    authenticate = (
        _load_hook(parser, "--authenticate", args.authenticate) if args.authenticate else None
    )
    authorize_join = (
        _load_hook(parser, "--authorize-join", args.authorize_join)
        if args.authorize_join
        else allow_all
    )
    import uvicorn

    logging.basicConfig(level=args.log_level.upper())
    if openness:
        logger.warning(
            "relay started with --allow-anyone on %s:%d: %s", args.host, args.port, openness
        )
    ready = create_app(
        secret,
        redis_url=args.redis_url or settings.redis_url,
        namespace=args.namespace,
        authenticate=authenticate,
        authorize_join=authorize_join,
    )
    uvicorn.run(
        ready.app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        lifespan="off",
    )
    return 0
