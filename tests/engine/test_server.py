"""`art serve` and `RemoteBackend` with a real engine (all marked `engine`).

`served`: a real `art serve` subprocess on 127.0.0.1 with an API key, serving the tiny random
llama on vLLM: register, rollouts through the served OpenAI API, training steps, a client that
disconnects mid-step, two clients training one model, and SIGTERM during a step.
The same server without an engine (auth, limits, bad input): test_server.py.
Clients use only `RemoteBackend`, the OpenAI client and raw HTTP.
"""

from __future__ import annotations

import asyncio
import json
import math
import secrets
import signal
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest

from art_core import TrainableModel, TrainConfig, Trajectory, TrajectoryGroup
from art_core.backend.remote import RemoteBackend, RemoteBackendError
from art_core.protocol import TRAIN_PHASES
from tests.support.server import (
    KEY,
    MSG,
    Server,
    alive,
    auth,
    descendants,
    snapshot,
    start_server,
    trajectory_json,
)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, tiny_models) -> Iterator[Server]:
    server = start_server(tmp_path_factory.mktemp("served") / "run")
    yield server
    server.stop()


@pytest.fixture(scope="module")
async def remote(served) -> AsyncIterator[RemoteBackend]:
    backend = RemoteBackend(served.url, api_key=KEY)
    yield backend
    await backend.close()


@pytest.fixture(scope="module")
async def model(remote, tiny_models) -> TrainableModel:
    from tests.support.engine import tiny_config

    m = TrainableModel(name="srv-tiny", project="server", base_model=str(tiny_models["llama"]),
                       config=tiny_config())
    await m.register(remote)
    return m


def buildtrajectory_json(messages: list[dict[str, Any]], response: Any, reward: float) -> Trajectory:
    t = Trajectory(messages=list(messages), reward=reward)
    t.add_completion(response)  # the assistant message + its exact sampled tokens
    return t


async def rollout_group(model: TrainableModel, n: int = 4, served_name: str | None = None
                        ) -> TrajectoryGroup:
    client = model.openai_client()

    async def one(i: int) -> Trajectory:
        msgs = [{"role": "user", "content": f"Count to {i + 1}."}]
        r = await client.chat.completions.create(model=served_name or model.name,
                                                 messages=msgs, max_tokens=8, temperature=1.0)
        return buildtrajectory_json(msgs, r, reward=float(i))  # distinct rewards: a signal

    return TrajectoryGroup(trajectories=list(await asyncio.gather(*(one(i) for i in range(n)))))


def no_tmp_left(served: Server, model: TrainableModel) -> bool:
    cps = served.root / model.project / "models" / model.name / "checkpoints"
    return not [p for p in cps.iterdir() if p.name.startswith(".tmp")]


@pytest.mark.engine
async def test_register_rollout_train_serve_download(served, remote, model, tmp_path):
    assert model.base_url == served.url + "/v1" and model.api_key == KEY
    assert await remote.get_step(model) == 0
    group = await rollout_group(model)
    assert all(t.turns[0].step == 0 for t in group)
    phases: list[str] = []
    result = await model.train([group], TrainConfig(learning_rate=1e-3))
    assert result.step == 1 and math.isfinite(result.metrics["loss"])
    assert result.metrics["trajectories_kept"] == 4
    assert await remote.get_step(model) == 1

    client = model.openai_client()
    for name in (f"{model.name}@1", model.name):
        r = await client.chat.completions.create(model=name, messages=MSG, max_tokens=2)
        assert r.model == f"{model.name}@1" and r.model_extra["art_step"] == 1
    ids = {m.id for m in (await client.models.list()).data}
    assert {model.name, f"{model.name}@0", f"{model.name}@1"} <= ids

    # progress events, as the bar sees them, on a second step
    result = await remote.train(model, [await rollout_group(model)],
                                TrainConfig(learning_rate=1e-3),
                                progress=lambda e: phases.append(e["phase"]))
    assert result.step == 2 and phases == list(TRAIN_PHASES)
    md = served.root / "server" / "models" / model.name
    records = [json.loads((md / "checkpoints" / f"{s:04d}" / "step.json").read_text())
               for s in (1, 2)]  # what a retry after a restart finds: committed with the step
    assert [r["step"] for r in records] == [1, 2] and all(r["request_id"] for r in records)
    assert (md / "checkpoints" / "0002" / "optimizer.safetensors").exists()
    assert not (md / "checkpoints" / "0001" / "optimizer.safetensors").exists()

    cps = await remote.list_checkpoints(model)
    assert [c.step for c in cps] == [0, 1, 2] and "reward_mean" in cps[1].metrics
    dest = await remote.download_checkpoint(model, 1, tmp_path / "step1")
    names = {p.name for p in dest.iterdir()}  # the peft adapter, not the training state
    assert {"adapter_config.json", "adapter_model.safetensors"} <= names
    assert not names & {"optimizer.safetensors", "step.json"}
    src = served.root / "server" / "models" / model.name / "checkpoints" / "0001"
    assert (dest / "adapter_model.safetensors").read_bytes() == \
        (src / "adapter_model.safetensors").read_bytes()
    assert no_tmp_left(served, model)

    # validation groups through RemoteBackend, as with LocalBackend: in the run dir at the step
    await model.log([await rollout_group(model)], split="val")
    rows = (md / "val" / "history.jsonl").read_text().splitlines()
    assert json.loads(rows[-1])["step"] == 2
    with pytest.raises(RemoteBackendError):
        await remote._call("POST", remote._path(model, "log"), json={"groups": [], "x": 1})



