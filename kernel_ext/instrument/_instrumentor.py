"""The instrumentor and its targets: which methods are wrapped, and undoing it."""

from __future__ import annotations

import importlib
import threading
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import wrapt
from opentelemetry.instrumentation.instrumentor import (  # type: ignore[attr-defined, unused-ignore]
    BaseInstrumentor,
)
from opentelemetry.instrumentation.utils import unwrap
from opentelemetry.trace import TracerProvider

from kernel_ext.attribution.tap import CallSink
from kernel_ext.errors import ConfigError
from kernel_ext.instrument._call import Describe, StoppedAs, default_describe, log, tracer_of
from kernel_ext.instrument._wrappers import Wrapping, kind_of, make_wrapper
from kernel_ext.settings import env_name, load_settings
from kernel_ext.worker import _fork

__all__ = ["ToolRuntimeInstrumentor", "ToolTarget"]


@dataclass(frozen=True, slots=True)
class ToolTarget:
    """One method to wrap: ``target`` is ``"package.module:Class.method"`` (or
    ``"package.module:function"``); ``describe`` its hook (default: the ``describe`` given
    to ``instrument()``, else :func:`default_describe`); ``stopped_as`` shapes the result a
    stopped call returns (:func:`kernel_ext.stop_call`) the way the runtime returns results:
    ``stopped_as(instance, args, kwargs, text)`` with the call's own arguments and the stopped
    result's text, called only for a stopped call (``None``: the text itself; a hook that
    raises: the text, logged)."""

    target: str
    describe: Describe | None = None
    stopped_as: StoppedAs | None = None


class ToolRuntimeInstrumentor(BaseInstrumentor):  # type: ignore[misc, unused-ignore]
    """Wraps tool runtimes' invoke methods so that each call has its ``execute_tool`` span
    and its contextvar (see :mod:`kernel_ext.instrument` for what happens around a call;
    :meth:`_instrument` for the keywords of ``instrument()``).

    A process-wide singleton, like every OpenTelemetry instrumentor: the worker's wiring
    (and the ``opentelemetry-instrument`` entry point) and user code share one set of wrapped
    targets. ``instrument()`` and ``uninstrument()`` are idempotent (a repeated call logs a
    warning and does nothing); to change targets, ``uninstrument()`` and ``instrument()``
    again. It only wraps: hub, span processor and sender are :func:`kernel_ext.enable`'s.

    Wrapping is per attribute: code that imported the function itself (``from mod import
    func``) before instrumenting keeps the unwrapped one. ``uninstrument()`` puts the
    original attribute back (the same object); if something else wrapped the attribute
    after us, our wrapper stays in place but passes calls through untouched. Inside
    OpenTelemetry's ``suppress_instrumentation()`` wrapped calls run untouched too.

    :attr:`sink` (a :class:`~kernel_ext.attribution.tap.CallSink`, or ``None``) may be set at
    any time; each call's end is reported to the sink set when the call ends, and its
    ``call_attributes(call_id)`` are written on the call's span before the call returns.
    """

    sink: CallSink | None
    _wrapped: list[Wrapping]
    _lock: threading.RLock

    def __init__(self) -> None:
        # The singleton's __init__ runs at every ToolRuntimeInstrumentor(): set up once.
        if "_wrapped" not in self.__dict__:
            self.sink = None
            self._wrapped = []
            self._lock = threading.RLock()
            _fork.reset_in_child(self._reset_after_fork)

    def _reset_after_fork(self) -> None:
        """In a forked child: a new lock (another thread of the parent may have held it)."""
        self._lock = threading.RLock()

    def instrumentation_dependencies(self) -> Collection[str]:
        """No package requirement: targets are whatever runtime the user names."""
        return ()

    @property
    def targets(self) -> tuple[str, ...]:
        """The targets currently wrapped."""
        return tuple(w.target for w in self._wrapped)

    def _instrument(self, **kwargs: Any) -> None:
        """``instrument(**kwargs)``, whose keywords are:

        * ``targets``: an iterable of target strings ``"package.module:Class.method"`` (or
          ``"package.module:function"``) and/or :class:`ToolTarget` objects. Without
          ``targets``, those of ``KERNEL_EXT_TARGETS`` (:mod:`kernel_ext.settings`; unset or
          empty: nothing is wrapped).
        * ``describe``: the describe hook of string targets (default: with ``targets``,
          :func:`default_describe`; without, the hook ``KERNEL_EXT_DESCRIBE`` names, if any).
        * ``tracer_provider``: where spans go (default: the global provider, resolved lazily).
        * ``sink``: sets :attr:`sink`.

        Raises :class:`~kernel_ext.ConfigError` for a malformed or unknown target or hook (or
        a bad ``KERNEL_EXT_*`` value); nothing is wrapped then.
        """
        if "sink" in kwargs:
            self.sink = kwargs["sink"]
        targets: Iterable[str | ToolTarget] | None = kwargs.get("targets")
        describe: Describe | None = kwargs.get("describe")
        if targets is None:
            settings = load_settings()
            if not settings.targets:
                log.debug("%s is not set: no tool runtime instrumented", env_name("targets"))
                return
            describe = describe or settings.describe_hook()
            self._wrap(settings.targets, describe, kwargs.get("tracer_provider"))
            log.info(
                "kernel_ext instrumented %s from %s",
                ", ".join(settings.targets),
                env_name("targets"),
            )
            return
        self._wrap(list(targets), describe, kwargs.get("tracer_provider"))

    def _uninstrument(self, **kwargs: Any) -> None:
        with self._lock:
            wrappings = self._wrapped
            for wrapping in reversed(wrappings):
                _restore(wrapping)
            wrappings.clear()

    def _wrap(
        self,
        targets: Sequence[str | ToolTarget],
        describe: Describe | None,
        tracer_provider: TracerProvider | None,
    ) -> None:
        tracer = tracer_of(tracer_provider)
        done: list[Wrapping] = []
        with self._lock:
            try:
                for target in targets:
                    spec = target if isinstance(target, ToolTarget) else ToolTarget(target)
                    hook = spec.describe or describe or default_describe
                    if not callable(hook):
                        raise ConfigError(
                            f"describe for {spec.target!r} must be callable, "
                            f"got {type(hook).__name__}"
                        )
                    module, path, owner, attribute = _resolve_target(spec.target)
                    original = vars(owner).get(attribute, getattr(owner, attribute))
                    wrapping = Wrapping(spec.target, owner, attribute, original)
                    wrapper = make_wrapper(
                        wrapping,
                        kind_of(original),
                        hook,
                        tracer,
                        self._current_sink,
                        spec.stopped_as,
                    )
                    wrapping.wrapper = wrapt.wrap_function_wrapper(module, path, wrapper)
                    done.append(wrapping)
            except BaseException:
                for wrapping in reversed(done):
                    _restore(wrapping)
                raise
            self._wrapped.extend(done)

    def _current_sink(self) -> CallSink | None:
        return self.sink


