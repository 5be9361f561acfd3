"""Kept for :mod:`kernel_ext.relay.command` alone until that moves into :mod:`kernel_ext.cli`
(issue 34): the manager's home is :mod:`kernel_ext.redis.manager`. Nothing else imports
this module; delete it once ``command`` imports from there."""

from __future__ import annotations

from kernel_ext.redis.manager import RelayRedisManager

__all__ = ["RelayRedisManager"]
