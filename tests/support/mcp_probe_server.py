"""A real stdio MCP server (the SDK's MCPServer) that probes what a client hands a server and
gives back every kind of content block: `python tests/support/mcp_probe_server.py`.

Tools: `get_env(key)` (what the server's environment holds), `links()` (a resource link),
`embedded()` (an embedded text resource, an embedded blob and an image), `nested(order)` (an
argument with a nested pydantic model: a `$ref` into `$defs`), and `long_job()`, declared as
runnable only as a task (`execution.taskSupport == "required"`)."""

from __future__ import annotations

import base64
import os

from pydantic import BaseModel


class Line(BaseModel):
    item: str
    quantity: int


class Order(BaseModel):
    lines: list[Line]
    note: str | None = None


def build():  # -> MCPServer
    from mcp.server.mcpserver import MCPServer
    from mcp.types import (
        BlobResourceContents,
        EmbeddedResource,
        ImageContent,
        ResourceLink,
        TextContent,
        TextResourceContents,
        ToolExecution,
    )

    class ProbeServer(MCPServer):
        async def list_tools(self):  # declares long_job task-only, as a task server does
            tools = await super().list_tools()
            return [t.model_copy(update={"execution": ToolExecution(task_support="required")})
                    if t.name == "long_job" else t for t in tools]

    server = ProbeServer("probe", log_level="WARNING")

    @server.tool()
    def get_env(key: str) -> str:
        """The value of an environment variable in this server's process ('' when unset)."""
        return os.environ.get(key, "")

    @server.tool()
    def links() -> list:
        """A link to a resource the agent can read next."""
        return [TextContent(type="text", text="Found one report."),
                ResourceLink(type="resource_link", uri="file:///reports/q3.txt", name="q3.txt",
                             mime_type="text/plain", description="Q3 report")]

    @server.tool()
    def embedded() -> list:
        """Resources embedded in the result: a text file, a binary file and an image."""
        blob = base64.b64encode(b"\x00" * 300).decode()
        return [EmbeddedResource(type="resource", resource=TextResourceContents(
                    uri="file:///notes.md", mime_type="text/markdown", text="# Notes\nbuy pens")),
                EmbeddedResource(type="resource", resource=BlobResourceContents(
                    uri="file:///data.bin", mime_type="application/octet-stream", blob=blob)),
                ImageContent(type="image", data=base64.b64encode(b"\x89PNG" * 10).decode(),
                             mime_type="image/png")]

    @server.tool()
    def nested(order: Order) -> str:
        """Place an order of several lines."""
        return f"{len(order.lines)} lines"

    @server.tool()
    def long_job() -> str:
        """A job that runs only as a task."""
        return "done"

    return server


if __name__ == "__main__":
    build().run()
