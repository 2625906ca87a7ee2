"""The LangGraph recorder on real LangGraph graphs, a real ChatOpenAI, the real gateway and
vLLM. The tiny random llama's text is gibberish: structure and tokens are what is checked, with
greedy decoding where two runs are compared."""

from __future__ import annotations

import asyncio
import warnings
from typing import Any

import pytest
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langgraph.graph import END, START, MessagesState, StateGraph

from art_core import TrainableModel, Trajectory
from art_langgraph import (
    NoSampledTokensError,
    TrajectoryRecorder,
    init_chat_model,
    record,
)
from tests.support.engine import check_against_ledger, tiny_config

# ---- engine: real graphs through the real gateway ---------------------------------------------


@pytest.fixture(scope="module")
async def tiny(backend, tiny_models) -> TrainableModel:
    model = TrainableModel(name="lg-tiny", project="langgraph",
                           base_model=str(tiny_models["llama"]), config=tiny_config())
    await model.register(backend)
    return model


def agent_graph(llm: Any) -> Any:
    """agent -> summarizer (a separate conversation) -> agent again (continues the first)."""

    def agent(state: MessagesState) -> dict[str, Any]:
        return {"messages": [llm.invoke(state["messages"])]}

    async def summarize(state: MessagesState) -> dict[str, Any]:
        summary = await llm.ainvoke([("system", "Summarize."),
                                     ("user", str(state["messages"][-1].content))])
        return {"messages": [HumanMessage(f"Summary: {summary.content}. Go on.")]}

    async def agent_async(state: MessagesState) -> dict[str, Any]:
        return {"messages": [await llm.ainvoke(state["messages"])]}

    g = StateGraph(MessagesState)
    g.add_node("agent", agent)
    g.add_node("summarize", summarize)
    g.add_node("again", agent_async)
    g.add_edge(START, "agent")
    g.add_edge("agent", "summarize")
    g.add_edge("summarize", "again")
    g.add_edge("again", END)
    return g.compile()


def sync_agent_graph(llm: Any) -> Any:
    """The same shape with sync nodes only (for `invoke` / `stream`)."""

    def agent(state: MessagesState) -> dict[str, Any]:
        return {"messages": [llm.invoke(state["messages"])]}

    def summarize(state: MessagesState) -> dict[str, Any]:
        summary = llm.invoke([("system", "Summarize."),
                              ("user", str(state["messages"][-1].content))])
        return {"messages": [HumanMessage(f"Summary: {summary.content}. Go on.")]}

    g = StateGraph(MessagesState)
    g.add_node("agent", agent)
    g.add_node("summarize", summarize)
    g.add_node("again", agent)
    g.add_edge(START, "agent")
    g.add_edge("agent", "summarize")
    g.add_edge("summarize", "again")
    g.add_edge("again", END)
    return g.compile()


INPUT = {"messages": [("system", "You are terse."), ("user", "Name a color.")]}


def structure(traj: Trajectory) -> list[list[tuple[str, str | None]]]:
    return [[(m["role"], m.get("content")) for m in h.messages] for h in traj.histories()]


async def run_mode(mode: str, tiny: TrainableModel) -> Trajectory:
    llm = init_chat_model(tiny, max_tokens=6, temperature=0.0)
    rec = TrajectoryRecorder(tiny)
    cfg = {"callbacks": [rec]}
    if mode == "invoke":
        await asyncio.to_thread(sync_agent_graph(llm).invoke, INPUT, cfg)
        return await asyncio.to_thread(rec.finish)
    if mode == "stream":
        await asyncio.to_thread(lambda: list(sync_agent_graph(llm).stream(INPUT, cfg)))
        return await asyncio.to_thread(rec.finish)
    graph = agent_graph(llm)
    if mode == "ainvoke":
        await graph.ainvoke(INPUT, cfg)
    elif mode == "astream-messages":
        chunks = [c async for c in graph.astream(INPUT, cfg, stream_mode="messages")]
        assert len(chunks) > 3  # really streamed, token by token
    elif mode == "astream-events":
        events = [e async for e in graph.astream_events(INPUT, cfg, version="v2")]
        assert any(e["event"] == "on_chat_model_stream" for e in events)
    return await rec.afinish()


