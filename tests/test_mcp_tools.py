"""MCP servers as tools (agentrl/tools/mcp.py): a small server the tests start over stdio."""

from __future__ import annotations

import asyncio
import os
import signal
import sys

import pytest

from agentrl.config import ConfigError
from agentrl.task_spec import ToolsSpec
from agentrl.tools import build_tools, tool_schemas
from agentrl.types import ToolCall

SERVER = '''
import os
import time

from mcp.server.mcpserver import MCPServer

app = MCPServer("notes")
with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "starts.log"), "a") as log:
    log.write(f"{os.getpid()}\\n")  # one line per start of this server


@app.tool()
def add(a: int, b: int = 2) -> int:
    """Add two integers."""
    return a + b


@app.tool()
def fail(x: int) -> str:
    """Always fails."""
    raise ValueError("no")


@app.tool()
def pid() -> int:
    """The server's process id."""
    return os.getpid()


@app.tool()
def nap(seconds: float) -> str:
    """Sleep."""
    time.sleep(seconds)
    return "rested"


if __name__ == "__main__":
    app.run()
'''


@pytest.fixture
def spec(tmp_path):
    (tmp_path / "server.py").write_text(SERVER)
    return ToolsSpec(format="hermes", mcp=[{"command": [sys.executable, str(tmp_path / "server.py")],
                                            "timeout_s": 2}])


def test_the_servers_tools_are_listed_with_their_schemas(spec):
    schemas = {s["function"]["name"]: s["function"] for s in tool_schemas(spec)}
    assert set(schemas) == {"add", "fail", "pid", "nap"}
    assert schemas["add"]["description"] == "Add two integers."
    assert schemas["add"]["parameters"]["required"] == ["a"]
    assert schemas["add"]["parameters"]["properties"]["b"]["default"] == 2


@pytest.mark.slow
def test_calls_go_to_the_server_and_a_dead_server_is_started_again(spec):
    tools = build_tools({}, mcp=spec.mcp)

    async def go():
        try:
            out = {"sum": await tools["add"].call(ToolCall("add", {"a": 40})),
                   "raises": await tools["fail"].call(ToolCall("fail", {"x": 1})),
                   "bad": await tools["add"].call(ToolCall("add", {"a": "many"})),
                   "slow": await tools["nap"].call(ToolCall("nap", {"seconds": 30}))}
            first = int((await tools["pid"].call(ToolCall("pid", {}))).text)
            os.kill(first, signal.SIGKILL)
            out["dead"] = await tools["pid"].call(ToolCall("pid", {}))  # the call that finds it gone
            out["again"] = await tools["add"].call(ToolCall("add", {"a": 1, "b": 1}))
            out["second"] = int((await tools["pid"].call(ToolCall("pid", {}))).text)
            return out, first
        finally:
            for tool in tools.values():
                await tool.aclose()

    out, first = asyncio.run(go())
    assert (out["sum"].text, out["sum"].error) == ("42", None)
    assert out["raises"].error == "tool_error" and not out["raises"].service_fault
    assert out["bad"].error == "tool_error" and "validation error" in out["bad"].text
    assert out["slow"].error == "timeout" and "2 s" in out["slow"].text
    assert out["dead"].error == "connection" and out["dead"].service_fault  # errored, not the model's fault
    assert out["again"].text == "2" and out["second"] != first
    assert tools["add"].server.restarts == 1


def test_the_server_is_listed_once_for_the_prompt_and_the_tools_then_started_for_the_run(spec, tmp_path):
    assert tool_schemas(spec) == tool_schemas(spec)  # the prompt's schemas, asked twice: one listing
    tools = build_tools({}, mcp=spec.mcp)  # its tools' names, from the same listing

    async def go():
        try:
            return await tools["add"].call(ToolCall("add", {"a": 1}))
        finally:
            await tools["add"].aclose()

    assert asyncio.run(go()).text == "3"
    assert len((tmp_path / "starts.log").read_text().split()) == 2  # listed, then held for the calls


def test_a_server_that_does_not_start_is_a_config_error_naming_the_key(tmp_path):
    bad = ToolsSpec(format="hermes", mcp=[{"command": [sys.executable, str(tmp_path / "missing.py")],
                                           "startup_timeout_s": 20}])
    with pytest.raises(ConfigError, match=r"tools.mcp\[0\]: the MCP server .*missing.py could not be reached"):
        tool_schemas(bad)
