"""MCP servers as tools: a task spec names a server, the model calls its tools by name.

    tools:
      format: hermes
      mcp:
        - command: [python, examples/mcp/units_server.py]    # started over stdio ...
        - url: http://127.0.0.1:9000/mcp                      # ... or reached over Streamable HTTP

agentrl connects with the `mcp` package's client, lists the server's tools and shows the model their
names, descriptions and input schemas (hermes, through the chat template). A call's text content is what
the model sees; a result the server marks as an error is an observation too (`tool_error`: the model's call
failed). A server that cannot be reached, or that died, is the tool's fault (`connection`: the trajectory is
errored); a server started by agentrl that died is started again on the next call (`restarts` counts), and
the calls still waiting when it died fail. A call past `timeout_s` is a `timeout` observation.

One connection per server lives in a task of its own on the trainer's event loop (the client's streams
belong to the task that opened them); calls from any trajectory share it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import json
import os
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

from agentrl.types import ToolCall, ToolResult


def _errlog() -> Any:
    """Where a started server's stderr goes: ours, where it is a real file (not under a test runner's capture)."""
    try:
        sys.stderr.fileno()
        return sys.stderr
    except (AttributeError, OSError, ValueError):
        return open(os.devnull, "w")  # noqa: SIM115 - the server's lifetime


def _transport(spec: Any) -> Any:
    """The URL, or the stdio transport of the command (`python`: the trainer's own interpreter)."""
    from mcp import StdioServerParameters
    from mcp.client.stdio import stdio_client

    if spec.url is not None:
        return spec.url
    program = sys.executable if spec.command[0] in ("python", "python3") else spec.command[0]
    params = StdioServerParameters(command=program, args=list(spec.command[1:]), env=spec.env or None)
    return stdio_client(params, errlog=_errlog())


def _text(result: Any) -> str:
    """What the model sees of a tool result: its text content, other content named by its type."""
    parts = [getattr(c, "text", None) or f"[{getattr(c, 'type', 'content')}]" for c in result.content or []]
    return "\n".join(parts)


class MCPServer:
    """One server of the spec: connected on first use, in the event loop of that use; reconnected (its
    command started again) after it died."""

    def __init__(self, spec: Any) -> None:
        self.spec = spec
        self.restarts = 0
        self._client: Any = None
        self._task: asyncio.Task | None = None
        self._ready: asyncio.Event | None = None
        self._closing: asyncio.Event | None = None
        self._failed: BaseException | None = None
        self._lost = False  # the connection failed: the next one is a restart

    async def _hold(self) -> None:
        from mcp import Client

        try:
            async with Client(_transport(self.spec), read_timeout_seconds=self.spec.startup_timeout_s) as client:
                self._client = client
                self._ready.set()
                await self._closing.wait()
        except BaseException as e:  # it could not start, or it died: the next call connects again
            self._failed = e
            raise
        finally:
            self._client = None
            self._ready.set()

    async def client(self) -> Any:
        """The live client, connecting (again) where there is none; ConnectionError naming why not."""
        if self._task is not None and self._task.done():  # it died
            self._task, self._lost = None, True
        if self._task is None:
            self.restarts += self._lost
            self._lost = False
            self._ready, self._closing, self._failed = asyncio.Event(), asyncio.Event(), None
            self._task = asyncio.create_task(self._hold())
            self._task.add_done_callback(lambda t: t.cancelled() or t.exception())  # retrieved: no warning
        try:
            await asyncio.wait_for(self._ready.wait(), self.spec.startup_timeout_s)
        except TimeoutError:
            raise ConnectionError(f"the MCP server {self.spec.label} did not start within "
                                  f"{self.spec.startup_timeout_s:g} s") from None
        if self._client is None:
            raise ConnectionError(f"the MCP server {self.spec.label} could not be reached: "
                                  f"{type(self._failed).__name__}: {self._failed}")
        return self._client

    async def list_tools(self) -> list[Any]:
        return list((await (await self.client()).list_tools()).tools)

    async def call(self, name: str, arguments: dict[str, Any]) -> ToolResult:
        start = time.perf_counter()
        try:
            client = await self.client()
            result = await asyncio.wait_for(client.call_tool(name, arguments), self.spec.timeout_s)
        except TimeoutError:
            return ToolResult(f"Error: the tool did not finish within {self.spec.timeout_s:g} s", "timeout",
                              latency_s=time.perf_counter() - start)
        except Exception as e:  # unreachable, or died during the call: the next call connects again
            await self.aclose()
            self._lost = True
            return ToolResult(f"Error: the tool's server failed: {type(e).__name__}: {e}", "connection",
                              latency_s=time.perf_counter() - start)
        return ToolResult(_text(result), "tool_error" if result.is_error else None,
                          latency_s=time.perf_counter() - start)

    async def aclose(self) -> None:
        task, self._task = self._task, None
        if task is not None and not task.done():
            self._closing.set()
            await asyncio.wait({task}, timeout=30)  # the client closes its streams and ends the command


class MCPTool:
    """One tool of an MCP server, as a Tool."""

    def __init__(self, name: str, server: MCPServer) -> None:
        self.name, self.server = name, server

    async def call(self, call: ToolCall) -> ToolResult:
        return await self.server.call(self.name, call.arguments)

    async def aclose(self) -> None:
        await self.server.aclose()


def run_sync(make: Callable[[], Awaitable[Any]]) -> Any:
    """`make()`'s result from synchronous code, also where an event loop is running (in a thread)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(make())
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(lambda: asyncio.run(make())).result()


def server_schemas(spec: Any) -> list[dict]:
    """The schemas of the tools server `spec` offers: it is started, asked and stopped once per process, and
    the answer serves both the prompt (the schemas the model is shown) and the tools built for the run (their
    names), which then start it for good in the run's own event loop."""
    return json.loads(_listed(spec.model_dump_json()))  # a copy of its own for each caller


@functools.lru_cache(maxsize=64)
def _listed(spec_json: str) -> str:
    from agentrl.task_spec import MCPServerSpec

    spec = MCPServerSpec.model_validate_json(spec_json)

    async def listed() -> list[dict]:
        server = MCPServer(spec)
        try:
            tools = await server.list_tools()
        finally:
            await server.aclose()
        return [{"type": "function", "function": {"name": t.name, "description": t.description or "",
                                                  "parameters": t.input_schema}} for t in tools]
    return json.dumps(run_sync(listed))
