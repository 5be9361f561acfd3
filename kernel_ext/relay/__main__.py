"""``python -m kernel_ext.relay``: the standalone relay (:func:`kernel_ext.relay.command.main`)."""

from __future__ import annotations

from kernel_ext.relay.command import main

if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
