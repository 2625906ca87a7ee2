"""Loggers with the real SDKs: W&B in offline mode (its run file read back record by record),
Langfuse against a local receiver on 127.0.0.1 that captures what the SDK sends (OTLP spans,
scores), and loggers that fail (raise, unreachable, a server answering 500): training completes
with one warning. Training is real (tiny llama, real trainer); only vLLM is stood in for."""

from __future__ import annotations

import gzip
import json
import logging
import socket
import struct
import threading
import time
import zlib
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from art_core.observe.base import Logger, StepRecord, group_metrics
from art_core.observe.loggers import Loggers
from tests.support.runs import make_backend, train_steps

LOGGER = "art_core.observe.loggers"



# ---- W&B: read the offline run file (LevelDB-log framing of protobuf Records) -----------------

def wandb_records(path: Path) -> Iterator[Any]:
    """The `Record`s of a .wandb file: a 7-byte header (':W&B', magic 0xBEE1, version), then
    32 KiB blocks of chunks, each with a 7-byte header (crc, length, type full/first/mid/last).
    Every chunk's CRC (IEEE, over the type byte and the data) is checked, so a misread shows up
    as an assertion naming the offset, not as a protobuf error deep in a record."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, block, hdr = path.read_bytes(), 32768, 7
    ident, magic, _ = struct.unpack("<4sHB", data[:hdr])
    assert ident == b":W&B" and magic == 0xBEE1
    pos, buf = hdr, b""
    while pos + hdr <= len(data):
        left = block - pos % block
        if left < hdr:
            pos += left
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos:pos + hdr])
        if kind == 0 and length == 0:  # zero padding to the end of a block
            pos += left
            continue
        start = pos + hdr
        chunk, pos = data[start:start + length], start + length
        assert len(chunk) == length, f"{path}: chunk at {start - hdr} cut short ({len(data)} B)"
        assert zlib.crc32(bytes([kind]) + chunk) == crc, (
            f"{path}: chunk at {start - hdr} (type {kind}, {length} B) fails its CRC")
        if kind in (1, 2):
            buf = chunk
        else:
            buf += chunk
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(buf)
            yield record


def finished_records(run_dir: Path, deadline_s: float = 300.0) -> list[Any]:
    """The run file's records once its `exit` record is in. `run.finish()` returns when the W&B
    service has the exit; the file may still be written a moment later on a loaded machine
    (CI read a file with no history rows once). The deadline only bounds a hang."""
    (path,) = run_dir.glob("run-*.wandb")
    end = time.monotonic() + deadline_s
    while True:
        try:
            records = list(wandb_records(path))
        except AssertionError:  # a chunk still being written
            records = []
        if any(r.WhichOneof("record_type") == "exit" for r in records):
            return records
        if time.monotonic() > end:
            kinds = [r.WhichOneof("record_type") for r in records]
            raise AssertionError(f"{path}: no exit record after {deadline_s:.0f} s: {kinds}")
        time.sleep(0.2)


def wandb_history(run_dir: Path) -> list[dict[str, Any]]:
    rows = []
    for rec in finished_records(run_dir):
        if rec.WhichOneof("record_type") == "history":
            row = {i.key or "/".join(i.nested_key): json.loads(i.value_json)
                   for i in rec.history.item}
            rows.append(row)
    return rows


def sub(row: dict[str, Any], prefix: str) -> dict[str, Any]:
    """A media value of a history row (its fields are logged as '<key>/<field>')."""
    return {k[len(prefix) + 1:]: v for k, v in row.items() if k.startswith(prefix + "/")}


async def test_wandb_offline_run_holds_metrics_at_steps_and_trajectory_tables(
        tiny_models, tmp_path, monkeypatch) -> None:
    from art_core.observe.wandb_logger import WandbLogger

    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("ART_LOGGERS", "none")  # only the logger given here
    wandb = WandbLogger(project="art-test", dir=tmp_path / "wb", mode="offline",
                        log_checkpoints=True, init_timeout_s=300)  # the service starts slowly under load
    backend, model = await make_backend(tmp_path / "run", tiny_models["llama"], loggers=[wandb])
    # a loaded machine may need more than the default minute to hand both steps to W&B
    backend.loggers.close_timeout_s = 600
    metrics = await train_steps(backend, model, steps=2, val=True)
    await backend.close()  # finishes the W&B run
    assert backend.loggers.failures == {}
    assert wandb.runs == {}, "the loggers' close did not reach WandbLogger.close"

    (run_dir,) = (tmp_path / "wb" / "wandb").glob("offline-run-*-agent")  # id: the model name
    rows = wandb_history(run_dir)
    train = [r for r in rows if "train/reward_mean" in r]
    val = [r for r in rows if "val/reward_mean" in r]
    assert [r["training_step"] for r in train] == [1, 2], [sorted(r) for r in rows]
    assert [r["training_step"] for r in val] == [1, 2]
    for row, m in zip(train, metrics, strict=True):
        assert row["train/loss"] == pytest.approx(m["loss"])
        assert row["train/reward_mean"] == pytest.approx(0.3)
        assert row["train/ruler_score"] == pytest.approx(0.3)  # a trajectory metric's mean
        assert row["train/exceptions"] == 1
    assert val[0]["val/reward_mean"] == pytest.approx(0.5)

    table_ref = sub(train[1], "train/trajectories")
    assert table_ref["_type"] == "table-file" and table_ref["nrows"] == 5
    table = json.loads((run_dir / "files" / table_ref["path"]).read_text())
    cols = table["columns"]
    by_col = [dict(zip(cols, row, strict=True)) for row in table["data"]]
    assert [r["reward"] for r in by_col] == [1.0, 0.0, 0.5, 0.0, 0.0]
    assert {r["step"] for r in by_col} == {2}
    first = by_col[0]
    assert "[assistant]\n-> lookup(" in first["messages"]
    assert "It is 21 degrees in Paris." in first["messages"]
    assert json.loads(first["metrics"]) == {"tool_calls": 1, "ruler_score": 1.0}
    assert first["ruler"].endswith("Called the tool and answered with its result.")
    failed = sub(train[0], "train/failed_rollouts")  # a table of the group's exceptions
    assert failed["_type"] == "table-file" and failed["nrows"] == 1
    failed_rows = json.loads((run_dir / "files" / failed["path"]).read_text())["data"]
    assert failed_rows[0][2:4] == ["TimeoutError", "tool lookup timed out"]
    # checkpoints as artifacts: one per train step
    kinds = [r.WhichOneof("record_type") for r in finished_records(run_dir)]
    assert kinds.count("artifact") >= 2


# ---- Langfuse: a local receiver ---------------------------------------------------------------

class Receiver:
    """Captures what the Langfuse SDK sends: OTLP/HTTP spans (protobuf) and score batches.
    `fail=True` answers every request with 500."""

    def __init__(self, fail: bool = False) -> None:
        self.spans: list[dict[str, Any]] = []
        self.scores: list[dict[str, Any]] = []
        self.requests: list[str] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None: ...

            def _reply(self, status: int, body: bytes, ctype: str) -> None:
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:  # noqa: N802
                receiver.requests.append(f"GET {self.path}")
                if fail:
                    return self._reply(500, b'{"message": "boom"}', "application/json")
                if self.path.startswith("/api/public/projects"):
                    body = {"data": [{"id": "p1", "name": "art", "metadata": {},
                                      "organization": {"id": "o1", "name": "org"}}]}
                    return self._reply(200, json.dumps(body).encode(), "application/json")
                self._reply(404, b"{}", "application/json")

            def do_POST(self) -> None:  # noqa: N802
                receiver.requests.append(f"POST {self.path}")
                raw = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.headers.get("Content-Encoding") == "gzip":
                    raw = gzip.decompress(raw)
                if fail:
                    return self._reply(500, b'{"message": "boom"}', "application/json")
                if self.path == "/api/public/otel/v1/traces":
                    receiver.spans += otlp_spans(raw)
                    return self._reply(200, b"", "application/x-protobuf")
                if self.path == "/api/public/scores":
                    batch = json.loads(raw)
                    receiver.scores += batch
                    body = {"accepted": len(batch), "rejected": 0, "errors": []}
                    return self._reply(200, json.dumps(body).encode(), "application/json")
                self._reply(404, b"{}", "application/json")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def otlp_spans(raw: bytes) -> list[dict[str, Any]]:
    """Spans of an OTLP ExportTraceServiceRequest, as plain dicts."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
    )

    req = ExportTraceServiceRequest()
    req.ParseFromString(raw)
    out = []
    for rs in req.resource_spans:
        for ss in rs.scope_spans:
            for s in ss.spans:
                attrs = {}
                for kv in s.attributes:
                    v = kv.value
                    kind = v.WhichOneof("value")
                    attrs[kv.key] = [x.string_value for x in v.array_value.values] \
                        if kind == "array_value" else getattr(v, kind)
                out.append({"name": s.name, "trace_id": s.trace_id.hex(),
                            "span_id": s.span_id.hex(), "parent_id": s.parent_span_id.hex(),
                            "start": s.start_time_unix_nano / 1e9,
                            "end": s.end_time_unix_nano / 1e9, "scope": ss.scope.name,
                            "attrs": attrs})
    return out


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.close()


