"""The worker process's life with kernel_ext: switched on, forked, shut down.

Modules:

* :mod:`kernel_ext.worker.wiring` — :func:`~kernel_ext.worker.wiring.enable` /
  ``disable()``: one call wires the stream hub, the span processor, the instrumentor and a
  sender (``kernel_ext.enable`` is this function);
* :mod:`kernel_ext.worker.auto` — the ``opentelemetry_instrumentor`` entry point:
  ``opentelemetry-instrument`` enables the worker from the environment;
* :mod:`kernel_ext.worker._fork` — what a fork leaves behind, made whole in the child;
* :mod:`kernel_ext.worker._shutdown` — the sender's loop thread, the exit hook and the
  ``SIGTERM`` flush.

Importing this package imports none of them.
"""
