"""Attribution: which tool call a block belongs to.

* :mod:`kernel_ext.attribution.tap` — the live tool calls, by conversation and tool name;
* :mod:`kernel_ext.attribution.resolve` — the ``callId`` of a block: the active call, else
  the one live call of that name in the conversation, never a guess;
* :mod:`kernel_ext.attribution.processor` — the OpenTelemetry span processor that keeps the
  tap and closes the streams a call left open;
* :mod:`kernel_ext.attribution._conventions` — the OpenTelemetry conventions' names for a
  tool span, and the rule that tells one.

Nothing is imported here: import the module you need.
"""