def _key(name: str) -> str:  # the SDK keeps one client per public key: a fresh key per test
    return f"pk-{name}-{time.monotonic_ns()}"


async def test_langfuse_traces_generations_tool_spans_and_scores(
        tiny_models, tmp_path, monkeypatch, receiver) -> None:
    from langfuse import Langfuse

    from art_core.observe.langfuse_logger import LangfuseLogger

    monkeypatch.setenv("ART_LOGGERS", "none")
    lf = LangfuseLogger(_key("ok"), "sk-test", receiver.url)
    backend, model = await make_backend(tmp_path / "run", tiny_models["llama"], loggers=[lf])
    await train_steps(backend, model, steps=1, val=False)
    await backend.close()  # flushes spans and scores
    assert backend.loggers.failures == {}

    attr = lambda s, k: s["attrs"].get(f"langfuse.{k}")  # noqa: E731
    roots = [s for s in receiver.spans if s["name"] == "rollout"]
    assert len(roots) == 5  # 5 trajectories in the step
    assert all(s["scope"] == "art_core" for s in receiver.spans)
    # the trace of the best Paris rollout: id from its first response id
    tid = Langfuse.create_trace_id(seed="demo/agent/r1-Paris-1.0")
    (root,) = [s for s in roots if s["trace_id"] == tid]
    assert attr(root, "trace.name") == "agent train rollout"
    assert attr(root, "trace.tags") == ["train", "demo"]
    assert json.loads(attr(root, "trace.metadata.step")) == 1
    assert json.loads(attr(root, "trace.metadata.city")) == "Paris"
    children = sorted((s for s in receiver.spans if s["trace_id"] == tid and s is not root),
                      key=lambda s: s["start"])
    assert all(s["parent_id"] == root["span_id"] for s in children)
    assert [attr(s, "observation.type") for s in children] == ["generation", "tool", "generation"]
    gen1, tool, gen2 = children
    assert attr(gen1, "observation.model.name") == "agent@0"
    usage = json.loads(attr(gen1, "observation.usage_details"))
    assert usage["output"] > 0 and usage["total"] == usage["input"] + usage["output"]
    assert [m["role"] for m in json.loads(attr(gen1, "observation.input"))] == ["system", "user"]
    assert json.loads(attr(gen1, "observation.output"))["tool_calls"][0]["id"] == "call_Paris"
    # recorded times: started_at 1_700_000_000.0 + step 0, latency 0.25 s; then 0.5 s later
    assert gen1["start"] == pytest.approx(1_700_000_000.0) and \
        gen1["end"] - gen1["start"] == pytest.approx(0.25)
    assert gen2["start"] == pytest.approx(1_700_000_000.5) and \
        gen2["end"] - gen2["start"] == pytest.approx(0.5)
    assert json.loads(attr(gen2, "observation.output"))["content"] == \
        "It is 21 degrees in Paris."
    assert tool["name"] == "lookup" and json.loads(attr(tool, "observation.input")) == \
        {"city": "Paris"}
    assert tool["start"] == pytest.approx(gen1["end"]) and \
        tool["end"] == pytest.approx(gen2["start"])
    assert root["start"] == pytest.approx(gen1["start"]) and \
        root["end"] == pytest.approx(gen2["end"])
    # the failed rollout of the group: an ERROR trace
    (failed,) = [s for s in receiver.spans if s["name"] == "rollout failed"]
    assert attr(failed, "observation.level") == "ERROR"
    assert "TimeoutError" in attr(failed, "observation.status_message")
    # scores: the reward of each trajectory on its trace, RULER's explanation as comment
    scores = {s["traceId"]: s for s in receiver.scores}
    assert set(scores) == {s["trace_id"] for s in roots}
    assert scores[tid]["name"] == "reward" and scores[tid]["value"] == 1.0
    assert scores[tid]["comment"].endswith("Called the tool and answered with its result.")
    assert sorted(s["value"] for s in receiver.scores) == [0.0, 0.0, 0.0, 0.5, 1.0]


