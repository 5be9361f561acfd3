"""``kernel-ext relay`` (also ``python -m kernel_ext.relay``): serve a standalone relay.

One command, two spellings: :func:`add_arguments` and :func:`run` make the ``relay``
subcommand of ``kernel-ext`` (:mod:`kernel_ext.cli.entry`), and :func:`main` is the same command
on its own for ``python -m kernel_ext.relay``. It serves :func:`~kernel_ext.relay.create_app`
with uvicorn; the secret, the Redis URL and channel and the namespace come from
:func:`kernel_ext.settings.load_settings` (options win).

* It binds 127.0.0.1 unless ``--host`` says otherwise, and it is never open by accident:
  without both hooks it refuses to start unless ``--allow-anyone`` is given, and on a host
  other than a loopback one even then (:func:`is_loopback_host`).
* It checks everything before it starts and refuses with one line on stderr and exit status
  2 naming every unmet requirement at once (``N problems: (1) …; (2) …`` when there are
  several): no ``KERNEL_EXT_SECRET``, one shorter than 16 bytes (with how to make one), a
  Redis URL redis-py cannot parse, any other ``KERNEL_EXT_*`` value that does not parse,
  missing hooks, a non-loopback host without them, an ``--app-dir`` that is not a
  directory, a hook that does not load, a host or port it cannot listen on. A command line
  argparse cannot parse (an unknown option, a port that is not a number) is refused first,
  alone, the same way.
* Hooks are imported from its app directory first, then from the installed packages: the
  working directory, or ``--app-dir``, is put first on ``sys.path``, as uvicorn does.
* A Redis that does not answer does not stop it: it starts, says so at WARNING with the
  retry schedule, is not ready (``/readyz`` 503) and keeps trying until Redis answers.
* It answers ``/healthz`` and ``/readyz`` (:mod:`kernel_ext.relay.health`) and serves the
  shipped browser files under ``/kernel_ext/`` (``--no-page``: none), so
  ``<url>/kernel_ext/example.html?conversation=ID`` follows a conversation in a browser.
* Once listening (after its first attempt to reach Redis, if it has one) it prints one
  start-up line on stderr: URL, namespace, auth mode, Redis (``connected``,
  ``unreachable…`` or ``connecting…``), the example page's URL and how to get its labels in
  English. Everything else it writes there is a log record of ``--log-level`` or above (its
  own, uvicorn's, the libraries'), each as ``<prog>: <level>: <message>`` (a traceback on the
  lines after).
* It owns its process, so once serving it tunes CPython's garbage collector
  (:func:`tune_gc`, ``--gc-threshold``): what start-up made is frozen, and full collections
  come after ``--gc-threshold`` collections of the middle generation instead of 10, so that
  thousands of connections held open do not stall the event loop for each full collection.
  ``--gc-threshold 0`` leaves the collector as CPython sets it.
* SIGINT, SIGTERM and SIGHUP stop it gracefully, in one line, with exit status 130, 143 or
  129 (:class:`kernel_ext.cli._common.StopSignals`); one at start-up too.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import ipaddress
import socket
import sys
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import Any, cast

from kernel_ext.cli._common import (
    EXIT_OK,
    CommandLineError,
    Parser,
    StopSignals,
    listen,
    on_stop_signal,
    port_or_zero,
    run_command,
    url_host,
    usage_error,
    use_app_dir,
)
from kernel_ext.errors import ConfigError
from kernel_ext.protocol import NAMESPACE
from kernel_ext.relay._log import log_as_command, logger
from kernel_ext.relay.limits import (
    DEFAULT_JOIN_RATE,
    DEFAULT_MAX_BROWSER_ROOMS,
    DEFAULT_MAX_BROWSERS,
    DEFAULT_MAX_PER_IDENTITY,
    DEFAULT_STOP_RATE,
)
from kernel_ext.relay.replay import DEFAULT_CONVERSATION_BYTES, DEFAULT_TOTAL_BYTES
from kernel_ext.relay.turnstile import DEFAULT_MAX_HANDSHAKE_WAITING, DEFAULT_MAX_HANDSHAKES
from kernel_ext.settings import (
    MAKE_SECRET,
    MIN_SECRET_BYTES,
    Settings,
    env_name,
    list_problems,
    load_callable,
    read_settings,
    redacted_url,
)

__all__ = [
    "DEFAULT_GC_THRESHOLD",
    "DESCRIPTION",
    "add_arguments",
    "is_loopback_host",
    "main",
    "run",
    "serve",
    "tune_gc",
]

_SECRET = env_name("secret")
_REDIS_URL = env_name("redis_url")
_REDIS_CHANNEL = env_name("redis_channel")
_NAMESPACE = env_name("namespace")
_DEFAULT_PORT = 8765
PAGE_PREFIX = "/kernel_ext"
"""Where the relay serves the shipped browser files (:func:`kernel_ext.web.static_files`)."""
PAGE = "example.html"
PAGE_LANG = "(English labels: &lang=en)"
"""How the start-up line says to get the example page in English (Chinese by default)."""
DEFAULT_GC_THRESHOLD = 1000
"""``--gc-threshold``: CPython's generation-2 threshold in the relay's process (CPython's is
10); docs/operations.md, "Abuse", has the measurements behind it."""
_REDIS_CHANNEL_DEFAULT = Settings.model_fields["redis_channel"].default
# The options that override settings fields, as a refusal names them.
_OPTIONS = {
    "redis_url": "--redis-url",
    "redis_channel": "--redis-channel",
    "namespace": "--namespace",
    "max_browsers": "--max-browsers",
    "max_per_identity": "--max-per-identity",
    "max_browser_rooms": "--max-browser-rooms",
    "join_rate": "--join-rate",
    "stop_rate": "--stop-rate",
    "max_handshakes": "--max-handshakes",
    "max_handshake_waiting": "--handshake-queue",
}
# The admission caps' options: (settings field, metavar, what, default).
_CAPS = (
    ("max_browsers", "N", "browsers on this process", DEFAULT_MAX_BROWSERS),
    ("max_per_identity", "N", "browsers of one identity", DEFAULT_MAX_PER_IDENTITY),
    ("max_browser_rooms", "N", "conversations per browser", DEFAULT_MAX_BROWSER_ROOMS),
    ("join_rate", "RATE", "joins per second per browser", f"{DEFAULT_JOIN_RATE:g}"),
    ("stop_rate", "RATE", "stop requests per second per browser", f"{DEFAULT_STOP_RATE:g}"),
    ("max_handshakes", "N", "handshakes at once", DEFAULT_MAX_HANDSHAKES),
    ("max_handshake_waiting", "N", "handshakes waiting, then 503", DEFAULT_MAX_HANDSHAKE_WAITING),
)

DESCRIPTION = (
    "Serve the kernel_ext /chat relay on its own (uvicorn): blocks from internal senders "
    "to the browsers in each conversation's room."
)
_EPILOG = (
    f"The internal senders' secret comes from {_SECRET} (at least {MIN_SECRET_BYTES} bytes; "
    f"make one with: {MAKE_SECRET}). Without both --authenticate and "
    "--authorize-join the relay refuses to start, unless --allow-anyone is given on a "
    "loopback --host. The caps hold per web process, each by default its KERNEL_EXT_ "
    "variable if set. It answers GET /healthz and GET /readyz. Ctrl-C or SIGTERM: exit "
    "130 or 143."
)


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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the relay's options to ``parser`` (``kernel-ext relay`` or the module's own)."""
    parser.description = DESCRIPTION
    parser.epilog = _EPILOG
    parser.usage = "%(prog)s [options]"
    parser.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to bind; one other than localhost, 127.0.0.0/8 or ::1 needs both "
        "hooks (default: %(default)s)",
    )
    parser.add_argument(
        "--port",
        type=port_or_zero,
        default=_DEFAULT_PORT,
        help="port; 0 picks a free one, shown in the start-up line (default: %(default)s)",
    )
    parser.add_argument(
        "--redis-url",
        default=None,
        metavar="URL",
        help=f"Redis shared by several web processes (default: ${_REDIS_URL} if set, else none)",
    )
    parser.add_argument(
        "--redis-channel",
        default=None,
        metavar="NAME",
        help=f"python-socketio's Redis channel (default: {_REDIS_CHANNEL_DEFAULT}, or "
        f"${_REDIS_CHANNEL} if set)",
    )
    parser.add_argument(
        "--namespace",
        default=None,
        metavar="NS",
        help=f"Socket.IO namespace (default: {NAMESPACE}, or ${_NAMESPACE} if set)",
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
        help="authenticate(auth, environ) -> identity or None (default: none, every browser "
        "is accepted)",
    )
    parser.add_argument(
        "--authorize-join",
        metavar="MODULE:FUNCTION",
        help="room hook, authorize_join(identity, conversation_id) -> bool "
        "(default: none, every join is allowed)",
    )
    parser.add_argument(
        "--app-dir",
        default=".",
        metavar="DIR",
        help="import the hooks from DIR first (default: working dir)",
    )
    parser.add_argument(
        "--allow-anyone",
        action="store_true",
        help="start without both hooks (loopback --host only): any browser may join any "
        "conversation (default: off)",
    )
    parser.add_argument(
        "--no-catch-up",
        action="store_true",
        help="keep nothing for late joiners (default: catch them up)",
    )
    parser.add_argument(
        "--catch-up-memory",
        type=_catch_up_mib,
        default=_CATCH_UP_MIB,
        metavar="MIB",
        help=f"MiB held for catch-up, at least {_CONVERSATION_MIB} (default: %(default)s)",
    )
    for field, metavar, what, default in _CAPS:
        parser.add_argument(
            _OPTIONS[field],
            dest=field,
            default=None,
            metavar=metavar,
            help=f"{what} (default: {default})",
        )
    parser.add_argument(
        "--gc-threshold",
        type=_gc_threshold,
        default=DEFAULT_GC_THRESHOLD,
        metavar="N",
        help="GC gen-2 threshold, heap frozen; 0: as is (default: %(default)s)",
    )
    parser.add_argument(
        "--no-page",
        action="store_true",
        help=f"do not serve the example page and its files under {PAGE_PREFIX}/ (default: "
        "serve them)",
    )