@pytest.mark.engine
async def test_an_unchanged_langgraph_graph_trains_through_the_server(served, remote, tiny_models):
    """Zero-change capture against `art serve`: the recorder reads the ledger over HTTP with
    the key the model was registered with (no key passed to the recorder)."""
    from langgraph.graph import END, START, MessagesState, StateGraph

    from art_core import gather_trajectory_groups
    from art_langgraph import init_chat_model, record
    from tests.support.engine import tiny_config

    model = TrainableModel(name="srv-lg", project="server", base_model=str(tiny_models["llama"]),
                           config=tiny_config())
    await model.register(remote)
    llm = init_chat_model(model, max_tokens=6)

    async def agent(state: MessagesState) -> dict[str, Any]:
        return {"messages": [await llm.ainvoke(state["messages"])]}

    g = StateGraph(MessagesState)
    g.add_node("agent", agent)
    g.add_edge(START, "agent")
    g.add_edge("agent", END)
    graph = g.compile()

    async def rollout(q: str) -> Trajectory:
        async with record(reward=lambda s: float(len(str(s["messages"][-1].content)))) as t:
            await graph.ainvoke({"messages": [("user", q)]})
        return t

    for step in (1, 2):
        groups = await gather_trajectory_groups([rollout(q) for _ in range(4)] for q in "ab")
        assert all(t.turns[0].step == step - 1 for g in groups for t in g)
        assert (await model.train(groups, TrainConfig(learning_rate=1e-2))).step == step
    r = await model.openai_client().chat.completions.create(
        model=model.name, messages=MSG, max_tokens=2)
    assert r.model == f"{model.name}@2"

BAD_FOR_THE_MODEL = [
    ("token-out-of-vocab", {"groups": [{"trajectories": [
        dict(trajectory_json(), turns=[dict(trajectory_json()["turns"][0],
                                        completion_token_ids=[4, 10**6])])]}]}, "vocabulary"),
    ("untrainable", {"groups": [{"trajectories": [trajectory_json(turns=False)]}]},
     "no sampled turn"),
    ("empty-groups", {"groups": []}, "non-empty list"),
    # a sequence longer than the trainer's limit: refused before the journal, not after a
    # 40 GB attention mask
    ("too-long", {"groups": [{"trajectories": [
        dict(trajectory_json(), turns=[dict(trajectory_json()["turns"][0],
                                        prompt_token_ids=list(range(1, 40)))])]}],
        "config": {"max_sequence_tokens": 16}},
     "groups[0].trajectories[0] has a sequence of 41 tokens, longer than the trainer's limit"),
    ("nan-reward", {"groups": [{"trajectories": [trajectory_json(reward=float("nan"))]}]},
     "finite"),
]


@pytest.mark.engine
@pytest.mark.parametrize(("case", "payload", "needle"), BAD_FOR_THE_MODEL,
                         ids=[c for c, _, _ in BAD_FOR_THE_MODEL])
