"""Viewing a conversation's panes outside a browser, and stopping one of its calls.

* :mod:`kernel_ext.viewing.view` — ``PaneStore``, the Python twin of the browser
  renderer's pane reducer;
* :mod:`kernel_ext.viewing.tail` — ``kernel-ext tail``, the terminal viewer;
* :mod:`kernel_ext.viewing.ask_stop` — ``kernel-ext stop``, a pane's stop button in the terminal;
* :mod:`kernel_ext.viewing.terminal` — what those two commands share: their connection to the
  relay and its options, and the escaping of what they print.

Nothing is imported here: import the module you need.
"""