@pytest.mark.engine
async def test_every_mode_records_the_same_trajectory(tiny):
    reference = await run_mode("ainvoke", tiny)
    assert [m["role"] for m in reference.messages] == [
        "system", "user", "assistant", "user", "assistant"]
    assert len(reference.additional_histories) == 1  # the summarizer's own conversation
    assert check_against_ledger(reference, tiny.base_url) == 3
    for mode in ["invoke", "stream", "astream-messages", "astream-events"]:
        traj = await run_mode(mode, tiny)
        assert structure(traj) == structure(reference), mode
        assert [[t.completion_token_ids for t in h.turns] for h in traj.histories()] == [
            [t.completion_token_ids for t in h.turns] for h in reference.histories()], mode
        assert check_against_ledger(traj, tiny.base_url) == 3, mode


@pytest.mark.engine
async def test_sync_record_block_with_a_plain_chat_openai(tiny):
    """`with record()` around a sync `invoke`, the model a ChatOpenAI built by hand."""
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model=tiny.name, base_url=tiny.base_url, api_key="none", max_tokens=4)

    def run() -> Trajectory:
        with record(reward=lambda s: 1.0) as traj:
            sync_agent_graph(llm).invoke(INPUT)
        return traj

    traj = await asyncio.to_thread(run)
    assert [m["role"] for m in traj.messages] == [
        "system", "user", "assistant", "user", "assistant"]
    assert traj.reward == 1.0 and check_against_ledger(traj, tiny.base_url) == 3


@pytest.mark.engine
async def test_a_subgraph_is_recorded(tiny):
    llm = init_chat_model(tiny, max_tokens=4)

    def inner(state: MessagesState) -> dict[str, Any]:
        return {"messages": [llm.invoke(state["messages"])]}

    sub = StateGraph(MessagesState)
    sub.add_node("inner", inner)
    sub.add_edge(START, "inner")
    sub.add_edge("inner", END)
    outer = StateGraph(MessagesState)
    outer.add_node("sub", sub.compile())
    outer.add_node("after", inner)
    outer.add_edge(START, "sub")
    outer.add_edge("sub", "after")
    outer.add_edge("after", END)
    async with record(reward=lambda s: float(len(s["messages"]))) as traj:
        await outer.compile().ainvoke({"messages": [("user", "hi")]})
    assert [m["role"] for m in traj.messages] == ["user", "assistant", "assistant"]
    assert traj.reward == 3.0  # from the final state
    assert check_against_ledger(traj, tiny.base_url) == 2


@pytest.mark.engine
async def test_parallel_rollouts_under_record_never_mix(tiny):
    llm = init_chat_model(tiny, max_tokens=4)
    graph = agent_graph(llm)

    async def rollout(i: int) -> Trajectory:
        async with record() as traj:  # no callbacks argument: the configure hook
            await graph.ainvoke({"messages": [("user", f"rollout {i}")]})
        return traj

    trajs = await asyncio.gather(*(rollout(i) for i in range(8)))
    ids = set()
    for i, t in enumerate(trajs):
        assert t.messages[0]["content"] == f"rollout {i}"
        assert [m["role"] for m in t.messages] == ["user", "assistant", "user", "assistant"]
        assert len(t.additional_histories) == 1
        ids |= {turn.response_id for h in t.histories() for turn in h.turns}
    assert len(ids) == 8 * 3  # every call recorded once, in exactly one trajectory


@pytest.mark.engine
async def test_a_model_not_served_by_the_gateway_has_no_sampled_tokens(backend, tiny):
    from langchain_openai import ChatOpenAI

    engine = backend.gateway.models[tiny.name].engine  # vLLM itself, bypassing our gateway
    llm = ChatOpenAI(model=engine.served_name, base_url=engine.base_url + "/v1", api_key="x",
                     max_tokens=4)
    with pytest.raises(NoSampledTokensError, match=engine.served_name) as err:
        async with record():
            await llm.ainvoke("hi")
    assert "response id 'chatcmpl-" in str(err.value)
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        async with record(on_missing="context") as traj:
            await llm.ainvoke("hi")
    assert traj.turns == [] and traj.metrics["untrained_turns"] == 1
    assert not traj.trainable