_CATCH_UP_MIB = DEFAULT_TOTAL_BYTES >> 20
_CONVERSATION_MIB = DEFAULT_CONVERSATION_BYTES >> 20


def _catch_up_mib(value: str) -> int:
    """``--catch-up-memory``: whole MiB, at least one conversation's bound."""
    rule = f"must be a whole number of MiB, at least {_CONVERSATION_MIB}"
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{rule}, got {value!r}") from None
    if number < _CONVERSATION_MIB:
        raise argparse.ArgumentTypeError(f"{rule}, got {value!r}")
    return number


def _gc_threshold(value: str) -> int:
    """``--gc-threshold``: a whole number, 0 (CPython's collector as is) or more."""
    rule = "must be a whole number, 0 (CPython's garbage collector as is) or more"
    try:
        number = int(value, 10)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{rule}, got {value!r}") from None
    if number < 0:
        raise argparse.ArgumentTypeError(f"{rule}, got {value!r}")
    return number


def tune_gc(threshold: int) -> None:
    """Tune CPython's garbage collector for a relay that owns its process, once it serves.

    With ``threshold`` over 0: collect, freeze what is left (the modules, the app: never
    traversed again) and make ``threshold`` the generation-2 threshold, so that a full
    collection comes after that many collections of generation 1 (CPython: 10) — rarer full
    collections, cyclic garbage that survives two generations kept longer. With 0 the
    collector is left as it is. Either way it logs, at INFO, what the process now has:
    ``garbage collector: N objects frozen, thresholds A/B/C``. The library's
    :func:`~kernel_ext.relay.create_app` never touches the process-wide collector."""
    if threshold:
        gc.collect()
        gc.freeze()
        young, middle, _ = gc.get_threshold()
        gc.set_threshold(young, middle, threshold)
    logger.info(
        "garbage collector: %d objects frozen, thresholds %s",
        gc.get_freeze_count(),
        "/".join(str(value) for value in gc.get_threshold()),
    )


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


