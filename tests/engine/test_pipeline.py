"""The pipelined trainer on the real engine (tiny random llama): what a pipeline needs of the
gateway and the backend, and the three ways in.
- collocated: a request sent while a step trains waits at the gate and is answered by the new
  step; dedicated (keep_serving): it is answered at once by the previous step;
- a conversation that spans a swap keeps its earlier tokens (token in), continues on the new
  step, and trains as one sequence with each turn's own step and logprobs;
- PipelineTrainer runs a plain rollout with a slow tool, a LangGraph graph recorded by
  TrajectoryRecorder, and art_mcp's run_agent on a real MCP server (stdio);
`art serve` + RemoteBackend: tests/engine/test_server.py. Without an engine (staleness,
resume after a kill): tests/unit/test_pipeline.py.
"""

from __future__ import annotations

import asyncio
import random
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from art_core import PipelineTrainer, TrainableModel, TrainConfig, Trajectory
from art_core.gather import gather_trajectory_groups
from art_core.train import batch as B
from tests.support.engine import rollout as numbered_rollout
from tests.support.engine import tiny_config

pytestmark = pytest.mark.engine

ROOT = Path(__file__).resolve().parents[2]
CONFIG = TrainConfig(learning_rate=1e-2, bf16=False)
MSG = [{"role": "user", "content": "Count to three."}]


@pytest.fixture(scope="module")
async def tiny(backend, tiny_models) -> TrainableModel:
    model = TrainableModel(name="pipe-tiny", project="pipeline",
                           base_model=str(tiny_models["llama"]), config=tiny_config())
    await model.register(backend)
    return model


def journaled(backend: Any, model: TrainableModel, step: int) -> list[Any]:
    from art_core.storage import ModelDir

    return ModelDir(backend.root, model.project, model.name).journaled(step)


async def groups_of(model: TrainableModel) -> list[Any]:
    return await gather_trajectory_groups(
        [[numbered_rollout(model, i) for i in range(3)]], show_progress=False)


@pytest.mark.parametrize("keep_serving", [False, True], ids=["collocated", "dedicated"])
async def test_requests_during_a_step_wait_or_are_served_by_the_previous_step(
        tiny, backend, keep_serving):
    client = tiny.openai_client()
    before = await tiny.get_step()
    groups = await groups_of(tiny)
    release = threading.Event()
    blocker = backend.trainers.submit(release.wait, 120)  # the torch thread: busy until set
    phases: list[str] = []
    step = asyncio.ensure_future(backend.train(
        tiny, groups, CONFIG, keep_serving=keep_serving,
        progress=lambda e: phases.append(e["phase"])))
    try:
        while "journaled" not in phases:
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.5)  # collocated: the gate is closed by now
        request = asyncio.ensure_future(client.chat.completions.create(
            model=tiny.name, messages=MSG, max_tokens=4))
        done, _ = await asyncio.wait([request], timeout=5)
        if keep_serving:
            assert done, "dedicated: the previous step keeps serving during the step"
            assert request.result().model_extra["art_step"] == before and not step.done()
        else:
            assert not done, "collocated: a request waits while the step trains"
    finally:
        release.set()
    result = await asyncio.wait_for(step, 120)
    blocker.result()
    answer = await asyncio.wait_for(request, 60)
    assert result.step == before + 1
    if not keep_serving:  # it waited for the swap, so the new step answered it
        assert answer.model_extra["art_step"] == result.step
    order = ["trained", "paused"] if keep_serving else ["paused", "trained"]
    assert [p for p in phases if p in order] == order  # dedicated: held only for the swap
    after = await client.chat.completions.create(model=tiny.name, messages=MSG, max_tokens=2)
    assert after.model_extra["art_step"] == result.step


async def test_a_conversation_spanning_a_swap_continues_on_the_new_step(tiny):
    client = tiny.openai_client()
    traj = Trajectory(messages=list(MSG))
    first = await client.chat.completions.create(model=tiny.name, messages=traj.messages,
                                                 max_tokens=6, temperature=1.0)
    traj.add_completion(first)
    k = first.model_extra["art_step"]
    trained = await tiny.train(await groups_of(tiny), CONFIG)  # the swap, mid-conversation
    assert trained.step == k + 1
    traj.messages.append({"role": "user", "content": "And then?"})
    second = await client.chat.completions.create(model=tiny.name, messages=traj.messages,
                                                  max_tokens=6, temperature=1.0)
    traj.add_completion(second)
    a, b = traj.turns
    assert (a.step, b.step) == (k, k + 1)
    assert b.spliced  # token in: the earlier turn's ids, not a re-rendering of its text
    assert b.prompt_token_ids[:len(a.prompt_token_ids) + len(a.completion_token_ids)] == \
        a.prompt_token_ids + a.completion_token_ids
    (seq,) = B.build_sequences(traj, 1.0, 0)  # one sequence across the swap
    sampled = [x for x, m in zip(seq.old_logprobs, seq.mask, strict=True) if m]
    assert sampled == a.logprobs + b.logprobs  # each turn with its own sampler's logprobs


