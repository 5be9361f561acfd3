"""The pydantic-ai contender of ``bench_peers.py`` (its docstring is the method)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Awaitable, Callable
from typing import Any

Trial = Callable[[int], Awaitable[tuple[float, float, int]]]


def pydantic_ai_trial(payload: str) -> Trial | str:
    """The pydantic-ai contender, or why it cannot run."""
    try:
        from pydantic_ai import Agent, CustomEvent, RunContext
        from pydantic_ai.models.test import TestModel
    except ImportError as exc:
        return f"pydantic-ai not installed ({exc.name}); install the `pydantic-ai` extra"

    @dataclasses.dataclass(kw_only=True)
    class Progress(CustomEvent):
        text: str

    agent: Any = Agent(TestModel(call_tools=["emit_events"]))
    wanted: dict[str, int] = {"n": 0}
    box: dict[str, float] = {}

    async def emit_events(ctx: RunContext[None], n: int) -> str:
        """Emit the wanted number of custom events."""
        emit = ctx.emit
        start = time.perf_counter()
        for _ in range(wanted["n"]):
            await emit(Progress(text=payload))
        box["in_tool"] = time.perf_counter() - start
        return "final answer"

    emit_events.__annotations__ = {"ctx": RunContext[None], "n": int, "return": str}
    agent.tool(emit_events)

    async def trial(n: int) -> tuple[float, float, int]:
        wanted["n"] = n
        seen = 0

        async def handler(ctx: Any, events: Any) -> None:
            nonlocal seen
            async for event in events:
                if isinstance(event, Progress):
                    seen += 1

        start = time.perf_counter()
        await agent.run("go", event_stream_handler=handler)
        total = time.perf_counter() - start
        return total, box.pop("in_tool", 0.0), seen

    return trial