async def test_bad_groups_for_a_registered_model(served, model, case, payload, needle):
    before = snapshot(served.root)
    async with httpx.AsyncClient() as c:
        r = await c.post(f"{served.url}/art/v1/models/server/{model.name}/train",
                         content=json.dumps(payload),  # allows NaN, which a client may send
                         headers={**auth(), "Content-Type": "application/json"})
    assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text
    assert snapshot(served.root) == before  # nothing journaled, no step started


@pytest.mark.engine
async def test_client_disconnect_mid_step_leaves_a_consistent_step(served, remote, model):
    before = await remote.get_step(model)
    group = await rollout_group(model)
    body = {"groups": [group.model_dump(mode="json")], "config": {"learning_rate": 1e-3}}
    async with httpx.AsyncClient(timeout=60) as c, c.stream(
            "POST", f"{served.url}/art/v1/models/server/{model.name}/train", json=body,
            headers=auth()) as r:
        assert r.status_code == 200
        first = json.loads(await r.aiter_lines().__anext__())
        assert first["event"] == "accepted"
        # leaving the block closes the connection mid-step
    deadline = time.monotonic() + 120
    while await remote.get_step(model) != before + 1:
        assert time.monotonic() < deadline, served.log_tail()
        await asyncio.sleep(0.25)
    async with httpx.AsyncClient(timeout=30) as c:
        job = (await c.get(f"{served.url}/art/v1/jobs/{first['job']}", headers=auth())).json()
    while job["status"] not in ("done", "failed"):
        await asyncio.sleep(0.25)
        async with httpx.AsyncClient(timeout=30) as c:
            job = (await c.get(f"{served.url}/art/v1/jobs/{first['job']}",
                               headers=auth())).json()
    assert job["status"] == "done" and job["result"]["step"] == before + 1
    assert no_tmp_left(served, model)
    r = await model.openai_client().chat.completions.create(model=model.name, messages=MSG,
                                                            max_tokens=2)
    assert r.model_extra["art_step"] == before + 1


@pytest.mark.engine
async def test_two_clients_training_one_model_are_serialized(served, model, tiny_models):
    before_clients = [RemoteBackend(served.url, api_key=KEY) for _ in range(2)]
    models = []
    for b in before_clients:  # each client registers its own copy of the model
        m = TrainableModel(name=model.name, project=model.project, base_model=model.base_model,
                           config=model.config)
        await m.register(b)
        models.append(m)
    before = await models[0].get_step()
    groups = [await rollout_group(m) for m in models]
    results = await asyncio.gather(*(m.train([g], TrainConfig(learning_rate=1e-3))
                                     for m, g in zip(models, groups, strict=True)))
    assert sorted(r.step for r in results) == [before + 1, before + 2]
    assert await models[1].get_step() == before + 2
    for b in before_clients:
        await b.close()


@pytest.mark.engine
async def test_retried_request_id_reattaches_instead_of_training_twice(served, remote, model):
    before = await remote.get_step(model)
    group = await rollout_group(model)
    body = {"groups": [group.model_dump(mode="json")], "config": {"learning_rate": 1e-3},
            "request_id": "retry-" + secrets.token_hex(4)}
    url = f"{served.url}/art/v1/models/server/{model.name}/train"
    async with httpx.AsyncClient(timeout=120) as c:
        async with c.stream("POST", url, json=body, headers=auth()) as r:
            job = json.loads(await r.aiter_lines().__anext__())["job"]
        r = await c.post(url, json=body, headers=auth())  # the same request again
    events = [json.loads(x) for x in r.text.splitlines()]
    assert events[0] == {**events[0], "event": "accepted", "job": job}
    assert events[-1]["event"] == "result" and events[-1]["step"] == before + 1
    assert await remote.get_step(model) == before + 1


@pytest.mark.engine
async def test_one_request_id_posted_twice_at_once_trains_one_step(served, remote, model):
    before = await remote.get_step(model)
    group = await rollout_group(model)
    body = {"groups": [group.model_dump(mode="json")], "config": {"learning_rate": 1e-3},
            "request_id": "twice-" + secrets.token_hex(4)}
    url = f"{served.url}/art/v1/models/server/{model.name}/train"
    async with httpx.AsyncClient(timeout=120) as c:
        answers = await asyncio.gather(*(c.post(url, json=body, headers=auth())
                                         for _ in range(2)))
    results = [[json.loads(x) for x in r.text.splitlines()][-1] for r in answers]
    assert [r["step"] for r in results] == [before + 1, before + 1], results
    assert await remote.get_step(model) == before + 1


