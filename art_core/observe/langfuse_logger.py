"""Langfuse logger: each rollout a trace, each model call a generation, each tool call a span,
the reward a score.

Langfuse's SDK (v3+) sends OpenTelemetry spans. Its high-level API stamps a span's start with
the time it is called, but a trajectory is logged after the rollout, so this logger builds the
spans itself on a private OTel `TracerProvider` handed to `Langfuse(tracer_provider=...)`, with
the times the gateway recorded (`SampledTurn.started_at`, `latency_s`) and Langfuse's public
attribute names (`LangfuseOtelSpanAttributes`). Nothing here touches the global OTel provider.

- trace: id `Langfuse.create_trace_id(seed=...)` (stable for a rollout: its first response id,
  else its place in the step), name "<model> <split> rollout", tags [split, project], metadata
  (step, group, trajectory, the trajectory's metadata). Root span from the first model call's
  start to the last one's end.
- generation per sampled assistant turn: model "<name>@<step>", input = the messages before it,
  output = the message, usage {input, output, total} tokens, start and end as recorded.
- span (type "tool") per tool result: the call's name and arguments, the result. Per-call
  timing is not recorded in a trajectory: the span covers the interval between the model call
  that made it and the next model call (metadata "timing": "between model calls").
- score "reward" on the trace, with RULER's explanation as its comment.
- a failed rollout (a group's exception) is a trace of level ERROR with its traceback.

The first step checks the keys and the server (`auth_check`): unreachable, a bad key or a
server error raises there, `Loggers` warns once, and this logger sends nothing more.
"""

from __future__ import annotations

import json
import time
from typing import Any

from art_core.observe.base import Logger, StepRecord
from art_core.trajectory import History, Trajectory


def _ns(seconds: float | None) -> int | None:
    return None if seconds is None else int(seconds * 1e9)


