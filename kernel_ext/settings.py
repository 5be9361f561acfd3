"""kernel_ext's configuration: one settings object, read from ``KERNEL_EXT_*`` variables.

:class:`Settings` is the one place where a variable is named, parsed and checked (the
variables and their defaults: docs/operations.md, "Configuration"). It is read by
:func:`kernel_ext.enable` (arguments win over it), by the ``opentelemetry_instrumentor``
entry point and by the ``kernel-ext relay`` command alike. A bad value raises
:class:`~kernel_ext.errors.ConfigError` naming the variable and the value's problem.
:func:`load_callable` is the one reader of the ``package.module:function`` specs that
configuration values (and command-line options) name code with.

Two rules hold wherever a value is taken, here and in the constructors that take it directly:

* **The internal secret** is at least :data:`MIN_SECRET_BYTES` bytes of UTF-8
  (:func:`check_secret`): ``enable()``, ``kernel-ext relay``, :class:`~kernel_ext.relay.ChatRelay`
  (``mount_relay``, ``create_app``) and :class:`~kernel_ext.emit.LoopbackEmitter` refuse a
  shorter one, saying how to make a good one (:data:`MAKE_SECRET`).
* **A Redis URL** is one redis-py parses (``redis://``, ``rediss://``, ``unix://``;
  :func:`check_redis_url`); it is shown only without its password (:func:`redacted_url`).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence
from typing import Annotated, Any
from urllib.parse import urlsplit, urlunsplit

from pydantic import Field, SecretStr, ValidationError, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from kernel_ext.errors import ConfigError
from kernel_ext.protocol import NAMESPACE

__all__ = [
    "ENV_PREFIX",
    "MAKE_SECRET",
    "MIN_SECRET_BYTES",
    "Settings",
    "check_redis_url",
    "check_secret",
    "env_name",
    "list_problems",
    "load_callable",
    "load_settings",
    "read_settings",
    "redacted_url",
]

ENV_PREFIX = "KERNEL_EXT_"

MIN_SECRET_BYTES = 16
"""The shortest internal secret accepted, in bytes of its UTF-8 encoding (the bytes the relay
compares): 16 random bytes are 128 bits."""

MAKE_SECRET = 'python -c "import secrets; print(secrets.token_urlsafe(32))"'
"""A command that prints a good secret (32 random bytes, 43 URL-safe characters)."""


def _secret_problem(secret: object) -> str | None:
    """What is wrong with ``secret`` as the internal secret (``None``: nothing)."""
    if not isinstance(secret, str):
        return f"must be a string, got {type(secret).__name__}"
    try:
        size = len(secret.encode("utf-8"))
    except UnicodeEncodeError:
        return f"must be text that encodes as UTF-8; make one with: {MAKE_SECRET}"
    if size < MIN_SECRET_BYTES:
        return (
            f"must be at least {MIN_SECRET_BYTES} bytes (UTF-8), got {size}; "
            f"make one with: {MAKE_SECRET}"
        )
    return None


def check_secret(secret: object, what: str = "secret") -> str:
    """``secret`` if it can be the internal secret: a string of at least
    :data:`MIN_SECRET_BYTES` bytes in UTF-8. Raises :class:`ConfigError` naming ``what`` and
    the rule (never the value), with the command that makes a good one."""
    problem = _secret_problem(secret)
    if problem is not None:
        raise ConfigError(f"{what} {problem}")
    assert isinstance(secret, str)
    return secret


def _redis_url_problem(url: object) -> str | None:
    """What is wrong with ``url`` as a Redis URL, by redis-py's own parser (``None``:
    nothing)."""
    if not isinstance(url, str) or not url:
        return "must be a redis://, rediss:// or unix:// URL"
    try:
        from redis.connection import parse_url
    except ImportError:
        return "needs the redis package: pip install 'kernel-ext[redis]'"
    try:
        parse_url(url)  # type: ignore[no-untyped-call, unused-ignore]
    except ValueError as exc:
        return f"is not a Redis URL ({exc})"
    return None


def check_redis_url(url: object, what: str = "url") -> str:
    """``url`` if redis-py parses it as a Redis URL (``redis://``, ``rediss://`` or
    ``unix://``; the redis package installed). Raises :class:`ConfigError` naming ``what``,
    the problem and the URL without its password."""
    problem = _redis_url_problem(url)
    if problem is not None:
        shown = redacted_url(url) if isinstance(url, str) else url
        raise ConfigError(f"{what} {problem}, got {shown!r}")
    assert isinstance(url, str)
    return url


def redacted_url(url: str) -> str:
    """``url`` with its password, if it has one, replaced by ``***`` (for logs and
    messages); a URL that does not parse is not shown at all."""
    try:
        parts = urlsplit(url)
        password = parts.password
    except ValueError:
        return "<a URL that does not parse>"
    if password is None:
        return url
    userinfo, _, hostport = parts.netloc.rpartition("@")
    user = userinfo.split(":", 1)[0]
    return urlunsplit(parts._replace(netloc=f"{user}:***@{hostport}"))


def env_name(field: str) -> str:
    """The environment variable of a settings field (``relay_url`` → ``KERNEL_EXT_RELAY_URL``)."""
    return ENV_PREFIX + field.upper()


class Settings(BaseSettings):
    """Every ``KERNEL_EXT_*`` variable kernel_ext reads (module docstring). Unknown
    ``KERNEL_EXT_*`` variables are ignored (tests and benchmarks have knobs of their own);
    empty values count as unset."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        extra="ignore",
        frozen=True,
        env_ignore_empty=True,
        case_sensitive=False,
    )

    relay_url: str | None = None
    secret: SecretStr | None = None
    redis_url: str | None = None
    redis_channel: str = Field(default="socketio", min_length=1)
    namespace: str = Field(default=NAMESPACE, pattern=r"^/")
    max_running_per_second: float = Field(default=10.0, gt=0, allow_inf_nan=False)
    max_streams: int = Field(default=10_000, ge=1)
    max_queue: int = Field(default=10_000, ge=1)
    targets: Annotated[tuple[str, ...], NoDecode] = ()
    describe: str | None = None
    # The relay's admission caps (kernel-ext relay); unset: the relay's own defaults.
    max_browsers: int | None = Field(default=None, ge=1)
    max_per_identity: int | None = Field(default=None, ge=1)
    max_browser_rooms: int | None = Field(default=None, ge=1)
    join_rate: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    stop_rate: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    # Its handshake turnstile (kernel-ext relay); unset: create_app's defaults.
    max_handshakes: int | None = Field(default=None, ge=1)
    max_handshake_waiting: int | None = Field(default=None, ge=1)

    def relay_caps(self) -> dict[str, Any]:
        """The admission caps set (by variable or argument), as the relay's options: the
        ones unset are left to :class:`~kernel_ext.relay.ChatRelay`'s defaults."""
        caps = {
            "max_browsers": self.max_browsers,
            "max_per_identity": self.max_per_identity,
            "max_browser_rooms": self.max_browser_rooms,
            "join_rate": self.join_rate,
            "stop_rate": self.stop_rate,
        }
        return {name: value for name, value in caps.items() if value is not None}

    def handshake_bounds(self) -> dict[str, Any]:
        """The handshake turnstile's bounds set (by variable or argument), as
        :func:`~kernel_ext.relay.create_app`'s options: the ones unset are left to its
        defaults."""
        bounds = {
            "max_handshakes": self.max_handshakes,
            "max_handshake_waiting": self.max_handshake_waiting,
        }
        return {name: value for name, value in bounds.items() if value is not None}

    @field_validator("targets", mode="before")
    @classmethod
    def _comma_separated(cls, value: Any) -> Any:
        if isinstance(value, str):
            return tuple(part.strip() for part in value.split(",") if part.strip())
        return value

    @field_validator("relay_url", "redis_url", "describe", mode="after")
    @classmethod
    def _stripped(cls, value: str | None) -> str | None:
        return value.strip() or None if value is not None else None

    @field_validator("redis_url", mode="after")
    @classmethod
    def _a_redis_url(cls, value: str | None) -> str | None:
        problem = _redis_url_problem(value) if value is not None else None
        if problem is not None:
            raise ValueError(problem)
        return value

    @field_validator("secret", mode="after")
    @classmethod
    def _long_enough(cls, value: SecretStr | None) -> SecretStr | None:
        problem = _secret_problem(value.get_secret_value()) if value is not None else None
        if problem is not None:
            raise ValueError(problem)
        return value

    def secret_value(self) -> str | None:
        """The secret as a string (``None`` when unset)."""
        return self.secret.get_secret_value() if self.secret is not None else None

    def describe_hook(self) -> Callable[..., Any] | None:
        """The describe hook ``describe`` names, loaded (``None`` when unset). Raises
        :class:`ConfigError` naming ``KERNEL_EXT_DESCRIBE`` when it cannot be loaded."""
        if self.describe is None:
            return None
        return load_callable(self.describe, env_name("describe"))


