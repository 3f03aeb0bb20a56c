"""An MCP server for the example task examples/units_mcp.yaml: the unit conversion of examples/tools/units.py,
served over stdio with the `mcp` package (agentrl starts it: `python examples/mcp/units_server.py`)."""

import sys
from pathlib import Path

from mcp.server.mcpserver import MCPServer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
from units import convert  # noqa: E402  (the same function the function-tool example serves)

app = MCPServer("units")
app.tool()(convert)

if __name__ == "__main__":
    app.run()