def _load_hook(option: str, spec: str, app_dir: str | None) -> Callable[..., Any] | str:
    """The hook ``spec`` names, or the problem (a string) when it cannot be loaded; a module
    not found names the app directory it was looked for in."""
    try:
        return load_callable(spec, option)
    except ConfigError as exc:
        if app_dir is not None and isinstance(exc.__cause__, ModuleNotFoundError):
            return f"{exc}; the app directory (--app-dir) is {app_dir}"
        return str(exc)
    except Exception as exc:  # the module itself failed while importing
        return f"{option} {spec!r} cannot be loaded ({type(exc).__name__}: {exc})"


def _auth_mode(args: argparse.Namespace) -> str:
    hooks = [spec for spec in (args.authenticate, args.authorize_join) if spec]
    openness = _openness(args.authenticate, args.authorize_join)
    named = f"{'hooks' if len(hooks) > 1 else 'hook'} {' and '.join(hooks)}" if hooks else ""
    return "; ".join(part for part in (named, f"open: {openness}" if openness else "") if part)


_REDIS_STATE = {
    "connected": "connected",
    "unreachable": "unreachable: retrying, not ready until it answers",
}


def _startup_line(
    prog: str,
    args: argparse.Namespace,
    url: str,
    namespace: str,
    redis: str | None,
    channel: str,
    redis_state: str | None,
) -> str:
    where = "no Redis (this process only)"
    if redis:
        state = _REDIS_STATE.get(redis_state or "", "connecting: not ready until it answers")
        where = f"Redis {redacted_url(redis)} ({state}), channel {channel}"
    page = "" if args.no_page else f", page {url}{PAGE_PREFIX}/{PAGE}?conversation=ID {PAGE_LANG}"
    return f"{prog}: serving {url}, namespace {namespace}, auth: {_auth_mode(args)}, {where}{page}"


