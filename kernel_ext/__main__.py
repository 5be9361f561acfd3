"""``python -m kernel_ext`` is the ``kernel-ext`` command (:func:`kernel_ext.cli.entry.main`)."""

from __future__ import annotations

import sys

from kernel_ext.cli.entry import main

if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
