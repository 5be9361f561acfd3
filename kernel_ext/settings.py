"""kernel_ext's configuration: one settings object, read from ``KERNEL_EXT_*`` variables.

:class:`Settings` is the one place where a variable is named, parsed and checked. It is read
by :func:`kernel_ext.enable` (arguments win over it), by the ``opentelemetry_instrumentor``
entry point and by the ``kernel-ext relay`` command alike. A bad value raises
:class:`~kernel_ext.errors.ConfigError` naming the variable and the value's problem.
:func:`load_callable` is the one reader of the ``package.module:function`` specs that
configuration values (and command-line options) name code with.

==================================  ==========================================================
``KERNEL_EXT_RELAY_URL``            the web process's base URL (``http://127.0.0.1:8000``)
``KERNEL_EXT_SECRET``               the relay's internal shared secret (with the relay URL)
``KERNEL_EXT_REDIS_URL``            ``redis://…``: emit through Redis instead (no relay URL)
``KERNEL_EXT_REDIS_CHANNEL``        the Socket.IO Redis channel (default ``socketio``)
``KERNEL_EXT_NAMESPACE``            the Socket.IO namespace (default ``/chat``)
``KERNEL_EXT_MAX_RUNNING_PER_SECOND``  running blocks per stream per second (default 10)
``KERNEL_EXT_MAX_STREAMS``          open streams kept (default 10000)
``KERNEL_EXT_MAX_QUEUE``            running blocks queued for the sender (default 10000)
``KERNEL_EXT_TARGETS``              comma-separated tool runtime targets to instrument
``KERNEL_EXT_DESCRIBE``             ``package.module:function``, the targets' describe hook
==================================  ==========================================================
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Annotated, Any

from pydantic import Field, SecretStr, ValidationError, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from kernel_ext.errors import ConfigError
from kernel_ext.protocol import NAMESPACE

__all__ = ["ENV_PREFIX", "Settings", "env_name", "load_callable", "load_settings"]

ENV_PREFIX = "KERNEL_EXT_"


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


def load_settings(**overrides: Any) -> Settings:
    """The settings from the environment, with ``overrides`` (arguments; ``None`` values are
    ignored) winning. Raises :class:`ConfigError` for a bad value, naming the argument (a
    bad override) or the variable and the field it sets (a bad variable)."""
    given = {name: value for name, value in overrides.items() if value is not None}
    try:
        return Settings(**given)
    except ValidationError as error:
        first = error.errors(include_url=False)[0]
        field = str(first["loc"][0]) if first["loc"] else "?"
        where = field if field in given else f"{env_name(field)} ({field})"
        raise ConfigError(f"{where}: {first['msg']} (got {first.get('input')!r})") from None
