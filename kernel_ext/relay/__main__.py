"""``python -m kernel_ext.relay`` is ``kernel-ext relay`` (:func:`kernel_ext.cli.relay.main`)."""

from __future__ import annotations

import sys

from kernel_ext.cli.relay import main

if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
