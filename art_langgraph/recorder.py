"""`TrajectoryRecorder`: one LangChain callback that turns a LangGraph run into a `Trajectory`.

How a run becomes a trajectory:

1. `on_chat_model_start` keeps each chat-model call's input messages (LangChain objects, not yet
   converted: converting on every call grows with the conversation), the tools offered (from the
   invocation parameters) and the endpoint it went to. `on_llm_end` keeps the output message and
   its response id. Subgraphs and nested runnables reach the same handler through the config.
2. `finish()` / `afinish()` converts everything once. Calls are taken in start order; a call whose
   input starts with an earlier conversation (its messages and its last answer) continues that
   conversation, any other call starts a new one. The conversation of the first call is the
   trajectory's main history; the others (a sub-agent, a summarizer) are `additional_histories`.
   Tool results that no later call saw (a graph that ends on a tool) come from `on_tool_end`.
3. The exact sampled tokens of every assistant turn come from the gateway's ledger, fetched in one
   batch per endpoint by response id (langchain-openai drops the token fields from responses).
   A turn whose tokens cannot be found is an error naming the model and response id; it is never
   trained as re-rendered text (ARCHITECTURE invariant 1). A run that recorded no chat-model call
   at all is an error too: silent empty trajectories are how zero-change capture fails.

One recorder records one rollout. Use a new one per rollout (or `record()`, which does that).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal
from uuid import UUID

from langchain_core.callbacks import BaseCallbackHandler

from art_core.model import Model, endpoint_api_key
from art_core.protocol import read_record
from art_core.recording import ToolEvent, count_tool_event
from art_core.trajectory import History, SampledTurn, Trajectory
from art_langgraph.ledger import fetch_records, fetch_records_async
from art_langgraph.messages import is_prefix, to_openai_message, to_openai_tools

log = logging.getLogger(__name__)

Reward = Callable[[Any], float]
"""`reward(final_state) -> float`: the graph's output (None if no graph ran) to a reward."""


class NothingRecordedError(RuntimeError):
    """The recording saw no chat-model call."""


class NoSampledTokensError(RuntimeError):
    """An assistant turn's sampled tokens are not in the gateway's ledger."""


NOTHING_RECORDED = (
    "the recorder saw no chat-model call. Check that: the graph was run with "
    "config={{'callbacks': [recorder]}} (or inside `with record():` in the same thread or "
    "asyncio task: threads you start yourself do not inherit it); the model is a LangChain chat "
    "model (ChatOpenAI / init_chat_model), not a raw openai client; the graph actually called "
    "it. {hint}"
)


@dataclass
class _Call:
    order: int
    inputs: list[Any]
    tools: Any
    model: str | None
    base_url: str | None
    output: Any = None
    response_id: str | None = None
    error: str | None = None


@dataclass
class _Conversation:
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    turns: list[tuple[int, _Call]] = field(default_factory=list)  # (message index, call)