def load_callable(spec: str, what: str) -> Callable[..., Any]:
    """The callable a ``package.module:function`` spec names (``function`` may be a dotted
    path, ``Class.method``), imported now.

    Raises :class:`ConfigError` naming ``what`` (the variable or option) and ``spec`` when
    the spec is not of that form, its module does not import (``ImportError``), a name is
    missing, or the object is not callable. Other exceptions raised while the module
    imports propagate unchanged.
    """
    if spec.count(":") != 1:
        raise ConfigError(f"{what} must look like 'package.module:function', got {spec!r}")
    module_name, path = spec.split(":")
    try:
        found: Any = importlib.import_module(module_name)
        for part in path.split("."):
            found = getattr(found, part)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(
            f"{what} {spec!r} cannot be loaded ({type(exc).__name__}: {exc})"
        ) from exc
    if not callable(found):
        raise ConfigError(f"{what} {spec!r} is a {type(found).__name__}, not callable")
    return found  # type: ignore[no-any-return]


_NOT_SHOWN = frozenset({"secret"})
_URLS = frozenset({"relay_url", "redis_url"})


def _problem(error: Mapping[str, Any]) -> str:
    """One pydantic error as a problem: our own rule's message as it is, pydantic's own."""
    cause = (error.get("ctx") or {}).get("error")
    message = str(cause) if error.get("type") == "value_error" and cause else error["msg"]
    field = str(error["loc"][0]) if error["loc"] else "?"
    if field in _NOT_SHOWN:
        return str(message)
    given = error.get("input")
    if field in _URLS and isinstance(given, str):
        given = redacted_url(given)
    return f"{message} (got {given!r})"