async def test_a_plain_rollout_with_a_slow_tool_pipelines(tiny, tmp_path):
    """Two model calls with a tool of random latency between them; groups carry over."""
    client = tiny.openai_client()

    async def rollout(topic: str) -> Trajectory:
        traj = Trajectory(messages=[{"role": "user", "content": f"Tell me about {topic}."}])
        r = await client.chat.completions.create(model=tiny.name, messages=traj.messages,
                                                 max_tokens=4, temperature=1.0)
        traj.add_completion(r)
        await asyncio.sleep(random.uniform(0.1, 1.0))  # a slow tool
        traj.messages.append({"role": "user", "content": "More."})
        r = await client.chat.completions.create(model=tiny.name, messages=traj.messages,
                                                 max_tokens=4, temperature=1.0)
        traj.add_completion(r)
        traj.reward = float(len(r.choices[0].message.content or ""))
        return traj

    start = await tiny.get_step()
    result = await PipelineTrainer(
        tiny, rollout, ["cats", "dogs", "owls"], run_dir=tmp_path, groups_per_step=2,
        rollouts_per_group=2, train_config=CONFIG, show_progress=False,
        print_fn=lambda line: None).run(3)
    assert [r["step"] for r in result.steps] == [start + 1, start + 2, start + 3]
    assert all(r["off_policy_steps_max"] <= 1 for r in result.steps)
    assert await tiny.get_step() == start + 3


async def test_a_langgraph_agent_pipelines(tiny, tmp_path):
    from langgraph.graph import END, START, MessagesState, StateGraph

    from art_langgraph import TrajectoryRecorder, init_chat_model

    llm = init_chat_model(tiny, max_tokens=4, temperature=1.0)

    async def agent(state: MessagesState) -> dict[str, Any]:
        return {"messages": [await llm.ainvoke(state["messages"])]}

    g = StateGraph(MessagesState)
    g.add_node("agent", agent)
    g.add_edge(START, "agent")
    g.add_edge("agent", END)
    graph = g.compile()

    async def rollout(topic: str) -> Trajectory:
        recorder = TrajectoryRecorder(
            reward=lambda state: float(len(str(state["messages"][-1].content))))
        await graph.ainvoke({"messages": [("user", f"A word about {topic}?")]},
                            config={"callbacks": [recorder]})
        return await recorder.afinish()

    start = await tiny.get_step()
    result = await PipelineTrainer(
        tiny, rollout, ["sun", "moon"], run_dir=tmp_path, groups_per_step=1,
        rollouts_per_group=3, train_config=CONFIG, show_progress=False,
        print_fn=lambda line: None).run(2)
    assert [r["step"] for r in result.steps] == [start + 1, start + 2]


@pytest.mark.nightly  # ~37 s; the pipeline with a plain and a LangGraph rollout stays in CI,
# run_agent's trajectories train one sequence each (test_turns), ruler.hook as after_each is
# tests/unit/test_ruler.py and the SmolLM2 judge test_ruler_judge.py
async def test_an_mcp_agent_pipelines_scored_by_ruler(backend, smollm2_path, tmp_path):
    """On SmolLM2 (the agent's prompt, with the server's tools, is longer than the tiny
    model's context), rewards from RULER as each group completes, the base model judging."""
    import ruler
    from art_mcp import AgentConfig, ServerSpec, connect, run_agent

    smol = TrainableModel(name="pipe-mcp", project="pipeline")
    await smol.register(backend)

    server = ServerSpec(command=[sys.executable, str(ROOT / "examples/mcp_server_inventory.py")])

    async def rollout(task: str) -> Trajectory:
        workdir = tmp_path / f"w{random.randrange(10**9)}"
        workdir.mkdir()
        async with connect(server, workdir=workdir) as session:
            traj = await run_agent(smol, session, task,
                                   config=AgentConfig(max_turns=2, max_tokens=48))
        return traj

    judge = ruler.hook(f"openai/{smol.base_model}", api_base=smol.base_url, api_key="none",
                       cache_dir=tmp_path / "ruler", timeout=120)

    start = await smol.get_step()
    result = await PipelineTrainer(
        smol, rollout, ["Add 5 pens to the stock.", "Move the glue to shelf A3."],
        run_dir=tmp_path / "pipe", groups_per_step=1, rollouts_per_group=2, after_each=judge,
        train_config=CONFIG, show_progress=False, print_fn=lambda line: None).run(1)
    assert [r["step"] for r in result.steps] == [start + 1]
    (group,) = journaled(backend, smol, start + 1)
    assert all("ruler_score" in t.metrics for t in group.trajectories)