# ---- failures: training goes on, one warning ----------------------------------------------------

class Exploding(Logger):
    name = "exploding"

    def __init__(self) -> None:
        self.calls = 0

    def log_step(self, record: StepRecord) -> None:
        self.calls += 1
        raise ConnectionError("the service is down")


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _failing_loggers(kind: str, tmp_path: Path) -> tuple[Logger, Any]:
    from art_core.observe.langfuse_logger import LangfuseLogger
    from art_core.observe.wandb_logger import WandbLogger

    if kind == "raises":
        return Exploding(), None
    if kind == "langfuse-unreachable":
        return LangfuseLogger(_key("down"), "sk", f"http://127.0.0.1:{_closed_port()}"), None
    if kind == "langfuse-500":
        r = Receiver(fail=True)
        return LangfuseLogger(_key("500"), "sk", r.url), r
    if kind == "wandb-unreachable":
        return WandbLogger(project="p", dir=tmp_path / "wb", mode="online",
                           init_timeout_s=5), None
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["raises", "langfuse-unreachable", "langfuse-500",
                                  "wandb-unreachable"])
async def test_failing_logger_training_completes_with_one_warning(
        kind, tiny_models, tmp_path, monkeypatch, caplog) -> None:
    monkeypatch.setenv("ART_LOGGERS", "none")
    # W&B online against a closed port with a well-formed key: its init fails
    monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{_closed_port()}")
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    logger, server = _failing_loggers(kind, tmp_path)
    backend, model = await make_backend(tmp_path / "run", tiny_models["llama"], loggers=[logger])
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        await train_steps(backend, model, steps=2, val=True)
        train_s = time.monotonic() - t0
        backend.loggers.flush(120)
        await backend.close()
    if server is not None:
        server.close()
    assert await model.get_step() == 2  # both steps trained and saved
    assert (backend.root / "demo/models/agent/checkpoints/0002").is_dir()
    warnings = [r for r in caplog.records if r.name == LOGGER]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    assert logger.name in warnings[0].getMessage()
    assert backend.loggers.failures.get(logger.name, 0) >= 1
    assert train_s < 60  # the logger's trouble runs in the background, not in the step
    if kind == "raises":
        assert logger.calls == 4 and backend.loggers.failures["exploding"] == 4


