"""Token in, token out on the real engine: multi-turn tool agents recorded three ways (the plain
openai client, a LangGraph StateGraph + ToolNode, art_mcp.run_agent on the example server)
train as one sequence per conversation, on the tokens the engine sampled (the ledger's), with
the importance ratio at 1 on strict tool calls at step 0."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any

import pytest
from langchain_core.messages import AIMessage, ToolMessage
from langchain_core.tools import tool
from langgraph.graph import END, START, MessagesState, StateGraph  # at module level: LangGraph
from langgraph.prebuilt import ToolNode  # reads the node functions' type hints from globals

from art_core import TrainableModel, Trajectory, TrajectoryGroup
from art_core.train.batch import build_all_sequences
from art_langgraph import TrajectoryRecorder, init_chat_model
from tests.support.engine import check_against_ledger

pytestmark = pytest.mark.engine

ROOT = Path(__file__).resolve().parents[2]
CAPITALS = {"France": "Paris", "Japan": "Tokyo", "Peru": "Lima", "Chile": "Santiago"}
TOOLS = [{"type": "function", "function": {
    "name": "lookup_capital", "description": "Look up the capital city of a country.",
    "parameters": {"type": "object", "properties": {"country": {"type": "string",
                                                                "maxLength": 16}},
                   "required": ["country"], "additionalProperties": False}}}]
SYSTEM = "Use lookup_capital once per country, then answer."
QUESTION = "What are the capitals of Peru, Chile and Japan?"


@pytest.fixture(scope="module")
async def smol(backend, smollm2_path) -> TrainableModel:
    model = TrainableModel(name="turns-smol", project="turns")
    await model.register(backend)
    return model


def one_history(trajectory: Trajectory) -> dict[str, float]:
    _, metrics = build_all_sequences([(trajectory, 1.0)])
    return metrics


async def plain_client_agent(model: TrainableModel, seed: int) -> Trajectory:
    """Three forced calls, each answered, then a free answer: four model calls."""
    client = model.openai_client()
    traj = Trajectory(messages=[{"role": "system", "content": SYSTEM},
                                {"role": "user", "content": QUESTION}], tools=TOOLS)
    for turn in range(4):
        r = await client.chat.completions.create(
            model=model.name, messages=traj.messages, tools=TOOLS, max_tokens=48,
            tool_choice="required" if turn < 3 else "auto", temperature=1.0, seed=seed + turn)
        msg = traj.add_completion(r)
        for c in msg.get("tool_calls") or []:
            country = json.loads(c["function"]["arguments"]).get("country", "")
            traj.messages.append({"role": "tool", "tool_call_id": c["id"],
                                  "content": CAPITALS.get(country, "unknown")})
    return traj


MCP_TASKS = ("Add 5 pens to the stock, then move them to A3.", "Remove 2 pens from the stock.")


@pytest.fixture(scope="module")
async def agents(smol, tmp_path_factory) -> dict[str, list[Trajectory]]:
    """Two rollouts of each agent, all six in flight at once (the engine batches them); the
    tests below check each kind, the last trains all six."""
    workdir = tmp_path_factory.mktemp("mcp")
    makers = {"plain": lambda i: plain_client_agent(smol, seed=10 * i + 1),
              "langgraph": lambda i: langgraph_rollout(smol),
              "mcp": lambda i: mcp_rollout(smol, workdir / str(i), MCP_TASKS[i])}
    pairs = await asyncio.gather(*(asyncio.gather(make(0), make(1))
                                   for make in makers.values()))
    return {kind: list(pair) for kind, pair in zip(makers, pairs, strict=True)}


async def test_a_four_turn_agent_through_the_plain_client_is_one_sequence(smol, agents):
    traj = agents["plain"][0]
    assert check_against_ledger(traj, smol.base_url) == 4
    assert [t.spliced for t in traj.turns] == [False, True, True, True]
    assert all(t.constrained_from == 0 for t in traj.turns[:3])  # forced: all grammar-chosen
    metrics = one_history(traj)
    assert metrics["sequences_per_history"] == 1.0 and metrics["redundant_token_ratio"] == 1.0
    assert metrics["constrained_tokens"] == sum(len(t.completion_token_ids)
                                                for t in traj.turns[:3])


def langgraph_agent(model: TrainableModel) -> Any:
    @tool
    def lookup_capital(country: str) -> str:
        """Look up the capital city of a country."""
        return CAPITALS.get(country.strip(), f"unknown country: {country}")

    # a forced call at temperature 1 may ramble in its argument string: at 48 tokens both
    # rollouts' first calls were cut once in a fresh-clone CI (no tool_calls, the graph ended)
    forced = init_chat_model(model, max_tokens=160, temperature=1.0).bind_tools(
        [lookup_capital], tool_choice="required")
    free = init_chat_model(model, max_tokens=48, temperature=1.0).bind_tools([lookup_capital])

    def agent(state: MessagesState) -> dict[str, Any]:
        n_tools = sum(isinstance(m, ToolMessage) for m in state["messages"])
        return {"messages": [(forced if n_tools < 2 else free).invoke(state["messages"])]}

    def route(state: MessagesState) -> str:
        # at most three model turns, as the demo: at temperature 1 the free turn may keep
        # calling, and the graph would loop to LangGraph's recursion limit (seen in CI)
        turns = sum(isinstance(m, AIMessage) for m in state["messages"])
        calls = getattr(state["messages"][-1], "tool_calls", None)
        return "tools" if calls and turns < 3 else END

    g = StateGraph(MessagesState)
    g.add_node("agent", agent)
    g.add_node("tools", ToolNode([lookup_capital]))
    g.add_edge(START, "agent")
    g.add_conditional_edges("agent", route, ["tools", END])
    g.add_edge("tools", "agent")
    return g.compile()


async def langgraph_rollout(model: TrainableModel) -> Trajectory:
    rec = TrajectoryRecorder(model)
    await langgraph_agent(model).ainvoke(
        {"messages": [("system", SYSTEM), ("user", "Capitals of Peru and Chile?")]},
        config={"callbacks": [rec], "recursion_limit": 12})
    return await rec.afinish()


async def test_a_langgraph_tool_node_agent_is_one_sequence(smol, agents):
    # two forced calls and an answer, unless a call is cut at max_tokens (it then has no
    # tool_calls and the graph ends): the longer of the two rollouts has a tool result
    # between sampled turns
    traj = max(agents["langgraph"], key=lambda t: len(t.turns))
    n = check_against_ledger(traj, smol.base_url)
    assert n >= 2 and all(t.spliced for t in traj.turns[1:])
    metrics = one_history(traj)
    assert metrics["sequences_per_history"] == 1.0 and metrics["redundant_token_ratio"] == 1.0


async def mcp_rollout(model: TrainableModel, workdir: Path, task: str) -> Trajectory:
    from art_mcp import AgentConfig, ServerSpec, connect, run_agent

    spec = ServerSpec(command=[sys.executable, str(ROOT / "examples/mcp_server_inventory.py")])
    async with connect(spec, workdir=workdir) as session:
        return await run_agent(model, session, task, config=AgentConfig(max_turns=4))


async def test_run_agent_on_the_example_server_is_one_sequence(smol, agents):
    traj = agents["mcp"][0]
    assert check_against_ledger(traj, smol.base_url) == traj.metrics["turns"] >= 2
    metrics = one_history(traj)
    assert metrics["sequences_per_history"] == 1.0 and metrics["redundant_token_ratio"] == 1.0


async def test_the_three_agents_train_as_one_sequence_each_at_ratio_one(smol, agents):
    groups = []
    for pair in agents.values():
        for reward, t in zip((0.0, 1.0), pair, strict=True):
            t.reward = reward  # any two different rewards: the step must train both
        groups.append(TrajectoryGroup(trajectories=list(pair)))
    result = await smol.train(groups)
    m = result.metrics
    assert m["trajectories_kept"] == 6 and m["sequences_per_history"] == 1.0
    assert m["redundant_token_ratio"] == 1.0 and m["constrained_tokens"] > 0
    assert not [k for k in m if k.startswith("splits_")]
    # step 0: the sampler's adapter is the trainer's, free tokens agree as free text does
    assert abs(m["ratio_mean"] - 1) <= 0.05 and m["sampler_trainer_prob_diff"] <= 0.03