def _resolve_target(target: str) -> tuple[Any, str, Any, str]:
    """``"pkg.mod:Class.method"`` → (module, "Class.method", owner, "method")."""
    if not isinstance(target, str) or target.count(":") != 1:
        raise ConfigError(f"target must look like 'package.module:Class.method', got {target!r}")
    module_name, path = target.split(":")
    parts = path.split(".")
    if not module_name or not all(parts):
        raise ConfigError(f"target must look like 'package.module:Class.method', got {target!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(
            f"target {target!r}: cannot import module {module_name!r} ({type(exc).__name__}: {exc})"
        ) from exc
    owner: Any = module
    for part in parts[:-1]:
        try:
            owner = getattr(owner, part)
        except AttributeError:
            raise ConfigError(f"target {target!r}: {part!r} not found") from None
    attribute = parts[-1]
    if not hasattr(owner, attribute):
        raise ConfigError(f"target {target!r}: {attribute!r} not found")
    return module, path, owner, attribute


def _restore(wrapping: Wrapping) -> None:
    """Put the original attribute back if our wrapper is still the attribute; otherwise
    leave the newer wrapper alone and make ours pass calls through."""
    wrapping.active = False
    owner, attribute = wrapping.owner, wrapping.attribute
    if vars(owner).get(attribute) is not wrapping.wrapper:
        log.warning(
            "%s was re-wrapped after kernel_ext instrumented it; leaving it in place "
            "(kernel_ext's wrapper now passes calls through)",
            wrapping.target,
        )
        return
    unwrap(owner, attribute)
    if vars(owner).get(attribute) is not wrapping.original:
        # unwrap() restores the bound form of classmethods/staticmethods; put back the
        # very object that was there.
        setattr(owner, attribute, wrapping.original)