def test_group_metrics_counts_and_means() -> None:
    from art_core import Trajectory, TrajectoryGroup
    from art_core.trajectory import RolloutError

    g = TrajectoryGroup(trajectories=[Trajectory(reward=1.0, metrics={"tool_calls": 2}),
                                      Trajectory(reward=0.0, metrics={"tool_calls": 0})],
                        exceptions=[RolloutError(type="E", message="m", traceback="t")])
    m = group_metrics([g])
    assert m == {"groups": 1.0, "trajectories": 2.0, "exceptions": 1.0, "reward_mean": 0.5,
                 "reward_std": 0.5, "tool_calls": 1.0}


def test_env_turns_loggers_on_and_off(tmp_path) -> None:
    from art_core.observe.langfuse_logger import LangfuseLogger
    from art_core.observe.loggers import optional_loggers_from_env
    from art_core.observe.wandb_logger import WandbLogger

    assert optional_loggers_from_env({}) == []
    on = optional_loggers_from_env({"WANDB_API_KEY": "k", "WANDB_PROJECT": "p",
                                    "LANGFUSE_PUBLIC_KEY": "pk", "LANGFUSE_SECRET_KEY": "sk",
                                    "LANGFUSE_HOST": "http://127.0.0.1:1"})
    assert [type(x) for x in on] == [WandbLogger, LangfuseLogger]
    assert on[0].project == "p" and on[1].host == "http://127.0.0.1:1"
    assert [type(x) for x in optional_loggers_from_env({"WANDB_MODE": "offline"})] == \
        [WandbLogger]
    assert optional_loggers_from_env({"WANDB_API_KEY": "k", "ART_LOGGERS": "none"}) == []
    assert Loggers(tmp_path, from_env=False).optional == []