@pytest.mark.engine
async def test_the_same_graph_trains_for_two_steps(backend, tiny_models):
    import art_core as art

    model = TrainableModel(name="lg-train", project="langgraph",
                           base_model=str(tiny_models["llama"]), config=tiny_config())
    await model.register(backend)
    graph = agent_graph(init_chat_model(model, max_tokens=6))

    def reward(state: dict[str, Any]) -> float:  # from the final state: longer last answer
        return float(len(str(state["messages"][-1].content)))

    async def rollout(question: str) -> Trajectory:
        async with record(reward=reward) as traj:
            await graph.ainvoke({"messages": [("user", question)]})
        return traj

    probe = [{"role": "user", "content": "probe"}]
    client = model.openai_client()
    before = await client.chat.completions.create(model=f"{model.name}@0", messages=probe,
                                                  max_tokens=4, temperature=0)
    for expected_step in (1, 2):
        groups = await art.gather_trajectory_groups(
            [rollout(q) for _ in range(4)] for q in ["a", "b"])
        result = await model.train(groups, art.TrainConfig(learning_rate=5e-2))
        assert result.step == expected_step
    after = await client.chat.completions.create(model=model.name, messages=probe,
                                                 max_tokens=4, temperature=0)
    assert after.model == f"{model.name}@2"  # the name now serves step 2
    old = [t.logprob for t in before.choices[0].logprobs.content]
    new = [t.logprob for t in after.choices[0].logprobs.content]
    assert old != new  # the served weights changed


# ---- a tool-calling agent on the embedded model ------------------------------------------------

CAPITALS = {"France": "Paris", "Japan": "Tokyo", "Peru": "Lima"}


def tool_agent(llm: Any, parallel: bool = False) -> Any:
    """A ReAct-style agent: model -> ToolNode -> model. Its first call must use a tool (strict
    tools, enforced by the gateway), the next may answer."""
    from langchain_core.tools import tool
    from langgraph.prebuilt import ToolNode

    @tool
    def lookup_capital(country: str) -> str:
        """Look up the capital city of a country."""
        return CAPITALS.get(country.strip(), f"unknown country: {country}")

    @tool
    def lookup_population(country: str) -> str:
        """Look up the population of a country, in millions."""
        return {"France": "68", "Japan": "124"}.get(country.strip(), "unknown")

    tools = [lookup_capital, lookup_population]
    first = llm.bind_tools(tools, tool_choice="required", parallel_tool_calls=parallel)
    then = llm.bind_tools(tools)

    def agent(state: MessagesState) -> dict[str, Any]:
        used = any(isinstance(m, ToolMessage) for m in state["messages"])
        return {"messages": [(then if used else first).invoke(state["messages"])]}

    def route(state: MessagesState) -> str:
        last, n_ai = state["messages"][-1], sum(
            isinstance(m, AIMessage) for m in state["messages"])
        return "tools" if getattr(last, "tool_calls", None) and n_ai < 3 else END

    g = StateGraph(MessagesState)
    g.add_node("agent", agent)
    g.add_node("tools", ToolNode(tools))
    g.add_edge(START, "agent")
    g.add_conditional_edges("agent", route, ["tools", END])
    g.add_edge("tools", "agent")
    return g.compile()


@pytest.fixture(scope="module")
async def smol(backend, smollm2_path) -> TrainableModel:
    model = TrainableModel(name="lg-smol", project="langgraph")
    await model.register(backend)
    return model


@pytest.mark.engine
@pytest.mark.parametrize(("question", "parallel"), [
    ("What is the capital of Peru?", False),
    ("What are the capitals of France and of Japan?", True)], ids=["one-call", "parallel"])
async def test_a_tool_calling_agent_records_calls_results_and_schemas(smol, question, parallel):
    graph = tool_agent(init_chat_model(smol, max_tokens=160, temperature=0.0), parallel)
    rec = TrajectoryRecorder(smol)
    state = await graph.ainvoke(
        {"messages": [("system", "Use the tools."), ("user", question)]},
        config={"callbacks": [rec]})
    traj = await rec.afinish()
    roles = [m["role"] for m in traj.messages]
    calls = traj.messages[2]["tool_calls"]
    assert roles[:3] == ["system", "user", "assistant"]
    assert len(calls) >= 2 if parallel else len(calls) == 1
    # every call answered by its own tool message, in the graph's order, then the next turn
    tool_msgs = traj.messages[3:3 + len(calls)]
    assert [m["tool_call_id"] for m in tool_msgs] == [c["id"] for c in calls]
    assert [m["content"] for m in tool_msgs] == [
        m.content for m in state["messages"] if isinstance(m, ToolMessage)][:len(calls)]
    assert {t["function"]["name"] for t in traj.tools} == {"lookup_capital", "lookup_population"}
    assert traj.tools[0]["function"]["parameters"]["properties"]["country"]["type"] == "string"
    assert check_against_ledger(traj, smol.base_url) == roles.count("assistant") >= 2
    first, second = traj.turns[0], traj.turns[1]
    # the next turn's prompt extends the first turn exactly: one training sequence
    assert second.prompt_token_ids[:len(first.prompt_token_ids)] == first.prompt_token_ids