class TrajectoryRecorder(BaseCallbackHandler):
    """Records every chat-model call of a run into `self.trajectory`.

    graph.invoke(inputs, config={"callbacks": [recorder]}); traj = recorder.finish()

    `model`: the served model (its gateway URL and key are used for the ledger); without it, the
    URL each ChatOpenAI was pointed at is used, with the key of a model registered in this
    process for that URL, else $ART_API_KEY. `reward(final_state)` sets the reward at finish.
    `on_missing="context"` keeps a turn without ledger tokens as untrained context (warned,
    counted in `metrics["untrained_turns"]`) instead of raising. `on_empty="warn"` warns instead of
    raising when nothing was recorded. `debug` (or $ART_RECORDER_DEBUG=1) prints each trajectory.
    """

    run_inline = True  # a sync handler on an async run would otherwise go to a thread pool
    raise_error = False  # our failures are kept and raised at finish(), not inside the graph

    def __init__(self, model: Model | None = None, *, base_url: str | None = None,
                 api_key: str | None = None, reward: Reward | None = None,
                 on_missing: Literal["raise", "context"] = "raise",
                 on_empty: Literal["raise", "warn"] = "raise", debug: bool | None = None,
                 trajectory: Trajectory | None = None) -> None:
        if on_missing not in ("raise", "context") or on_empty not in ("raise", "warn"):
            raise ValueError("on_missing must be 'raise' or 'context'; on_empty 'raise' or 'warn'")
        self.base_url = (base_url or (model.base_url if model else None) or "").rstrip("/") or None
        self.api_key = api_key if api_key is not None else (model.api_key if model else None)
        self.reward_fn = reward
        self.on_missing, self.on_empty = on_missing, on_empty
        self.debug = debug if debug is not None else os.environ.get("ART_RECORDER_DEBUG") == "1"
        self.trajectory = trajectory if trajectory is not None else Trajectory()
        self.final_state: Any = None
        self._calls: dict[UUID, _Call] = {}
        self._tool_outputs: dict[str, Any] = {}
        self._failures: list[str] = []
        self._lock = threading.Lock()
        self._finished = False

    # ---- callbacks (called by langchain-core) --------------------------------------------------

    def on_chat_model_start(self, serialized: dict[str, Any], messages: list[list[Any]], *,
                            run_id: UUID, **kwargs: Any) -> None:
        try:
            params = kwargs.get("invocation_params") or {}
            with self._lock:
                if run_id in self._calls:
                    return
                self._calls[run_id] = _Call(
                    order=len(self._calls), inputs=list(messages[0]), tools=params.get("tools"),
                    model=params.get("model") or params.get("model_name"),
                    base_url=_serialized_base_url(serialized))
        except Exception as e:  # noqa: BLE001 - kept and raised at finish()
            self._failures.append(f"on_chat_model_start: {type(e).__name__}: {e}")

    def on_llm_end(self, response: Any, *, run_id: UUID, **kwargs: Any) -> None:
        try:
            call = self._calls.get(run_id)
            if call is None:
                return  # a non-chat LLM: nothing to train
            gen = response.generations[0][0]
            call.output = getattr(gen, "message", None)
            call.response_id = _response_id(call.output, response)
        except Exception as e:  # noqa: BLE001
            self._failures.append(f"on_llm_end: {type(e).__name__}: {e}")

    def on_llm_error(self, error: BaseException, *, run_id: UUID, **kwargs: Any) -> None:
        call = self._calls.get(run_id)
        if call is not None:
            call.error = f"{type(error).__name__}: {error}"

    def on_tool_end(self, output: Any, *, run_id: UUID, **kwargs: Any) -> None:
        call_id = getattr(output, "tool_call_id", None)
        if call_id:
            with self._lock:
                self._tool_outputs[call_id] = output

    def on_chain_end(self, outputs: Any, *, run_id: UUID, parent_run_id: UUID | None = None,
                     **kwargs: Any) -> None:
        if parent_run_id is None:
            self.final_state = outputs

    # ---- art_core.Recorder: tool calls seen from the tool side (an MCP session) ---------------

    def record_tools(self, tools: list[dict[str, Any]]) -> None:
        """Tools come from the model calls' own parameters; nothing to add here."""

    def record_tool_event(self, event: ToolEvent) -> str | None:
        # The tool message itself reaches us through the graph; keep only the call's details.
        with self._lock:
            count_tool_event(self.trajectory, event)
        return None

    # ---- building the trajectory --------------------------------------------------------------

    @property
    def calls_recorded(self) -> int:
        return len(self._calls)

    def finish(self) -> Trajectory:
        """Join the ledger (blocking HTTP) and fill in `self.trajectory`; returns it."""
        convs, by_endpoint = self._prepare()
        records = {}
        for (url, key), ids in by_endpoint.items():
            records.update(fetch_records(url, ids, key))
        return self._complete(convs, records)

    async def afinish(self) -> Trajectory:
        """`finish()` for async code: the ledger is fetched without blocking the loop."""
        convs, by_endpoint = self._prepare()
        records = {}
        for (url, key), ids in by_endpoint.items():
            records.update(await fetch_records_async(url, ids, key))
        return self._complete(convs, records)

    def _prepare(self) -> tuple[list[_Conversation], dict[tuple[str, str | None], list[str]]]:
        if self._finished:
            raise RuntimeError("this recorder has already finished: use one per rollout")
        if self._failures:
            raise RuntimeError("the recorder failed while recording: " + "; ".join(self._failures))
        calls = sorted((c for c in self._calls.values() if c.output is not None),
                       key=lambda c: c.order)
        for c in self._calls.values():
            if c.error:
                self.trajectory.log(f"model call to {c.model} failed: {c.error}")
        if not calls:
            hint = (f"{len(self._calls)} call(s) started but none finished."
                    if self._calls else "")
            msg = NOTHING_RECORDED.format(hint=hint)
            if self.on_empty == "raise":
                raise NothingRecordedError(msg)
            warnings.warn(msg, stacklevel=3)
        by_endpoint: dict[tuple[str, str | None], list[str]] = {}
        for c in calls:
            url = self.base_url or c.base_url
            if c.response_id and url:
                key = self.api_key if self.api_key is not None else endpoint_api_key(url)
                by_endpoint.setdefault((url, key), []).append(c.response_id)
        return _conversations(calls, self._tool_outputs), by_endpoint

    def _complete(self, convs: list[_Conversation],
                  records: dict[str, dict[str, Any]]) -> Trajectory:
        missing: list[str] = []
        histories = []
        for conv in convs:
            turns = []
            for index, call in conv.turns:
                rec = records.get(call.response_id or "")
                sampled = read_record(rec) if rec is not None else None
                if sampled is None:
                    missing.append(f"model {call.model!r} at {self.base_url or call.base_url} "
                                   f"(response id {call.response_id!r})")
                    continue
                turns.append(SampledTurn(message_index=index, **sampled))
            histories.append(History(messages=conv.messages, tools=conv.tools, turns=turns))
        if missing:
            msg = (f"no sampled tokens for {len(missing)} assistant turn(s): "
                   + "; ".join(missing[:5])
                   + ". The gateway's ledger does not know these responses: was the model served "
                     "by the art gateway (a TrainableModel's base_url), and is the entry recent "
                     "enough not to be evicted?")
            if self.on_missing == "raise":
                raise NoSampledTokensError(msg)
            warnings.warn(msg + " They are kept as untrained context.", stacklevel=3)
            self.trajectory.metrics["untrained_turns"] = len(missing)
        t = self.trajectory
        if histories:
            main, *rest = histories
            t.messages, t.tools, t.turns = main.messages, main.tools, main.turns
            t.additional_histories = rest
        if self.reward_fn is not None:
            t.reward = float(self.reward_fn(self.final_state))
        Trajectory.model_validate(t.model_dump())  # the same checks as a fresh trajectory
        self._finished = True
        if self.debug:
            print(describe(t), file=sys.stderr)
        return t


