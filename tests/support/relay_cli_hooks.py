"""Hooks for the standalone relay's tests (loaded by ``--authenticate`` /
``--authorize-join relay_cli_hooks:…`` in a subprocess, with ``tests/support`` on its path)."""

from __future__ import annotations

from typing import Any

TOKENS = {"token-of-alice": "alice"}
MEMBERS = {"conv-of-alice": {"alice"}}
NOT_CALLABLE = 42


def authenticate(auth: Any, environ: Any) -> Any:
    """A browser's identity from its token, or ``None`` (refused)."""
    token = auth.get("token") if isinstance(auth, dict) else None
    return TOKENS.get(token) if isinstance(token, str) else None


async def authorize_join(identity: Any, conversation_id: str) -> bool:
    """Members only (an async hook: the relay awaits it)."""
    return identity in MEMBERS.get(conversation_id, set())
