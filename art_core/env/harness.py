"""Harness mode: train an agent program we do not own (any language, its own loop, the `openai`
SDK or plain HTTP) by handing it an OpenAI base URL that belongs to one rollout.

    rollout = await harness_rollout(model)
    proc = await asyncio.create_subprocess_exec("node", "agent.mjs",
                                                env={**os.environ, **rollout.env})
    await proc.wait()
    trajectory = await rollout.finish()      # every completion it made, exact tokens
    trajectory.reward = score(...)

`rollout.env` holds `OPENAI_BASE_URL`, `OPENAI_API_KEY` and `OPENAI_MODEL` (what the SDKs read);
nothing in the harness changes. The gateway records each chat completion made under that base
URL (art_core/inference/harness.py): the request's messages and tools, the answer, and the
sampled tokens, streamed or not. `finish()` closes the rollout (later requests get 409) and
builds the trajectory from the calls, in order:

1. A call whose request starts with the messages of a conversation already built (assistant
   messages compared by tool-call ids, else by text, as the gateway's splicer does) continues
   that conversation: its request's messages replace the conversation's, and its answer is
   appended with the sampled tokens as a turn. Otherwise it starts a new conversation (a
   sub-agent, or a harness that rewrote its history).
2. The conversation with the most sampled turns (the first on a tie) is the trajectory's main
   one; the others are its `additional_histories`, trained alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from art_core.protocol import message_key, read_record
from art_core.trajectory import History, SampledTurn, Trajectory


class HarnessError(RuntimeError):
    """The gateway refused a harness rollout call (the message says why)."""


@dataclass
class HarnessRollout:
    """One rollout of a harness: hand `env` (or `base_url`/`api_key`) to the program."""

    id: str
    base_url: str
    api_key: str
    model: str
    _root: str

    @property
    def env(self) -> dict[str, str]:
        return {"OPENAI_BASE_URL": self.base_url, "OPENAI_API_KEY": self.api_key,
                "OPENAI_MODEL": self.model}

    async def finish(self) -> Trajectory:
        """Close the rollout and build its Trajectory (the module docstring)."""
        data = await _post(f"{self._root}/art/rollouts/{self.id}/finish", {}, self.api_key)
        trajectory = build_trajectory(data["calls"])
        trajectory.metadata["harness_rollout"] = self.id
        return trajectory


async def _post(url: str, body: dict[str, Any], api_key: str) -> dict[str, Any]:
    import httpx

    async with httpx.AsyncClient(timeout=60.0) as client:
        r = await client.post(url, json=body, headers={"Authorization": f"Bearer {api_key}"})
    if r.status_code >= 400:
        try:
            message = r.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = r.text[:300]
        raise HarnessError(f"{url}: {r.status_code} {message}")
    return r.json()


async def harness_rollout(model: Any) -> HarnessRollout:
    """Open a rollout of `model` (registered, e.g. a TrainableModel) on its gateway."""
    if model.base_url is None:
        raise RuntimeError(f"model {model.name!r} has no endpoint yet: await "
                           "model.register(backend) first")
    root = model.base_url.rstrip("/")  # ".../v1"
    api_key = model.api_key or "none"
    data = await _post(f"{root}/art/rollouts", {"model": model.name}, api_key)
    gateway = root[: -len("/v1")] if root.endswith("/v1") else root
    return HarnessRollout(id=data["id"], base_url=gateway + data["path"], api_key=api_key,
                          model=model.name, _root=root)


def _keys(messages: list[dict[str, Any]]) -> list[str]:
    return [message_key(m) for m in messages]


def build_trajectory(calls: list[dict[str, Any]]) -> Trajectory:
    """A Trajectory from a harness rollout's recorded calls (the module docstring); a rollout
    that made no call is an error (there is nothing to train)."""
    if not calls:
        raise HarnessError("the harness made no chat completion through its rollout's base URL "
                           "(was OPENAI_BASE_URL passed to it?)")
    conversations: list[History] = []
    for n, call in enumerate(calls):
        request = [dict(m) for m in call["messages"] or []]
        keys = _keys(request)
        sampled = read_record(call["record"])
        if sampled is None:
            raise HarnessError(f"call {n} of the rollout carries no sampled tokens")
        fits = [h for h in conversations
                if _keys(h.messages) == keys[: len(h.messages)]]
        conversation = max(fits, key=lambda h: len(h.messages), default=None)
        if conversation is None:
            conversation = History(tools=call.get("tools"))
            conversations.append(conversation)
        turn = SampledTurn(message_index=len(request), **sampled)
        conversation.messages = [*request, dict(call["message"])]
        conversation.turns = [*conversation.turns, turn]
        conversation.tools = call.get("tools") or conversation.tools
    main = max(conversations, key=lambda h: len(h.turns))  # the first on a tie
    others = [h for h in conversations if h is not main]
    return Trajectory(messages=main.messages, tools=main.tools, turns=main.turns,
                      additional_histories=others)
