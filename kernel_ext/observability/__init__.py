"""What kernel_ext counts and logs, for operators.

Modules:

* :mod:`kernel_ext.observability.count_names` — every name kernel_ext counts under, once
  (outcomes, reasons, events: the values users read);
* :mod:`kernel_ext.observability.otel_metrics` — the OpenTelemetry instruments those counts
  are added to (``kernel_ext.blocks``, ``kernel_ext.resolutions`` …);
* :mod:`kernel_ext.observability._rare_log` — a recurring fault logged on its 1st, 2nd, 4th …
  occurrence (``RareLog``), and counts added to a counter in batches (``BatchedCount``).

The stream's block totals are :mod:`kernel_ext.stream.block_counts`; the relay's log and
frame count, :mod:`kernel_ext.relay._log`. Importing this package imports none of them.
"""