def _conversations(calls: list[_Call], tool_outputs: dict[str, Any]) -> list[_Conversation]:
    """Calls in start order into conversations (see the module docstring, step 2)."""
    convs: list[_Conversation] = []
    for call in calls:
        inputs = [to_openai_message(m) for m in call.inputs]
        answer = to_openai_message(call.output)
        conv = next((c for c in reversed(convs) if is_prefix(c.messages, inputs)), None)
        if conv is None:
            conv = _Conversation(messages=[], tools=None)
            convs.append(conv)
        conv.messages = [*inputs, answer]
        conv.turns.append((len(inputs), call))
        for t in to_openai_tools(call.tools) or []:
            conv.tools = conv.tools or []
            if t["function"]["name"] not in {x["function"]["name"] for x in conv.tools}:
                conv.tools.append(t)
    for conv in convs:  # results of the last turn's tool calls, if no later call saw them
        for c in conv.messages[-1].get("tool_calls") or []:
            if c["id"] in tool_outputs:
                conv.messages.append(to_openai_message(tool_outputs[c["id"]]))
    return convs


def _serialized_base_url(serialized: dict[str, Any] | None) -> str | None:
    kwargs = (serialized or {}).get("kwargs") or {}
    url = kwargs.get("openai_api_base") or kwargs.get("base_url")
    return url.rstrip("/") if isinstance(url, str) else None


def _response_id(message: Any, response: Any) -> str | None:
    meta = getattr(message, "response_metadata", None) or {}
    rid = meta.get("id") or (getattr(response, "llm_output", None) or {}).get("id")
    if not rid:
        mid = getattr(message, "id", None)
        rid = mid if isinstance(mid, str) and not mid.startswith(("run-", "lc_run")) else None
    return rid


def describe(t: Trajectory) -> str:
    """A short human-readable dump of a trajectory (the debug switch prints this)."""
    lines = [f"trajectory: reward={t.reward} metrics={t.metrics}"]
    for h_i, h in enumerate(t.histories()):
        trained = {turn.message_index: turn for turn in h.turns}
        lines.append(f"  history {h_i}: {len(h.messages)} messages, "
                     f"{len(h.tools or [])} tools, {len(h.turns)} trained turns")
        for i, m in enumerate(h.messages):
            mark = f"[{len(trained[i].completion_token_ids)} tok]" if i in trained else ""
            text = (m.get("content") or "").replace("\n", " ")[:100]
            calls = ", ".join(f"{c['function']['name']}({c['function']['arguments'][:60]})"
                              for c in m.get("tool_calls") or [])
            lines.append(f"    {i:2d} {m['role']:9s}{mark} {text} {calls}".rstrip())
    return "\n".join(lines)
