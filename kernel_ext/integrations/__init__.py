"""Ready-made integrations of kernel_ext with agent frameworks.

* :mod:`kernel_ext.integrations.pydantic_ai` — a pydantic-ai capability (extra
  ``kernel-ext[pydantic-ai]``, Python ≥ 3.11).
* :mod:`kernel_ext.integrations.langchain` — targets for LangChain tools and LangGraph's
  ``ToolNode`` (extra ``kernel-ext[langchain]``).
* :mod:`kernel_ext.integrations.mcp` — ``call_mcp_tool``: an MCP tool call's progress as
  blocks (extra ``kernel-ext[mcp]``).
* :mod:`kernel_ext.integrations.openai_agents` — attributed function tools for the OpenAI
  Agents SDK (extra ``kernel-ext[openai-agents]``).
* :mod:`kernel_ext.integrations.ag_ui` — the AG-UI bridge: each tool call's live pane in
  AG-UI front-ends (extra ``kernel-ext[agui]``).

Each integration is imported explicitly; importing this package imports none of them.
"""

from __future__ import annotations