def read_settings(
    labels: Mapping[str, str] | None = None, **overrides: Any
) -> tuple[Settings, dict[str, str]]:
    """The settings from the environment, with ``overrides`` (arguments; ``None`` values are
    ignored) winning, and every problem found, by field (its first one): a message naming
    the argument (by its name in ``labels``, else its own) or the variable and the field it
    sets, and the value (a URL without its password; never the secret). A field with a
    problem is at its default in the settings returned."""
    given = {name: value for name, value in overrides.items() if value is not None}
    try:
        return Settings(**given), {}
    except ValidationError as error:
        problems: dict[str, str] = {}
        for each in error.errors(include_url=False):
            field = str(each["loc"][0]) if each["loc"] else "?"
            if field in given:
                where = (labels or {}).get(field, field)
            else:
                where = f"{env_name(field)} ({field})"
            problems.setdefault(field, f"{where}: {_problem(each)}")  # the first one a field
    fields = Settings.model_fields
    defaults = {
        name: fields[name].get_default(call_default_factory=True)
        for name in problems
        if name in fields
    }
    kept = {name: value for name, value in given.items() if name not in problems}
    return Settings(**kept, **defaults), problems


def list_problems(problems: Sequence[str]) -> str:
    """Problems as one line: a single one as it is, several as ``N problems: (1) …; (2) …``."""
    if len(problems) == 1:
        return problems[0]
    numbered = "; ".join(f"({number}) {problem}" for number, problem in enumerate(problems, 1))
    return f"{len(problems)} problems: {numbered}"


def load_settings(**overrides: Any) -> Settings:
    """The settings from the environment, with ``overrides`` (arguments; ``None`` values are
    ignored) winning. Raises :class:`ConfigError` listing every bad value
    (:func:`list_problems`), each naming the argument (a bad override) or the variable and
    the field it sets (a bad variable) — :func:`read_settings`."""
    settings, problems = read_settings(**overrides)
    if problems:
        raise ConfigError(list_problems(list(problems.values())))
    return settings
