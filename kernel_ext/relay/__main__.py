"""``python -m kernel_ext.relay`` is ``kernel-ext relay`` (:func:`.command.main`)."""

from __future__ import annotations

import sys

from kernel_ext.relay.command import main

if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
