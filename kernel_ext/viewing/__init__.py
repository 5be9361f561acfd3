"""Viewing a conversation's panes outside a browser.

* :mod:`kernel_ext.viewing.view` — ``PaneStore``, the Python twin of the browser
  renderer's pane reducer;
* :mod:`kernel_ext.viewing.tail` — ``kernel-ext tail``, the terminal viewer.

Nothing is imported here: import the module you need.
"""
