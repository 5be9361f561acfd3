"""The ``opentelemetry_instrumentor`` entry point ``kernel_ext``: ``opentelemetry-instrument``
enables the whole worker side from the environment.

OpenTelemetry's auto-instrumentation loads each ``opentelemetry_instrumentor`` entry point
and calls ``instrument()`` on an instance of it with no options (``skip_dep_check=True``
only). For ``kernel_ext`` that is :class:`AutoInstrumentor`, whose ``instrument()``

* with ``KERNEL_EXT_TARGETS`` set, calls :func:`kernel_ext.enable` — which reads every
  other ``KERNEL_EXT_*`` variable (:mod:`kernel_ext.settings`), wraps the targets with
  :class:`~kernel_ext.instrument.ToolRuntimeInstrumentor` (describe hook from
  ``KERNEL_EXT_DESCRIBE``) and wires the stream hub, the span processor and the sender;
* without it, does nothing (a debug log line): installing kernel_ext does not change a
  process that did not ask for it.

A bad value raises :class:`~kernel_ext.errors.ConfigError` from ``instrument()`` (which
auto-instrumentation logs), with nothing changed. ``uninstrument()`` disables what its
``instrument()`` enabled (not a plugin enabled elsewhere). Calling
``AutoInstrumentor().instrument()`` yourself does exactly what ``opentelemetry-instrument``
does; ``tracer_provider=`` may be given, and is handed to :func:`~kernel_ext.enable`.
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from typing import Any

from opentelemetry.instrumentation.instrumentor import (  # type: ignore[attr-defined, unused-ignore]
    BaseInstrumentor,
)

from kernel_ext.settings import env_name, load_settings
from kernel_ext.worker.wiring import Enabled, disable, enable, enabled

__all__ = ["AutoInstrumentor"]

logger = logging.getLogger(__name__)


class AutoInstrumentor(BaseInstrumentor):  # type: ignore[misc, unused-ignore]
    """What ``opentelemetry-instrument`` runs for kernel_ext (module docstring). Like every
    OpenTelemetry instrumentor, a process-wide singleton with idempotent ``instrument()``
    and ``uninstrument()``."""

    _enabled: Enabled | None = None

    def instrumentation_dependencies(self) -> Collection[str]:
        """No package requirement: targets are whatever runtime the user names."""
        return ()

    def _instrument(self, **kwargs: Any) -> None:
        targets = load_settings().targets
        if not targets:
            logger.debug("%s is not set: kernel_ext is not enabled", env_name("targets"))
            return
        before = enabled()
        state = enable(tracer_provider=kwargs.get("tracer_provider"))
        self._enabled = state if state is not before else None
        logger.info("kernel_ext enabled on %s from %s", ", ".join(targets), env_name("targets"))

    def _uninstrument(self, **kwargs: Any) -> None:
        mine, self._enabled = self._enabled, None
        if mine is not None and enabled() is mine:
            disable()
