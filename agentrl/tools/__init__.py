"""Tools the model calls while it reasons, behind one narrow interface.

A `Tool` turns a `ToolCall` (parsed from model text by a ToolFormat, tools/formats.py) into a
`ToolResult` (agentrl/types.py). Failures never raise out of `call`: a timeout, a 5xx or a dead service
becomes a result whose `error` names the kind and whose `text` the model sees.
Clients: code.py (the sandbox service, sandbox/) and search.py (the retrieval service, retriever/).
"""

from __future__ import annotations

import itertools
from typing import Protocol, runtime_checkable

from agentrl.tools.code import CodeTool
from agentrl.tools.search import SearchTool
from agentrl.types import ToolCall, ToolResult


@runtime_checkable
class Tool(Protocol):
    name: str

    async def call(self, call: ToolCall) -> ToolResult: ...

    async def aclose(self) -> None: ...


# Function schemas of the tools, in the OpenAI / Hermes style that chat templates render into the
# system prompt (tasks with `tools.format: hermes`). Keys are the tool names task specs use.
TOOL_SCHEMAS: dict[str, dict] = {
    "python": {
        "type": "function",
        "function": {
            "name": "python",
            "description": "Run Python code and return what it prints (stdout, and stderr on error).",
            "parameters": {
                "type": "object",
                "properties": {"code": {"type": "string", "description": "The Python code to run."}},
                "required": ["code"],
            },
        },
    },
    "search": {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search an encyclopedia and return the most relevant passages.",
            "parameters": {
                "type": "object",
                "properties": {"query": {"type": "string", "description": "The search query."}},
                "required": ["query"],
            },
        },
    },
}


def build_tools(urls: dict[str, str | list[str]], search_topk: int = 3, sandbox_token: str | None = None,
                max_retries: int | None = None) -> dict[str, Tool]:
    """The tool clients of the services at `urls`, by tool name (`python`: the sandbox, sent
    `sandbox_token`; `search`: the retriever, returning `search_topk` passages a query), each retrying a call
    its service did not take `max_retries` times (default: the client's). A list of URLs is one tool over
    replicas of its service."""
    retries = {} if max_retries is None else {"max_retries": max_retries}
    clients = {"python": lambda url: CodeTool(url, token=sandbox_token, **retries),
               "search": lambda url: SearchTool(url, topk=search_topk, **retries)}
    return {name: Replicas([clients[name](u) for u in url]) if isinstance(url, list) else clients[name](url)
            for name, url in urls.items()}


class Replicas:
    """One tool over several replicas of its service: each call goes to the next, round-robin (calls are
    stateless), so a run's many engines spread their tool calls evenly."""

    def __init__(self, tools: list[Tool]) -> None:
        if not tools:
            raise ValueError("Replicas needs at least one tool")
        self.tools = tools
        self.name = tools[0].name
        self._next = itertools.count()

    async def call(self, call: ToolCall) -> ToolResult:
        return await self.tools[next(self._next) % len(self.tools)].call(call)

    async def aclose(self) -> None:
        for tool in self.tools:
            await tool.aclose()