@pytest.mark.engine
async def test_a_pipeline_trains_through_the_server(served, remote, model, tmp_path):
    """PipelineTrainer over RemoteBackend; its last step request, sent again with the same
    id (a restarted pipeline), is answered with the committed step, not trained twice."""
    from art_core import PipelineTrainer
    from art_core.pipeline.store import PipelineStore
    from tests.support.engine import rollout

    before = await remote.get_step(model)
    result = await PipelineTrainer(
        model, lambda i: rollout(model, i), [0, 1, 2], run_dir=tmp_path, groups_per_step=1,
        rollouts_per_group=3, train_config=TrainConfig(learning_rate=1e-3),
        show_progress=False, print_fn=lambda line: None).run(2)
    assert [r["step"] for r in result.steps] == [before + 1, before + 2]
    assert all("off_policy_steps_max" in r for r in result.steps)
    last = [e for e in PipelineStore(tmp_path).events() if e["event"] == "train"][-1]
    again = await remote.train(model, [await rollout_group(model)],
                               request_id=last["request_id"])
    assert again.step == before + 2 and await remote.get_step(model) == before + 2


@pytest.mark.engine
async def test_sft_trains_through_the_server_and_a_retried_id_is_not_trained_twice(
        served, remote, model):
    """RemoteBackend.train_sft: a supervised step on the server, kind "sft" in its history;
    the same request id again gets that step back."""
    from art_core import SFTConfig

    data = [{"messages": [{"role": "user", "content": "Say hi."},
                          {"role": "assistant", "content": "hi there"}]}] * 2
    before = await remote.get_step(model)
    config = SFTConfig(epochs=1, bf16=False)
    r = await remote.train_sft(model, data, config, request_id="sft-once")
    assert r.step == before + 1 and r.metrics["examples"] == 2
    again = await remote.train_sft(model, data, config, request_id="sft-once")
    assert again.step == r.step and await remote.get_step(model) == r.step
    rows = [json.loads(x) for x in (served.root / model.project / "models" / model.name /
                                    "history.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == r.step and rows[-1]["kind"] == "sft"


@pytest.mark.engine
async def test_delete_checkpoints_unserves_deleted_steps(served, remote, model):
    latest = await remote.get_step(model)
    deleted = await remote.delete_checkpoints(model)
    kept = [c.step for c in await remote.list_checkpoints(model)]
    assert latest in kept and not set(deleted) & set(kept) and deleted
    client = model.openai_client()
    import openai

    with pytest.raises(openai.NotFoundError):
        await client.chat.completions.create(model=f"{model.name}@{deleted[0]}", messages=MSG,
                                             max_tokens=2)
    r = await client.chat.completions.create(model=model.name, messages=MSG, max_tokens=2)
    assert r.model_extra["art_step"] == latest


@pytest.mark.engine
async def test_sigterm_during_a_step_finishes_it_and_stops_vllm(served, model):
    """Last test of the module: it stops the shared server."""
    before = max(int(p.name) for p in (served.root / "server" / "models" / model.name /
                                       "checkpoints").iterdir() if p.name.isdigit())
    children = descendants(served.proc.pid)
    assert children, "vLLM should be a child of the server"
    group = await rollout_group(model)
    body = {"groups": [group.model_dump(mode="json")], "config": {"learning_rate": 1e-3}}
    events = []
    async with httpx.AsyncClient(timeout=120) as c, c.stream(
            "POST", f"{served.url}/art/v1/models/server/{model.name}/train", json=body,
            headers=auth()) as r:
        async for line in r.aiter_lines():
            events.append(json.loads(line))
            if len(events) == 1:
                served.proc.send_signal(signal.SIGTERM)
    assert events[-1]["event"] == "result" and events[-1]["step"] == before + 1, events
    served.proc.wait(90)
    assert served.proc.returncode in (0, -signal.SIGTERM), served.log_tail()
    deadline = time.monotonic() + 20
    while any(alive(p) for p in children) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(alive(p) for p in children), "vLLM outlived the server"
    assert no_tmp_left(served, model)
    log = served.log.read_text()
    assert "Traceback" not in log, served.log_tail()

