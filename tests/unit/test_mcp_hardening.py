"""MCP hardening against a real stdio server (tests/support/mcp_probe_server.py, the SDK's own
MCPServer): no trainer secret reaches a server, every content block reads as text the model can
act on, task-only tools are not offered, and the json action schema keeps `$defs` and
`additionalProperties` schemas."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("mcp")

from art_core import Trajectory, recording  # noqa: E402
from art_mcp import ServerSpec, action_schema, connect  # noqa: E402
from art_mcp.cli import server_env  # noqa: E402

PROBE = Path(__file__).resolve().parents[1] / "support" / "mcp_probe_server.py"


def probe(**env: str) -> ServerSpec:
    return ServerSpec(command=[sys.executable, str(PROBE)], env=env)


async def call(spec: ServerSpec, tool: str, tmp_path: Path, **arguments: object) -> str:
    async with connect(spec, workdir=tmp_path) as session:
        traj = Trajectory()
        with recording(traj):
            result = await session.call_tool(tool, arguments)
        from art_mcp.session import result_text

        return result_text(result)


async def test_a_stdio_server_gets_no_secret_of_the_trainer(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", "wandb-secret")
    monkeypatch.setenv("ART_API_KEY", "art-secret")
    spec = probe(INVENTORY_DB="/tmp/x.db")
    assert await call(spec, "get_env", tmp_path, key="WANDB_API_KEY") == ""
    assert await call(spec, "get_env", tmp_path, key="ART_API_KEY") == ""
    assert await call(spec, "get_env", tmp_path, key="INVENTORY_DB") == "/tmp/x.db"  # named
    assert await call(spec, "get_env", tmp_path, key="PATH")  # the safe default is there
    assert await call(spec, "get_env", tmp_path, key="ART_MCP_ROLLOUT_DIR") == str(tmp_path)


@pytest.mark.parametrize("items,environ,expected", [
    (["A=1", "B"], {"B": "2"}, {"A": "1", "B": "2"}),
    (["URL=http://x?a=b"], {}, {"URL": "http://x?a=b"}),  # only the first "=" splits
    ([], {"SECRET": "s"}, {}),
])
def test_env_flag_names_what_the_server_gets(items, environ, expected):
    assert server_env(items, environ) == expected


@pytest.mark.parametrize("item,needle", [
    ("MISSING", "not set"), ("=1", "expected KEY"), ("1A=x", "expected KEY"),
    ("A-B=x", "expected KEY"),
])
def test_env_flag_errors(item, needle):
    with pytest.raises(ValueError, match=needle):
        server_env([item], {})


async def test_links_and_embedded_resources_keep_what_the_agent_needs(tmp_path):
    link = await call(probe(), "links", tmp_path)
    assert "Found one report." in link
    assert "uri=file:///reports/q3.txt" in link and "name='q3.txt'" in link
    assert "mime_type='text/plain'" in link and "Q3 report" in link
    embedded = await call(probe(), "embedded", tmp_path)
    assert "uri=file:///notes.md" in embedded and "text/markdown" in embedded
    assert "# Notes\nbuy pens" in embedded  # a text resource's text
    assert "uri=file:///data.bin" in embedded and "300 bytes not shown" in embedded
    assert "[image, mime_type='image/png', 40 bytes not shown]" in embedded


async def test_task_only_tools_are_not_offered_and_are_counted(tmp_path):
    async with connect(probe(), workdir=tmp_path) as session:
        traj = Trajectory()
        with recording(traj):
            listed = await session.list_tools()
        names = [t.name for t in listed.tools]
        assert "long_job" not in names and "get_env" in names
        assert [t["function"]["name"] for t in traj.tools or []] == names
        assert session.task_only_tools == ["long_job"]


async def test_json_actions_keep_defs_and_additional_properties_schemas(tmp_path):
    import jsonschema

    async with connect(probe(), workdir=tmp_path) as session:
        tools = await session.openai_tools()
    nested = next(t for t in tools if t["function"]["name"] == "nested")
    assert "$defs" in nested["function"]["parameters"]  # pydantic's nested model
    tagged = {"type": "function", "function": {"name": "tag", "parameters": {
        "type": "object", "properties": {
            "title": {"type": "string"},  # a property named "title" is not an annotation
            "tags": {"type": "object", "additionalProperties": {"type": "integer"}}},
        "required": ["title", "tags"]}}}
    schema = action_schema([*tools, tagged])
    jsonschema.Draft202012Validator.check_schema(schema)
    ok = {"name": "nested", "arguments": {"order": {"lines": [{"item": "pen", "quantity": 2}]}}}
    jsonschema.validate(ok, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"name": "nested", "arguments": {"order": {"lines": [
            {"item": "pen", "quantity": "two"}]}}}, schema)
    jsonschema.validate({"name": "tag", "arguments": {"title": "t", "tags": {"a": 1}}}, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"name": "tag", "arguments": {"title": "t", "tags": {"a": "x"}}},
                            schema)
    xgrammar = pytest.importorskip("xgrammar")  # the grammar compiler vLLM uses
    xgrammar.Grammar.from_json_schema(json.dumps(schema))  # raised "Cannot find field $defs"


async def test_a_third_party_server_from_pypi_records_tools_and_results(tmp_path, monkeypatch):
    """`mcp-server-time` (PyPI, not ours): its tools become OpenAI tools, a call's text result
    reaches the trajectory, and it runs without the trainer's secrets."""
    pytest.importorskip("mcp_server_time")
    monkeypatch.setenv("WANDB_API_KEY", "wandb-secret")
    spec = ServerSpec(command=[sys.executable, "-m", "mcp_server_time",
                               "--local-timezone", "UTC"])
    async with connect(spec, workdir=tmp_path) as session:
        traj = Trajectory()
        with recording(traj):
            await session.list_tools()
            result = await session.call_tool("get_current_time", {"timezone": "Europe/Paris"})
    names = {t["function"]["name"] for t in traj.tools or []}
    assert {"get_current_time", "convert_time"} <= names
    params = next(t for t in traj.tools if t["function"]["name"] == "get_current_time")
    assert "timezone" in params["function"]["parameters"]["properties"]
    from art_mcp.session import result_text

    text = result_text(result)
    assert "Europe/Paris" in text and json.loads(text)["timezone"] == "Europe/Paris"