class LangfuseLogger(Logger):
    """Logs rollouts to Langfuse (see the module docstring)."""

    name = "langfuse"
    SCOPE = "art_core"

    def __init__(self, public_key: str, secret_key: str, host: str | None = None, *,
                 environment: str | None = None, timeout_s: int = 10) -> None:
        self.public_key, self.secret_key, self.host = public_key, secret_key, host
        self.environment = environment
        self.timeout_s = timeout_s
        self.client: Any = None
        self._provider: Any = None
        self._tracer: Any = None
        self._dead = False

    def _start(self) -> None:
        from langfuse import Langfuse
        from opentelemetry.sdk.trace import TracerProvider

        self._provider = TracerProvider()
        self.client = Langfuse(
            public_key=self.public_key, secret_key=self.secret_key, base_url=self.host,
            tracer_provider=self._provider, environment=self.environment,
            timeout=self.timeout_s,
            should_export_span=lambda span: span.instrumentation_scope is not None
            and span.instrumentation_scope.name == self.SCOPE)
        self._tracer = self._provider.get_tracer(self.SCOPE)
        try:
            self.client.auth_check()  # raises when unreachable, unauthorized or failing
        except Exception:
            self._dead = True
            self._shutdown()
            raise

    def log_step(self, record: StepRecord) -> None:
        if self._dead:
            return
        if self.client is None:
            self._start()
        for gi, group in enumerate(record.groups):
            for ti, t in enumerate(group.trajectories):
                self._trajectory(record, gi, ti, t)
            for ei, exc in enumerate(group.exceptions):
                self._exception(record, gi, ei, exc)

    # ---- spans -----------------------------------------------------------------------------

    def trace_id(self, record: StepRecord, gi: int, ti: int, t: Trajectory) -> str:
        """The trace id of a trajectory: stable, so logging it again updates the same trace."""
        from langfuse import Langfuse

        first = next((turn.response_id for turn in t.turns if turn.response_id), None)
        seed = f"{record.project}/{record.model}/" + (
            first or f"{record.split}/{record.step}/{gi}/{ti}")
        return Langfuse.create_trace_id(seed=seed)

    def _root(self, trace_id: str, name: str, start_ns: int | None, attrs: dict[str, Any]) -> Any:
        from langfuse import LangfuseOtelSpanAttributes as A
        from opentelemetry import trace as otel
        from opentelemetry.sdk.trace.id_generator import RandomIdGenerator

        parent = otel.NonRecordingSpan(otel.SpanContext(
            trace_id=int(trace_id, 16), span_id=RandomIdGenerator().generate_span_id(),
            is_remote=False, trace_flags=otel.TraceFlags(0x01)))
        return self._tracer.start_span(name, context=otel.set_span_in_context(parent),
                                       start_time=start_ns, attributes={A.AS_ROOT: True, **attrs})

    def _child(self, root: Any, name: str, start_ns: int | None, end_ns: int | None,
               attrs: dict[str, Any]) -> None:
        from opentelemetry import trace as otel

        span = self._tracer.start_span(name, context=otel.set_span_in_context(root),
                                       start_time=start_ns, attributes=attrs)
        span.end(end_time=end_ns)

    def _trace_attrs(self, record: StepRecord, gi: int, extra: dict[str, Any]) -> dict[str, Any]:
        from langfuse import LangfuseOtelSpanAttributes as A

        meta = {"project": record.project, "model": record.model, "step": record.step,
                "split": record.split, "group": gi, **extra}
        return {A.TRACE_NAME: f"{record.model} {record.split} rollout",
                A.TRACE_TAGS: [record.split, record.project],
                **{f"{A.TRACE_METADATA}.{k}": json.dumps(v) for k, v in meta.items()
                   if v is not None}}

    def _trajectory(self, record: StepRecord, gi: int, ti: int, t: Trajectory) -> None:
        from langfuse import LangfuseOtelSpanAttributes as A

        trace_id = self.trace_id(record, gi, ti, t)
        timed = [turn for h in t.histories() for turn in h.turns if turn.started_at is not None]
        start = min((turn.started_at for turn in timed), default=None)
        end = max((turn.started_at + (turn.latency_s or 0.0) for turn in timed), default=None)
        first_reply = next((i for i, m in enumerate(t.messages) if m["role"] == "assistant"),
                           len(t.messages))
        attrs = self._trace_attrs(record, gi, {"trajectory": ti, **t.metadata})
        attrs.update({A.OBSERVATION_TYPE: "agent",
                      A.OBSERVATION_INPUT: json.dumps(t.messages[:first_reply]),
                      A.OBSERVATION_OUTPUT: json.dumps(t.messages[-1] if t.messages else None),
                      f"{A.OBSERVATION_METADATA}.reward": json.dumps(t.reward),
                      f"{A.OBSERVATION_METADATA}.metrics": json.dumps(t.metrics)})
        root = self._root(trace_id, "rollout", _ns(start), attrs)
        for h in t.histories():
            self._history(record, root, h)
        root.end(end_time=_ns(end))
        explanation = "\n".join(line for line in t.logs if line.startswith("RULER")) or None
        self.client.create_score(trace_id=trace_id, name="reward", value=float(t.reward),
                                 data_type="NUMERIC", comment=explanation)

    def _history(self, record: StepRecord, root: Any, h: History) -> None:
        from langfuse import LangfuseOtelSpanAttributes as A

        turns = {turn.message_index: turn for turn in h.turns}
        calls: dict[str, dict[str, Any]] = {}
        last_end: float | None = None  # end of the latest model call, for tool spans
        for i, m in enumerate(h.messages):
            turn = turns.get(i)
            if m["role"] == "assistant":
                for call in m.get("tool_calls") or []:
                    calls[call["id"]] = call
                if turn is None:
                    continue  # context, not sampled by this model: no generation
                begin = turn.started_at
                finish = None if begin is None else begin + (turn.latency_s or 0.0)
                usage = {"input": len(turn.prompt_token_ids),
                         "output": len(turn.completion_token_ids)}
                usage["total"] = usage["input"] + usage["output"]
                step = turn.step if turn.step is not None else record.step
                self._child(root, "chat", _ns(begin), _ns(finish), {
                    A.OBSERVATION_TYPE: "generation",
                    A.OBSERVATION_MODEL: f"{record.model}@{step}",
                    A.OBSERVATION_INPUT: json.dumps(h.messages[:i]),
                    A.OBSERVATION_OUTPUT: json.dumps(m),
                    A.OBSERVATION_USAGE_DETAILS: json.dumps(usage),
                    f"{A.OBSERVATION_METADATA}.finish_reason": json.dumps(turn.finish_reason),
                    f"{A.OBSERVATION_METADATA}.response_id": json.dumps(turn.response_id),
                })
                last_end = finish
            elif m["role"] == "tool":
                call = calls.get(m.get("tool_call_id", ""), {})
                fn = call.get("function", {})
                nxt = next((turns[j].started_at for j in sorted(turns) if j > i), None)
                begin = last_end
                self._child(root, fn.get("name") or "tool", _ns(begin),
                            _ns(nxt if nxt is not None else begin), {
                                A.OBSERVATION_TYPE: "tool",
                                A.OBSERVATION_INPUT: _json_or_text(fn.get("arguments")),
                                A.OBSERVATION_OUTPUT: json.dumps(m.get("content")),
                                f"{A.OBSERVATION_METADATA}.tool_call_id":
                                    json.dumps(m.get("tool_call_id")),
                                f"{A.OBSERVATION_METADATA}.timing":
                                    json.dumps("between model calls"),
                            })

    def _exception(self, record: StepRecord, gi: int, ei: int, exc: Any) -> None:
        from langfuse import Langfuse
        from langfuse import LangfuseOtelSpanAttributes as A

        trace_id = Langfuse.create_trace_id(
            seed=f"{record.project}/{record.model}/{record.split}/{record.step}/{gi}/error{ei}")
        attrs = self._trace_attrs(record, gi, {"failed": True})
        attrs.update({A.OBSERVATION_TYPE: "span", A.OBSERVATION_LEVEL: "ERROR",
                      A.OBSERVATION_STATUS_MESSAGE: f"{exc.type}: {exc.message}",
                      A.OBSERVATION_OUTPUT: json.dumps(exc.traceback)})
        now = time.time_ns()
        self._root(trace_id, "rollout failed", now, attrs).end(end_time=now)

    # ---- lifecycle -------------------------------------------------------------------------

    def flush(self) -> None:
        if self.client is not None and not self._dead:
            self._provider.force_flush()
            self.client.flush()

    def _shutdown(self) -> None:
        client, self.client = self.client, None
        if client is not None:
            client.shutdown()
        if self._provider is not None:
            self._provider.shutdown()

    def close(self) -> None:
        if not self._dead:
            self.flush()
        self._shutdown()


def _json_or_text(arguments: Any) -> str:
    """Tool-call arguments as JSON (they arrive as a JSON string, or already parsed)."""
    if isinstance(arguments, str):
        try:
            return json.dumps(json.loads(arguments))
        except ValueError:
            return json.dumps(arguments)
    return json.dumps(arguments)