def serve(
    app: Any,
    sock: socket.socket,
    log_level: str,
    announce: Callable[[], Awaitable[None]],
    gc_threshold: int = DEFAULT_GC_THRESHOLD,
) -> int:
    """Serve ``app`` on the listening ``sock`` until a stop signal, as ``kernel-ext relay``
    does: uvicorn with lifespan events, its records through the logging already set up;
    once it serves, :func:`tune_gc` with ``gc_threshold``, then ``announce`` (awaited on the
    event loop). The exit code."""
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server, but a stop signal is the command's (it asks uvicorn for its
        graceful shutdown and is never raised again after it), and the start-up line is
        printed once it serves (after :func:`tune_gc`) — unless a stop signal comes first,
        even while the line waits for the first attempt to reach Redis."""

        announcing: asyncio.Future[None] | None = None

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            with on_stop_signal(self.stop):
                yield

        def stop(self, signum: int) -> None:
            self.handle_exit(signum, None)
            if self.announcing is not None:
                self.announcing.cancel()

        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            await super().startup(sockets=sockets)
            if self.started and not self.should_exit:
                tune_gc(gc_threshold)
                self.announcing = asyncio.ensure_future(announce())
                await asyncio.wait({self.announcing})  # cancelled by a stop: no line
                if not self.announcing.cancelled():
                    self.announcing.result()

    # Lifespan events on: the app starts its Redis listener at start-up (relay.health).
    # log_config=None: uvicorn's records go to the handler run() set up, in its format.
    Server(uvicorn.Config(app, log_level=log_level, log_config=None, lifespan="on")).run(
        sockets=[sock]
    )
    return EXIT_OK


def _problems(
    args: argparse.Namespace,
) -> tuple[Settings, list[str], dict[str, Callable[..., Any]], socket.socket | None]:
    """Every requirement ``args`` and the environment do not meet (in the order a reader
    checks them: settings, secret, hooks, host and port), with what was found meanwhile:
    the settings, the loaded hooks and the listening socket. The app directory is put on
    the import path before the hooks are loaded."""
    settings, bad = read_settings(
        labels=_OPTIONS,
        redis_url=args.redis_url,
        redis_channel=args.redis_channel,
        namespace=args.namespace,
        **{field: getattr(args, field) for field, *_ in _CAPS},
    )
    problems = list(bad.values())
    if "secret" not in bad and not settings.secret_value():
        problems.append(
            f"set {_SECRET} to the internal senders' shared secret (at least "
            f"{MIN_SECRET_BYTES} bytes; make one with: {MAKE_SECRET})"
        )
    openness = _openness(args.authenticate, args.authorize_join)
    if openness and not is_loopback_host(args.host):
        problems.append(
            f"--host {args.host} may be reachable from the network and {openness}: give both "
            "--authenticate and --authorize-join (--allow-anyone is for loopback hosts only)"
        )
    elif openness and not args.allow_anyone:
        problems.append(
            f"{openness}: give both --authenticate and --authorize-join (MODULE:FUNCTION), "
            "or --allow-anyone to accept that"
        )
    hooks: dict[str, Callable[..., Any]] = {}
    app_dir = None
    try:
        app_dir = use_app_dir(args.app_dir)
    except CommandLineError as exc:
        problems.append(str(exc))
    for option, spec in (
        ("--authenticate", args.authenticate),
        ("--authorize-join", args.authorize_join),
    ):
        if spec:
            hook = _load_hook(option, spec, app_dir)
            if isinstance(hook, str):
                problems.append(hook)
            else:
                hooks[option] = hook
    sock = None
    try:
        sock = listen(args.host, args.port)
    except CommandLineError as exc:
        problems.append(str(exc))
    return settings, problems, hooks, sock


def run(args: argparse.Namespace, prog: str | None = None) -> int:
    """Run the relay with parsed ``args``; returns the exit code (module docstring).

    Refuses to start (one line on stderr naming every unmet requirement, exit status 2,
    through :class:`SystemExit`) without both hooks unless ``--allow-anyone`` is given, and
    without both hooks on a non-loopback ``--host`` (:func:`is_loopback_host`) even then;
    without a ``KERNEL_EXT_SECRET`` of at least 16 bytes; with a Redis URL that does not
    parse, a ``KERNEL_EXT_*`` variable that does not parse, an ``--app-dir`` that is not a
    directory, a hook that cannot be loaded, a host or port it cannot listen on."""
    prog = prog or getattr(args, "prog", None) or "kernel-ext relay"
    settings, problems, hooks, sock = _problems(args)
    if problems or sock is None:
        if sock is not None:
            sock.close()
        usage_error(prog, list_problems(problems))
    secret = settings.secret_value()
    assert secret is not None
    openness = _openness(args.authenticate, args.authorize_join)
    from kernel_ext.redis.manager import RelayRedisManager  # typing the manager only
    from kernel_ext.relay.app import create_app  # Socket.IO: loaded when it serves
    from kernel_ext.relay.auth import allow_all

    with sock:
        port = sock.getsockname()[1]
        url = f"http://{url_host(args.host or '0.0.0.0')}:{port}"
        log_as_command(prog, args.log_level)
        if openness:
            logger.warning(
                "relay started with --allow-anyone on %s:%d: %s", args.host, port, openness
            )
        ready = create_app(
            secret,
            redis_url=settings.redis_url,
            redis_channel=settings.redis_channel,
            namespace=settings.namespace,
            authenticate=hooks.get("--authenticate"),
            authorize_join=hooks.get("--authorize-join", allow_all),
            assets_prefix=None if args.no_page else PAGE_PREFIX,
            catch_up=not args.no_catch_up,
            replay_total_bytes=args.catch_up_memory << 20,
            **settings.relay_caps(),
            **settings.handshake_bounds(),
        )
        manager = ready.sio.manager

        async def announce() -> None:
            state = None
            if settings.redis_url is not None:
                # Started by the app at start-up; the line says how its first attempt went.
                redis_manager = cast(RelayRedisManager, manager)
                state = await redis_manager.tried(redis_manager.connect_timeout + 1.0)
            line = _startup_line(
                prog,
                args,
                url,
                settings.namespace,
                settings.redis_url,
                settings.redis_channel,
                state,
            )
            sys.stderr.write(line + "\n")
            sys.stderr.flush()

        return serve(ready.app, sock, args.log_level, announce, args.gc_threshold)


def main(argv: Sequence[str] | None = None, prog: str = "python -m kernel_ext.relay") -> int:
    """``python -m kernel_ext.relay``: the same command as ``kernel-ext relay``."""

    def command(stop: StopSignals) -> int:
        parser = Parser(prog=prog)
        add_arguments(parser)
        return run(parser.parse_args(argv), prog)

    return run_command(prog, command)