def test_import_art_core_loads_no_sdk() -> None:
    import subprocess
    import sys

    code = ("import sys, art_core, art_core.observe.loggers, art_core.backend.local; "
            "print(sorted(m for m in ('wandb', 'langfuse', 'opentelemetry') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env={"WANDB_MODE": "offline", "PATH": ""})
    assert out.stdout.strip() == "[]"


# ---- where the timing comes from: the gateway measures each model call -----------------------

async def test_gateway_records_start_and_latency_of_each_call(tmp_path) -> None:
    """A stand-in for vLLM's server answers after 0.2 s; the gateway's response and its ledger
    carry the call's start time and latency, and `add_completion` keeps them in the turn."""
    import httpx

    from art_core import Trajectory
    from art_core.inference.engine import VLLMEngine
    from art_core.inference.gateway import Gateway, ServedModel

    class Upstream(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None: ...

        def do_POST(self) -> None:  # noqa: N802
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            body = json.dumps({
                "id": "chatcmpl-1", "object": "chat.completion", "model": "m@0",
                "prompt_token_ids": [1, 2, 3], "created": 0,
                "choices": [{"index": 0, "finish_reason": "stop", "token_ids": [4, 5],
                             "message": {"role": "assistant", "content": "hi"},
                             "logprobs": {"content": [{"token": "h", "logprob": -0.1},
                                                      {"token": "i", "logprob": -0.2}]}}],
                "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}})
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body.encode())

    upstream = ThreadingHTTPServer(("127.0.0.1", 0), Upstream)
    threading.Thread(target=upstream.serve_forever, daemon=True).start()
    gw = Gateway()
    engine = VLLMEngine(str(tmp_path), served_name="base")
    engine.port = upstream.server_address[1]
    engine.adapters = {"m@0": str(tmp_path)}
    gw.add_engine(engine)
    gw.models["m"] = ServedModel("m", engine, checkpoints={0: tmp_path}, latest=0)
    try:
        before = time.time()
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=gw.app),
                                     base_url="http://gw") as client:
            r = await client.post("/v1/chat/completions", json={
                "model": "m", "messages": [{"role": "user", "content": "hello"}]})
        after = time.time()
    finally:
        upstream.shutdown()
        upstream.server_close()
        await gw.aclose()
    data = r.json()
    assert r.status_code == 200, data
    assert before <= data["art_started_at"] <= after
    # the latency is recorded, not bounded: how long a request takes is a benchmark's business
    assert isinstance(data["art_latency_s"], float) and data["art_latency_s"] > 0
    rec = gw.ledger["chatcmpl-1"]
    assert (rec["started_at"], rec["latency_s"]) == (data["art_started_at"], data["art_latency_s"])
    traj = Trajectory(messages=[{"role": "user", "content": "hello"}])
    traj.add_completion(data)
    assert traj.turns[0].started_at == data["art_started_at"]
    assert traj.turns[0].latency_s == data["art_latency_s"]
