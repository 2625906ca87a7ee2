"""Strict tool calls without an engine: the request rewrite, the response conversion, and the
gateway path end to end against a scripted upstream (the openai client, langchain-openai's
ChatOpenAI and LangGraph's ToolNode reading what the gateway returns)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from art_core.inference.engine import VLLMEngine
from art_core.inference.gateway import Gateway
from art_core.inference.tool_calls import ToolCallError, parse_calls, plan_tools, stream_chunks

PARAMS = {"type": "object", "properties": {"country": {"type": "string"}},
          "required": ["country"]}
LOOKUP = {"type": "function", "function": {"name": "lookup", "parameters": PARAMS}}
OTHER = {"type": "function", "function": {"name": "other", "parameters": {"type": "object"}}}
STRICT = {"type": "function", "function": {"name": "lookup", "parameters": PARAMS,
                                           "strict": True}}
CALL = '<tool_call>\n{"name": "lookup", "arguments": {"country": "Peru"}}\n</tool_call>'


def body(**kw: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], **kw}


@pytest.mark.parametrize(("req", "forced", "names", "parallel"), [
    (body(tools=[LOOKUP, OTHER], tool_choice="required"), True, ["lookup", "other"], False),
    (body(tools=[LOOKUP, OTHER], tool_choice={"type": "function",
                                              "function": {"name": "other"}}),
     True, ["other"], False),
    (body(tools=[STRICT, OTHER]), False, ["lookup", "other"], False),
    (body(tools=[STRICT], tool_choice="auto", parallel_tool_calls=True), False, ["lookup"], True),
    (body(tools=[LOOKUP], tool_choice="required", parallel_tool_calls=True), True, ["lookup"],
     True),
])
def test_plan_for_strict_requests(req, forced, names, parallel):
    plan = plan_tools(req)
    assert plan is not None
    assert (plan.forced, [n for n, _ in plan.tools], plan.parallel) == (forced, names, parallel)


@pytest.mark.parametrize("req", [
    body(), body(tools=[LOOKUP]), body(tools=[LOOKUP], tool_choice="auto"),
    body(tools=[STRICT], tool_choice="none"),
])
def test_no_plan_leaves_the_request_alone(req):
    assert plan_tools(req) is None


@pytest.mark.parametrize(("req", "needle"), [
    (body(tools=[LOOKUP], tool_choice={"type": "function", "function": {"name": "nope"}}),
     "not in 'tools'"),
    (body(tools=[LOOKUP], tool_choice={"type": "function"}), "tool_choice must be"),
    (body(tools=[LOOKUP], tool_choice="required",
          response_format={"type": "json_schema", "json_schema": {}}), "cannot be combined"),
    (body(tools=[{"type": "function", "function": {"name": "bad name"}}],
          tool_choice="required"), "function name"),
    (body(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}],
          tool_choice="required"), "unsupported parameters schema"),
])
def test_plan_errors(req, needle):
    with pytest.raises(ToolCallError, match=needle):
        plan_tools(req)


def test_upstream_grammar_is_the_hermes_form_with_canonical_json():
    plan = plan_tools(body(tools=[LOOKUP], tool_choice="required", stream=True))
    up = plan.upstream(body(tools=[LOOKUP], tool_choice="required", stream=True,
                            stream_options={"include_usage": True}))
    assert up["tool_choice"] == "none" and "stream" not in up and "stream_options" not in up
    assert up["skip_special_tokens"] is False
    assert up["tools"] == [LOOKUP]  # still rendered into the prompt by the chat template
    fmt = json.loads(up["structured_outputs"]["structural_tag"])["format"]
    assert fmt["type"] == "tags_with_separator" and fmt["at_least_one"]
    assert fmt["stop_after_first"]
    tag = fmt["tags"][0]
    assert tag["begin"] + "ARGS" + tag["end"] == CALL.replace('{"country": "Peru"}', "ARGS")
    grammar = tag["content"]["grammar"]
    assert '": "' in grammar and '"\\"country\\""' in grammar  # one line, ", " and ": "
    auto = plan_tools(body(tools=[STRICT, OTHER])).upstream(body(tools=[STRICT, OTHER]))
    fmt = json.loads(auto["structured_outputs"]["structural_tag"])["format"]
    assert fmt["type"] == "triggered_tags" and fmt["triggers"] == ["<tool_call>"]


@pytest.mark.parametrize(("text", "content", "calls"), [
    (CALL, None, [("lookup", '{"country": "Peru"}')]),
    ("Let me look.\n" + CALL, "Let me look.\n", [("lookup", '{"country": "Peru"}')]),
    (CALL + "\n" + CALL.replace("Peru", "Chile"), None,
     [("lookup", '{"country": "Peru"}'), ("lookup", '{"country": "Chile"}')]),
    ('<tool_call>\n{"name": "lookup", "arguments": {"country":"Pe"}}\n</tool_call>', None,
     [("lookup", '{"country":"Pe"}')]),  # arguments are returned exactly as sampled
])
def test_parse_calls(text, content, calls):
    got = parse_calls(text, {"lookup"})
    assert got is not None
    assert got[0] == content
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in got[1]] == calls
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in got[1])


@pytest.mark.parametrize("text", [
    "", "no call", CALL[:-5],  # cut off by max_tokens
    CALL + " trailing", CALL.replace("lookup", "unknown"),
    CALL.replace('{"country": "Peru"}', '["Peru"]'), CALL.replace('"Peru"}', '"Peru"'),
])
def test_parse_calls_guesses_nothing(text):
    assert parse_calls(text, {"lookup"}) is None


# ---- the gateway path, against a scripted upstream ------------------------------------------

def vllm_reply(text: str, finish: str = "stop") -> dict[str, Any]:
    return {"id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "base",
            "prompt_token_ids": [1, 2, 3],
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text,
                                                 "tool_calls": []},
                         "logprobs": {"content": [{"token": "a", "logprob": -0.5},
                                                  {"token": "b", "logprob": -0.25}]},
                         "finish_reason": finish, "token_ids": [7, 8]}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}}


@pytest.fixture
def scripted(tmp_path):
    """A gateway whose engine is a scripted upstream; returns (gateway, sent bodies, replies)."""
    sent: list[dict[str, Any]] = []
    replies: list[dict[str, Any]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        sent.append(json.loads(request.content))
        return httpx.Response(200, json=replies.pop(0))

    gw = Gateway()
    gw.add_engine(VLLMEngine(str(tmp_path), served_name="base"))
    gw._client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    return gw, sent, replies


def asgi_client(gw: Gateway) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=gw.app), base_url="http://gw/v1")


async def test_openai_client_gets_tool_calls_and_ledger_keeps_tokens(scripted):
    import openai

    gw, sent, replies = scripted
    replies.append(vllm_reply(CALL))
    client = openai.AsyncOpenAI(base_url="http://gw/v1", api_key="x",
                                http_client=asgi_client(gw))
    r = await client.chat.completions.create(model="base", messages=[{"role": "user",
                                             "content": "Peru?"}], tools=[LOOKUP],
                                             tool_choice="required")
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("lookup",
                                                                        {"country": "Peru"})
    assert sent[0]["tool_choice"] == "none" and "structural_tag" in sent[0]["structured_outputs"]
    assert choice.model_extra["token_ids"] == [7, 8]  # untouched
    assert gw.ledger["chatcmpl-1"]["choices"][0]["token_ids"] == [7, 8]
    from art_core import Trajectory

    traj = Trajectory(messages=[{"role": "user", "content": "Peru?"}])
    msg = traj.add_completion(r)
    assert msg["tool_calls"][0]["function"]["arguments"] == '{"country": "Peru"}'
    assert traj.turns[0].completion_token_ids == [7, 8]


async def test_streaming_a_forced_call_arrives_whole(scripted):
    import openai

    gw, sent, replies = scripted
    replies.append(vllm_reply(CALL))
    client = openai.AsyncOpenAI(base_url="http://gw/v1", api_key="x",
                                http_client=asgi_client(gw))
    stream = await client.chat.completions.create(
        model="base", messages=[{"role": "user", "content": "Peru?"}], tools=[LOOKUP],
        tool_choice="required", stream=True, stream_options={"include_usage": True})
    chunks = [c async for c in stream]
    assert "stream" not in sent[0]
    calls = [tc for c in chunks for ch in c.choices for tc in (ch.delta.tool_calls or [])]
    assert [(tc.index, tc.function.name, tc.function.arguments) for tc in calls] == [
        (0, "lookup", '{"country": "Peru"}')]
    assert [ch.finish_reason for c in chunks for ch in c.choices] == [None, "tool_calls"]
    assert chunks[-1].usage.completion_tokens == 2 and chunks[0].model_extra["prompt_token_ids"]
    assert stream_chunks(vllm_reply("x"), False)[0]["choices"][0]["delta"]["id"] == "chatcmpl-1"


async def test_cut_off_forced_call_is_an_empty_answer_and_errors_are_openai_400s(scripted):
    gw, sent, replies = scripted
    replies.append(vllm_reply(CALL[:20], finish="length"))
    async with asgi_client(gw) as c:
        r = (await c.post("/chat/completions", json=body(model="base", tools=[LOOKUP],
                                                         tool_choice="required"))).json()
        # half a call is neither text the agent should read nor a call: an invalid action
        assert r["choices"][0]["finish_reason"] == "length"
        assert r["choices"][0]["message"]["content"] is None
        assert not r["choices"][0]["message"].get("tool_calls")
        assert r["choices"][0]["art_constrained_from"] == 0  # every token grammar-chosen
        bad = await c.post("/chat/completions", json=body(
            model="base", tools=[LOOKUP], tool_choice={"type": "function",
                                                       "function": {"name": "nope"}}))
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "tool_choice"
        # plain "auto" passes through untouched
        replies.append(vllm_reply("hello"))
        await c.post("/chat/completions", json=body(model="base", tools=[LOOKUP]))
        assert "structured_outputs" not in sent[-1] and "tool_choice" not in sent[-1]


async def test_langchain_chat_openai_and_tool_node_work_unchanged(scripted):
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI
    from langgraph.graph import END, START, MessagesState, StateGraph
    from langgraph.prebuilt import ToolNode

    @tool
    def lookup(country: str) -> str:
        """Look up the capital of a country."""
        return {"Peru": "Lima"}.get(country, "unknown")

    gw, sent, replies = scripted
    replies.append(vllm_reply(CALL))
    llm = ChatOpenAI(model="base", base_url="http://gw/v1", api_key="x",
                     http_async_client=asgi_client(gw))
    ai = await llm.bind_tools([lookup], tool_choice="lookup").ainvoke("Capital of Peru?")
    assert [(c["name"], c["args"]) for c in ai.tool_calls] == [("lookup", {"country": "Peru"})]
    assert sent[0]["tool_choice"] == "none"
    graph = StateGraph(MessagesState)
    graph.add_node("tools", ToolNode([lookup]))
    graph.add_edge(START, "tools")
    graph.add_edge("tools", END)
    out = await graph.compile().ainvoke({"messages": [ai]})
    assert out["messages"][-1].content == "Lima"


async def test_a_request_without_a_cap_gets_the_engines_default_and_a_cut_is_warned_once(
        scripted, caplog):
    gw, sent, replies = scripted
    replies.extend([vllm_reply("rambling", finish="length"), vllm_reply("again", finish="length"),
                    vllm_reply("short")])
    async with asgi_client(gw) as c:
        with caplog.at_level("WARNING", logger="art_core.inference.completions"):
            await c.post("/chat/completions", json=body(model="base"))
            await c.post("/chat/completions", json=body(model="base"))
        await c.post("/chat/completions", json=body(model="base", max_tokens=7))
    assert [s.get("max_tokens") for s in sent] == [1024, 1024, 7]  # EngineConfig default
    warned = [r for r in caplog.records if "default_max_tokens" in r.getMessage()]
    assert len(warned) == 1  # once per engine, not once per answer
