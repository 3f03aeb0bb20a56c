"""Tools the model calls while it reasons, behind one narrow interface.

A `Tool` turns a `ToolCall` (parsed from model text by a ToolFormat, tools/formats.py) into a
`ToolResult` (agentrl/types.py). Failures never raise out of `call`: a timeout, a 5xx or a dead service
becomes a result whose `error` names the kind and whose `text` the model sees.
Clients: code.py (the sandbox service, sandbox/) and search.py (the retrieval service, retriever/);
functions.py: the task's own Python functions, run by function_pool.py's worker processes.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from agentrl.config import ConfigError
from agentrl.tools.code import CodeTool
from agentrl.tools.function_pool import FunctionPool
from agentrl.tools.functions import FunctionTool, function_schema, load_function
from agentrl.tools.mcp import MCPServer, MCPTool, server_schemas
from agentrl.tools.search import SearchTool
from agentrl.types import ToolCall, ToolResult

if TYPE_CHECKING:
    from agentrl.task_spec import FunctionToolSpec, MCPServerSpec, ToolsSpec


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
                max_retries: int | None = None, functions: Sequence[FunctionToolSpec] = (),
                workers: int = 4, mcp: Sequence[MCPServerSpec] = ()) -> dict[str, Tool]:
    """The task's tools by name: the clients of the services at `urls` (`python`: the sandbox, sent
    `sandbox_token`; `search`: the retriever, returning `search_topk` passages a query), each retrying a call
    its service did not take `max_retries` times (default: the client's), a list of URLs being one tool over
    replicas of its service; the Python `functions`, run by one pool of `workers` processes; and the tools
    of the `mcp` servers."""
    retries = {} if max_retries is None else {"max_retries": max_retries}
    clients = {"python": lambda url: CodeTool(url, token=sandbox_token, **retries),
               "search": lambda url: SearchTool(url, topk=search_topk, **retries)}
    tools: dict[str, Tool] = {name: Replicas([clients[name](u) for u in url]) if isinstance(url, list)
                              else clients[name](url) for name, url in urls.items()}
    if functions:
        pool = FunctionPool(workers)
        for i, f in enumerate(functions):
            tools[f.name] = FunctionTool(f.name, f.function, _function(i, f), pool, f.timeout_s)
    for i, spec in enumerate(mcp):
        server = MCPServer(spec)
        for schema in _server_schemas(i, spec):
            name = schema["function"]["name"]
            if name in tools:
                raise ConfigError(f"tools.mcp[{i}] ({spec.label}) offers a tool {name!r}, a name another tool has")
            tools[name] = MCPTool(name, server)
    return tools


def _server_schemas(i: int, spec: MCPServerSpec) -> list[dict]:
    try:
        return server_schemas(spec)
    except ConnectionError as e:
        raise ConfigError(f"tools.mcp[{i}]: {e}") from None


def _function(i: int, f: FunctionToolSpec) -> Any:
    """The function of `tools.functions[i]`; a ConfigError naming that key when it cannot be had."""
    try:
        return load_function(f.function)
    except ValueError as e:
        raise ConfigError(f"tools.functions[{i}].function: {e}") from None


def tool_schemas(spec: ToolsSpec) -> list[dict]:
    """The schemas of the task's tools, as the chat template renders them (hermes): the built-in ones', then
    each function's (from its signature and docstring, or as the spec gives it)."""
    schemas = [TOOL_SCHEMAS[name] for name in spec.names]
    for i, f in enumerate(spec.functions):
        fn = _function(i, f)
        try:
            schemas.append(function_schema(fn, f.name, f.description, f.parameters))
        except ValueError as e:
            raise ConfigError(f"tools.functions[{i}]: {e}") from None
        _check_stand_in(i, f.name, schemas[-1], spec.format)
    for i, server in enumerate(spec.mcp):
        schemas.extend(_server_schemas(i, server))
    return schemas


async def call_tool(call: ToolCall, tools: dict[str, Tool], timeout_s: float) -> ToolResult:
    """Run one call; every failure becomes a result the model sees, never an exception."""
    tool = tools.get(call.name)
    if tool is None:
        return ToolResult(f"Error: there is no tool {call.name!r}; available: {', '.join(tools)}", error="unknown_tool")
    t0 = time.perf_counter()
    try:
        return await asyncio.wait_for(tool.call(call), timeout_s)
    except TimeoutError:
        return ToolResult(f"Error: the tool did not answer within {timeout_s:g}s", error="no_answer",
                          latency_s=time.perf_counter() - t0)
    except Exception as e:  # a tool client should not raise; if it does, the batch still goes on
        return ToolResult(f"Error: {type(e).__name__}: {e}", error="exception", latency_s=time.perf_counter() - t0)


def _check_stand_in(i: int, name: str, schema: dict, fmt: str | None) -> None:
    """A function standing in for a built-in tool of a tag format is called with that tool's one argument
    (python: `code`, search: `query`): its parameters must take it, and need no other."""
    if fmt == "hermes" or name not in TOOL_SCHEMAS:
        return
    [arg] = TOOL_SCHEMAS[name]["function"]["parameters"]["required"]
    params = schema["function"]["parameters"]
    if arg not in params.get("properties", {}) or set(params.get("required", [])) - {arg}:
        raise ConfigError(f"tools.functions[{i}]: the {fmt} format calls {name} with one argument {arg!r}; the "
                          f"function takes {sorted(params.get('properties', {}))}, "
                          f"requiring {sorted(params.get('required', []))}")


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
